"""Pull a weight into the GPU's L2 cache ahead of the kernel that reads it.

A decode step's linears stream their weights from HBM, and between them run kernels that leave
most of the bandwidth idle: attention over a short context is bound by the latency of its loads,
the norms and rotary by their launches. :func:`prefetch` asks the memory system to copy the first
bytes of the next linear's weight into L2 while those kernels run (Hopper's bulk L2 prefetch,
``cp.async.bulk.prefetch.L2``, one instruction per ``CHUNK_BYTES`` that holds no register and
waits for nothing), so the linear finds them there.

A prefetch is a hint: it changes no value anywhere, only where the bytes come from, and the
hardware may drop it. It launches as one small kernel which, with dependent launch
(:mod:`tpspec.model.dependent_launch`), lets the next kernel start at once and waits for the
kernel before it before it ends, so the chain of waits between the step's kernels stays whole.

This module imports ``triton``; the kernel runs only on CUDA GPUs of compute capability 9.0 or
later (the interpreter has no inline assembly): elsewhere :func:`prefetch` does nothing.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from .dependent_launch import pdl_args

CHUNK_BYTES = 16384  # bytes one prefetch instruction asks for (a multiple of 16)
CHUNKS_PER_PROGRAM = 128  # one per thread of a 4-warp program


@triton.jit
def _prefetch_kernel(base_ptr, chunks, chunk_bytes, PER_PROGRAM: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # let the next kernel start now; end only after the kernel before has ended
        tl.extra.cuda.gdc_launch_dependents()
    i = tl.program_id(0) * PER_PROGRAM + tl.arange(0, PER_PROGRAM)
    addr = base_ptr + i.to(tl.int64) * chunk_bytes
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $3; mov.b32 $0, 0; }",
        "=r,l,r,r", [addr, (i < chunks).to(tl.int32), tl.full([PER_PROGRAM], chunk_bytes, tl.int32)],
        dtype=tl.int32, is_pure=False, pack=1)
    if PDL:
        tl.extra.cuda.gdc_wait()


INTERPRETED = isinstance(_prefetch_kernel, InterpretedFunction)


@functools.lru_cache(maxsize=None)
def _has_bulk_prefetch(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (9, 0)


def runs_on(device: torch.device) -> bool:
    """Whether :func:`prefetch` launches anything on ``device``: a CUDA GPU of compute capability
    9.0 or later, compiled (not Triton's interpreter). Reads only the device: the same on every
    rank of a group of like GPUs."""
    if INTERPRETED or device.type != "cuda":
        return False
    return _has_bulk_prefetch(device.index if device.index is not None else torch.cuda.current_device())


def prefetch(t: torch.Tensor, max_bytes: int) -> None:
    """Ask for the first ``min(max_bytes, t's bytes)`` bytes of contiguous tensor ``t``, in whole
    ``CHUNK_BYTES``, to be copied into L2 (a hint: no value changes). Launches one kernel on the
    current stream where :func:`runs_on` says so, else nothing. No host synchronization:
    capturable in a CUDA graph."""
    if max_bytes <= 0 or not runs_on(t.device):
        return
    if not t.is_contiguous():
        raise ValueError("prefetch needs a contiguous tensor")
    chunks = min(max_bytes, t.numel() * t.element_size()) // CHUNK_BYTES
    if chunks == 0:
        return
    base = t.view(-1).view(torch.uint8)
    _prefetch_kernel[(triton.cdiv(chunks, CHUNKS_PER_PROGRAM),)](
        base, chunks, CHUNK_BYTES, PER_PROGRAM=CHUNKS_PER_PROGRAM, num_warps=4, **pdl_args(t.device))
