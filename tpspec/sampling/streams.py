"""Per-request Philox streams: which ``(seed, offset)`` every random draw uses.

A draw is keyed by a 64-bit seed and a 64-bit offset (plus the global column, see
``tpspec.keys``). Every draw of a request belongs to one **output position** ``p`` (0 for its
first generated token) and one *lane*; the offset is::

    offset = stream_base + p * SLOT_SPAN + lane

    lane TARGET_LANE            the target's token at position p (a target logits row)
    lane DRAFT_LANE             the sampled draft step that proposes position p
    lane ACCEPT_UNIFORM_LANE    the acceptance uniform of the draft at position p (column 0)
    lane ACCEPT_RESIDUAL_LANE   the residual (or bonus) race that emits position p

So the noise of position ``p`` depends only on the request's stream and ``p``: not on the
step, the batch, the number of drafts a step carries, or how many steps it took to reach
``p``. Under strict acceptance a seeded request therefore draws the same tokens with or
without speculation, at any draft length, given identical logits (``docs/determinism.md``).

Seeded requests: ``seed`` is the user's seed (its 64-bit pattern), ``stream_base`` 0.
Unseeded requests: ``seed`` is the request's stream number (the engine: its admission
number; else one the metadata hands each new request id, see :class:`StreamAllocator`), and
``stream_base`` :data:`UNSEEDED_OFFSET_BASE` (2**62), beyond every offset a seeded request
reaches (positions stay below :data:`MAX_POSITION`), so no user seed replays an unseeded
request and no two unseeded requests share a stream.
"""

from __future__ import annotations

from typing import Hashable, Sequence

import torch

from ..keys import philox_words
from ..validation import is_int

SLOT_SPAN = 32
"""Philox offsets reserved for one output position (its lanes; the rest are spare)."""

TARGET_LANE = 0
DRAFT_LANE = 1
ACCEPT_UNIFORM_LANE = 2
ACCEPT_RESIDUAL_LANE = 3

UNSEEDED_OFFSET_BASE = 1 << 62
MAX_POSITION = 1 << 56
"""Output positions must lie below this (offsets of seeded requests stay below 2**61)."""
MAX_STREAM = 1 << 63
"""Explicit stream numbers of unseeded requests lie in ``[0, 2**63)``."""
PARTITION_SHIFT = 55
MAX_PARTITIONS = 1 << 8
"""Streams the allocator numbers itself: ``2**63 | partition << 55 | counter`` (negative as int64)."""

PADDING_SEED = 0
PADDING_OFFSET = -1
"""Stream of padding requests (they are greedy: their noise is never used)."""


def position_offset(base: int, position: int, lane: int = TARGET_LANE) -> int:
    """The offset of ``lane`` at output ``position`` of a stream starting at ``base``."""
    return base + position * SLOT_SPAN + lane


class StreamAllocator:
    """Each request's stream ``(seed, stream_base)``.

    Seeded requests use their seed. Unseeded ones use their explicit stream number when the
    caller gives one (the engine does: the request's admission number, equal on every rank,
    kept through a request's whole life) or, without one, a number handed to each new
    request id in order of first sight (``release`` forgets an id); under attention DP each
    rank of a TP group numbers its own requests in a disjoint range (``partition``).
    Deterministic: ranks that see the same sequence of batches get the same streams.
    """

    def __init__(self, partition: int = 0) -> None:
        if not 0 <= partition < MAX_PARTITIONS:
            raise ValueError(f"partition={partition} is out of range [0, {MAX_PARTITIONS})")
        self.partition = partition
        self.numbered: dict[Hashable, int] = {}
        self.counter = 0

    def streams(self, requests: Sequence[tuple[Hashable, bool, int | None, int | None]]) -> list[tuple[int, int]]:
        """``requests``: ``(request_id, is_padding, seed_int64 or None, stream or None)``.
        Returns ``(seed, stream_base)`` per request, int64 bit patterns."""
        out: list[tuple[int, int]] = []
        for request_id, is_padding, seed, stream in requests:
            if is_padding:
                out.append((PADDING_SEED, PADDING_OFFSET))
            elif seed is not None:
                out.append((seed, 0))
            else:
                if stream is None:
                    stream = self.numbered.get(request_id)
                    if stream is None:
                        if self.counter >= 1 << PARTITION_SHIFT:
                            raise RuntimeError("the stream allocator ran out of stream numbers")
                        stream = (1 << 63 | self.partition << PARTITION_SHIFT | self.counter) - (1 << 64)
                        self.counter += 1
                        self.numbered[request_id] = stream
                out.append((stream, UNSEEDED_OFFSET_BASE))
        return out

    def release(self, request_id: Hashable) -> None:
        """Forget the number given to ``request_id`` (it finished); unknown ids are ignored."""
        self.numbered.pop(request_id, None)


