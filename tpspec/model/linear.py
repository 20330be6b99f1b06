"""The decoder's matrix-vector products: ``F.linear``, or the Triton GEMV where one rule says.

:func:`linear` is what the column- and row-parallel linears and the vocabulary-parallel LM head
call outside deterministic mode. :func:`use_triton_linear` is the one rule that sends a call to
:func:`tpspec.model.gemv_triton.linear` (decode-sized batches, read at the weights' memory
bandwidth); everything else, and everything while ``TRITON_GEMV`` is off, runs ``F.linear``.
This module imports no ``triton``: the kernels' module is imported on the first call the rule
accepts.
"""

from __future__ import annotations

import functools
import importlib
from typing import Any

import torch
import torch.nn.functional as F

TRITON_GEMV = False
"""Whether decode-sized linears run the Triton GEMV. Off: its ``gpu`` tests in
``tests/test_gemv_triton.py`` pass, but ``tpspec bench gemv`` has not shown it ahead of cuBLAS at
decode sizes (``docs/benchmarks.md``)."""

MAX_TRITON_ROWS = 16
_TRITON_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@functools.lru_cache(maxsize=None)
def gemv_kernels() -> Any:
    """:mod:`tpspec.model.gemv_triton`, or None where ``triton`` does not import."""
    try:
        return importlib.import_module(f"{__package__}.gemv_triton")
    except ImportError:
        return None


def use_triton_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """Whether :func:`linear` runs the Triton GEMV for these tensors.

    Yes when ``TRITON_GEMV`` is on; ``x`` is ``[M, K]`` with ``1 <= M <= 16`` and ``weight`` a
    contiguous ``[N, K]``, ``K`` a multiple of 8, 16-byte aligned (whole 16-byte loads of every
    row); ``x``, ``weight`` and ``bias`` share a dtype of float32, float16, bfloat16 and a device;
    nothing needs gradients; and the kernels can run there: CUDA with ``triton`` compiled, or CPU
    under Triton's interpreter (``TRITON_INTERPRET=1``; not bfloat16 there). Reads only shapes, dtypes, devices and
    pointers: no host synchronization, the same answer on every rank of a TP group.
    """
    if not TRITON_GEMV:
        return False
    if x.dim() != 2 or weight.dim() != 2 or not 1 <= x.shape[0] <= MAX_TRITON_ROWS:
        return False
    k = weight.shape[1]
    if x.shape[1] != k or k % 8 or not weight.is_contiguous() or weight.data_ptr() % 16:
        return False
    if x.dtype not in _TRITON_DTYPES or weight.dtype != x.dtype or x.device != weight.device:
        return False
    if bias is not None and (bias.dtype != x.dtype or bias.device != x.device or not bias.is_contiguous()):
        return False
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return False  # the kernel has no backward
    if x.device.type not in ("cuda", "cpu"):
        return False
    kernels = gemv_kernels()
    if kernels is None or kernels.INTERPRETED != (x.device.type == "cpu"):
        return False
    return not (kernels.INTERPRETED and x.dtype == torch.bfloat16)  # the interpreter's tl.dot has none


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``: through the Triton GEMV where :func:`use_triton_linear`
    says so (float32 accumulation, one rounding to ``x``'s dtype), else ``F.linear`` itself."""
    if use_triton_linear(x, weight, bias):
        return gemv_kernels().linear(x, weight, bias)
    return F.linear(x, weight, bias)
