"""Counters that let the last program of a split launch combine the splits itself.

A split launch cuts one output's reduction over several programs, each storing a float32 partial
that a second kernel combines. With a counter, the launch needs no second kernel: each program,
once its partial is stored, counts itself on its output's counter (:func:`last_split`); the program
that counts last reads every partial, combines them in split order (the second kernel's arithmetic,
so the same bits) and sets the counter back to zero for the next launch.

The counters are one int32 tensor per device (:func:`split_counters`), zero between launches.
Launches on one device share them, so two launches that use them must not run at once: kernels of
one stream never do (each waits for the one before, dependent launch included).

This module imports ``triton``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_COUNTERS = 4096  # outputs one launch may count (more: the combining kernel runs)

_COUNTERS: dict[torch.device, torch.Tensor] = {}


def split_counters(device: torch.device, outputs: int) -> torch.Tensor | None:
    """The counters of ``device`` for a launch of ``outputs`` split outputs, or None where the
    combining kernel must run instead: more than ``MAX_COUNTERS`` outputs, or no counters yet while
    a CUDA graph is being captured (they are made outside any graph's memory pool, on the first
    call outside a capture; a graph keeps reading the same tensor on every replay)."""
    if outputs > MAX_COUNTERS:
        return None
    counters = _COUNTERS.get(device)
    if counters is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        counters = _COUNTERS[device] = torch.zeros(MAX_COUNTERS, dtype=torch.int32, device=device)
    return counters


@triton.jit
def last_split(counter_ptr, splits):
    """Count this program's split of its output as done, once its partials are stored; True for the
    program that counts last (it then combines every split and sets the counter back to zero).

    The barrier orders the stores of every thread of the program before the count; the count's
    release (GPU scope) publishes them, and its acquire, in the last program, makes every other
    split's partials visible to the loads that follow (which must bypass L1: ``.cg``). The
    pattern of a grid-wide barrier."""
    tl.debug_barrier()
    return tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu") == splits - 1
