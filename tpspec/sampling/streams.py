"""Per-request Philox streams: which ``(seed, offset)`` every random draw uses.

A draw is keyed by a 64-bit seed and a 64-bit offset (plus the global column, see
``tpspec.keys``). Each step a request gets a *window* of offsets: one *slot* of
:data:`SLOT_SPAN` offsets for every row it samples, in a fixed layout that depends only
on ``max_draft_len`` (so a request's draws never depend on the rest of the batch)::

    slot i            target row i            (i = 0 .. max_draft_len)
    slot D+1+j        draft step j            (j = 0 .. max_draft_len-1, D = max_draft_len)
    slot 2D+1         the acceptance kernel   (sub-offset 0: uniforms, 1: residual/bonus draw)

Seeded requests use their own seed and a counter per KV slot: window ``n`` of a
request starts at offset ``n * window_span``, and the counter restarts at 0 when a new
request takes the slot. So, given identical logits, a seeded request draws the same tokens
whatever its batch, batch position or slot history (a request keeps its KV slot for its whole life).

Unseeded requests use seed :data:`UNSEEDED_SEED` (42) and take consecutive windows
from one shared counter starting at :data:`UNSEEDED_OFFSET_BASE` (2**62), far past any
offset a seeded request reaches, so no user seed (42 included) replays them and no two
unseeded requests ever share a window. Under attention DP each rank of a TP group owns
its requests; its unseeded windows live in a disjoint sub-range (``partition``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Sequence

import torch

from ..keys import philox_words

SLOT_SPAN = 32
"""Philox offsets reserved for one sampled row of one step (sub-streams of the row)."""

UNSEEDED_SEED = 42
UNSEEDED_OFFSET_BASE = 1 << 62
PARTITION_SHIFT = 54
"""Unseeded windows of partition ``p`` start at ``UNSEEDED_OFFSET_BASE + (p << PARTITION_SHIFT)``."""
MAX_PARTITIONS = 1 << (62 - PARTITION_SHIFT)

PADDING_OFFSET = -1
"""Offset given to padding requests (they are greedy: their noise is never used)."""

ACCEPT_UNIFORM_SUBSTREAM = 0
ACCEPT_RESIDUAL_SUBSTREAM = 1


@dataclass(frozen=True)
class WindowLayout:
    """Where each sampled row of a step lives inside a request's window (offsets)."""

    max_draft_len: int

    def __post_init__(self) -> None:
        if not isinstance(self.max_draft_len, int) or self.max_draft_len < 0:
            raise ValueError(f"max_draft_len must be an int >= 0, got {self.max_draft_len!r}")

    @property
    def num_slots(self) -> int:
        return 2 * self.max_draft_len + 2

    @property
    def span(self) -> int:
        """Offsets one window takes."""
        return self.num_slots * SLOT_SPAN

    def target_row(self, i: int) -> int:
        """Offset (inside the window) of target row ``i`` (0 .. max_draft_len)."""
        if not 0 <= i <= self.max_draft_len:
            raise ValueError(f"target row {i} is out of range [0, {self.max_draft_len}]")
        return i * SLOT_SPAN

    def draft_step(self, j: int) -> int:
        """Offset (inside the window) of draft step ``j`` (0 .. max_draft_len - 1)."""
        if not 0 <= j < self.max_draft_len:
            raise ValueError(f"draft step {j} is out of range [0, {self.max_draft_len})")
        return (self.max_draft_len + 1 + j) * SLOT_SPAN

    @property
    def acceptance(self) -> int:
        """Offset (inside the window) of the acceptance kernel's slot."""
        return (2 * self.max_draft_len + 1) * SLOT_SPAN


class StreamAllocator:
    """Host-side window counters: per KV slot for seeded requests, one shared for unseeded.

    ``begin_step(requests)`` hands every request of a step its ``(seed, window_base)``
    and advances the counters. Deterministic: ranks that see the same sequence of
    batches (every rank of a TP group without attention DP) compute the same windows.
    """

    def __init__(self, num_slots: int, layout: WindowLayout, partition: int = 0) -> None:
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        if not 0 <= partition < MAX_PARTITIONS:
            raise ValueError(f"partition={partition} is out of range [0, {MAX_PARTITIONS})")
        self.num_slots = num_slots
        self.layout = layout
        self.partition = partition
        self.slot_owner: list[Hashable | None] = [None] * num_slots
        self.slot_counter: list[int] = [0] * num_slots
        self.unseeded_counter = 0

    def begin_step(self, requests: Sequence[tuple[Hashable, int, int | None]]) -> list[tuple[int, int]]:
        """``requests``: ``(request_id, slot_id, seed_int64 or None)``; ``slot_id = -1`` marks a
        padding request. Returns ``(seed, window_base)`` per request (int64 bit patterns).

        Raises ``ValueError`` for a slot out of range or used twice in one step.
        """
        seen: set[int] = set()
        out: list[tuple[int, int]] = []
        span = self.layout.span
        for request_id, slot, seed in requests:
            if slot == -1:
                out.append((UNSEEDED_SEED, PADDING_OFFSET))
                continue
            if not 0 <= slot < self.num_slots:
                raise ValueError(f"slot_id={slot} of request {request_id!r} is out of range [0, {self.num_slots})")
            if slot in seen:
                raise ValueError(f"slot_id={slot} is used by two requests in one step")
            seen.add(slot)
            if self.slot_owner[slot] != request_id:
                # A new request took the slot: its stream starts from the beginning.
                self.slot_owner[slot] = request_id
                self.slot_counter[slot] = 0
            if seed is not None:
                out.append((seed, self.slot_counter[slot] * span))
            else:
                base = UNSEEDED_OFFSET_BASE + (self.partition << PARTITION_SHIFT)
                out.append((UNSEEDED_SEED, base + self.unseeded_counter * span))
                self.unseeded_counter += 1
            self.slot_counter[slot] += 1
        return out

    def release(self, slot: int) -> None:
        """Forget the slot's owner (the next request that takes it restarts its stream anyway)."""
        self.slot_owner[slot] = None
        self.slot_counter[slot] = 0


def uniforms(seeds: torch.Tensor, offsets: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    """Uniforms in (0, 1) from the Philox stream: ``(h + 0.5) * 2**-32`` as float64 (exact).

    ``seeds``/``offsets``: ``[R]`` int64; ``columns``: ``[C]`` int64. Returns ``[R, C]``
    float64; equal on every device and rank for equal inputs.
    """
    words = philox_words(seeds, offsets, columns)
    return (words.to(torch.float64) + 0.5) * (2.0**-32)
