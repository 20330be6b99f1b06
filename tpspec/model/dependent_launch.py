"""Programmatic dependent launch (PDL) of the decoder's Triton kernels: the switch and its one rule.

Between two kernels of one stream the GPU normally waits for the first to finish, flushes its
writes, and only then starts the second: a gap per kernel boundary, hundreds of them in a decode
step. With PDL (Hopper and later) a kernel launched with the ``launch_pdl`` option may start while
the kernel before it is still running: it runs up to ``griddepcontrol.wait``
(``tl.extra.cuda.gdc_wait``), which returns once the previous kernel has finished and its writes
are visible, and the previous kernel lets it start by ``griddepcontrol.launch_dependents``
(``gdc_launch_dependents``). So the launch, and whatever reads only data no kernel of the step
writes (the weights), overlap the previous kernel's tail.

The decoder's kernels (:mod:`tpspec.model.gemv_triton`, :mod:`tpspec.model.fused_triton`,
:mod:`tpspec.model.paged_attention_triton`) take a ``PDL`` flag, which :func:`pdl_args` passes
together with the launch option: when set, each waits before its first access to memory another
kernel writes, loads or stores alike, and only the GEMVs read the first tile of their weights
before it. A kernel launched after them without the option (cuBLAS,
torch, NCCL) waits as usual. The values are those of ordinary launches, bit for bit; only the
timing moves. Inside a CUDA graph the option becomes a programmatic edge between the two nodes.

This module imports ``triton`` only to ask whether it has those instructions (on CUDA, where the
kernels need it anyway).
"""

from __future__ import annotations

import functools

import torch

PDL_KERNELS = True
"""Whether the decoder's Triton kernels launch with PDL on GPUs that have it. On: a GPU run of
``tests/test_dependent_launch.py``'s ``gpu`` tests passed (every kernel with PDL gives the bits of
an ordinary launch, eagerly and in a CUDA graph; an engine's tokens are the same)."""


@functools.lru_cache(maxsize=None)
def _has_pdl(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (9, 0)


@functools.lru_cache(maxsize=None)
def _triton_has_pdl() -> bool:
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
        from triton.language.extra import cuda
    except ImportError:
        return False
    return (hasattr(cuda, "gdc_wait") and hasattr(cuda, "gdc_launch_dependents")
            and "launch_pdl" in getattr(CUDAOptions, "__dataclass_fields__", {}))


def use_pdl(device: torch.device) -> bool:
    """Whether kernels on ``device`` launch with PDL: ``PDL_KERNELS`` on, a CUDA device of compute
    capability 9.0 or later (never on CPU, so never under Triton's interpreter) and a ``triton``
    that has the grid-dependency instructions. Reads only the device and the installed
    ``triton``: the same answer for every kernel of a step and on every rank of a group of like GPUs."""
    if not PDL_KERNELS or device.type != "cuda":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _has_pdl(index) and _triton_has_pdl()


def pdl_args(device: torch.device) -> dict:
    """What a launch of one of these kernels on ``device`` passes, from :func:`use_pdl`: the
    kernel's ``PDL`` flag and, only with it on, the ``launch_pdl`` option. One dict for both, so a
    kernel never launches early without waiting, and a ``triton`` that has no such option never
    sees it."""
    on = use_pdl(device)
    return {"PDL": True, "launch_pdl": True} if on else {"PDL": False}