def check_position(name: str, value: object) -> int:
    """``value`` as an output position in ``[0, MAX_POSITION)`` (``ValueError`` otherwise)."""
    if not is_int(value) or not 0 <= value < MAX_POSITION:
        raise ValueError(f"{name} must be an int in [0, 2**56), got {value!r}")
    return int(value)


def check_stream(name: str, value: object) -> int | None:
    """``value`` as an explicit stream number in ``[0, 2**63)`` or None (``ValueError`` otherwise)."""
    if value is None:
        return None
    if not is_int(value) or not 0 <= value < MAX_STREAM:
        raise ValueError(f"{name} must be None or an int in [0, 2**63), got {value!r}")
    return int(value)


def uniforms(seeds: torch.Tensor, offsets: torch.Tensor, columns: torch.Tensor,
             column_range: tuple[int, int] | None = None) -> torch.Tensor:
    """Uniforms in (0, 1) from the Philox stream: ``(h + 0.5) * 2**-32`` as float64 (exact).

    ``seeds``/``offsets``: ``[R]`` int64; ``columns``: ``[C]`` int64. Returns ``[R, C]``
    float64; equal on every device and rank for equal inputs. ``column_range``: ``(min, max)``
    of ``columns`` when known (no host sync; see :func:`~tpspec.keys.philox_words`).
    """
    words = philox_words(seeds, offsets, columns, column_range)
    return (words.to(torch.float64) + 0.5) * (2.0**-32)


def acceptance_uniforms(seeds: torch.Tensor, offsets: torch.Tensor, num_drafts: int) -> torch.Tensor:
    """``[B, D]`` float64 acceptance uniforms: draft ``j`` of a request whose first emitted
    position this step has stream offset ``offsets[b]`` (its target lane) reads lane
    :data:`ACCEPT_UNIFORM_LANE` of position ``p + j`` (column 0). ``seeds``/``offsets``: ``[B]``."""
    batch = seeds.shape[0]
    device = offsets.device
    steps = torch.arange(num_drafts, dtype=torch.int64, device=device) * SLOT_SPAN + (ACCEPT_UNIFORM_LANE - TARGET_LANE)
    at = (offsets.to(torch.int64).reshape(-1, 1) + steps.reshape(1, -1)).reshape(-1)
    column = torch.zeros(1, dtype=torch.int64, device=device)
    u = uniforms(seeds.to(torch.int64).repeat_interleave(num_drafts), at, column, column_range=(0, 0))
    return u.reshape(batch, num_drafts)


def residual_offsets(offsets: torch.Tensor, emitted_at: torch.Tensor) -> torch.Tensor:
    """``[B]`` int64 offsets of the residual race emitting position ``p + n`` (``emitted_at`` =
    ``n``, ``[B]``), for requests whose position ``p`` has stream offset ``offsets``."""
    return offsets.to(torch.int64) + emitted_at.to(torch.int64) * SLOT_SPAN + (ACCEPT_RESIDUAL_LANE - TARGET_LANE)
