"""Repetition, presence and frequency penalties on vocabulary-sharded logits.

The meaning is vLLM's, applied to the raw logits before temperature and filters. For a
row whose request has seen token ``v`` (in its prompt or its output):

* ``repetition_penalty`` r (1 = off): ``l_v / r`` when ``l_v > 0``, else ``l_v * r``, for
  every ``v`` seen in the prompt OR the output;
* ``presence_penalty`` p: ``l_v - p`` once for every ``v`` seen in the output;
* ``frequency_penalty`` f: ``l_v - f * count_v``, ``count_v`` its occurrences in the output.

In a verification step a generation request has ``D + 1`` logits rows; row ``j`` is the
target's distribution after drafts ``0 .. j-1``, so those drafts count as output there.

Each rank keeps the counts of ITS OWN columns only (:class:`OccurrenceCounts`,
``[slots, shard_width]``) and penalises its own slice (:func:`apply_penalties`): every
column's result depends only on that column's logit, counts and the row's parameters, so
no rank needs another's counts and nothing crosses between ranks. The arithmetic is plain
float32, one rounding per operation in a fixed order (division, multiplication,
subtraction; no fused multiply-add), so a column gets the same bits whatever the TP size
and on CPU and GPU alike: the full-row reference is the same function with
``vocab_offset=0`` and the whole vocabulary as the slice. A row with neutral parameters
(1, 0, 0) keeps its logits' exact values.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from ..validation import check_int
from ..vocab_parallel import VocabShardedLogits, use_key_kernels


COUNT_KERNEL = True
"""Whether :meth:`OccurrenceCounts.add` counts a step's tokens in one kernel
(:func:`tpspec.sampling.kernels_triton.count_tokens`) where the key kernels run, rather than a chain of
torch ops ending in an accumulating ``index_put_``. On: its GPU test passed on an H100
(``tests/test_key_kernels.py``, and the graphed steps of ``tests/test_runtime_gpu.py`` with it on)."""


class OccurrenceCounts:
    """Per-KV-slot token occurrences of one rank's vocabulary columns.

    Covers global columns ``[vocab_offset, vocab_offset + width)`` for ``num_slots`` KV
    slots: ``output_counts`` ``[num_slots, width]`` int32 (occurrences in the output so
    far) and ``prompt_seen`` ``[num_slots, width]`` bool. Tokens outside this rank's
    columns are ignored, so every rank runs the same calls with the same arguments and
    each ends up holding its own columns' share. The tables are allocated on first use.
    Updates are tensor ops without host syncs (tokens of other ranks' columns or of no slot
    land in a sink column that is never read; rows without a request read an all-zero sink row).
    """

    def __init__(self, num_slots: int, *, vocab_offset: int, width: int,
                 device: str | torch.device = "cpu") -> None:
        for name, value, low in (("num_slots", num_slots, 1), ("vocab_offset", vocab_offset, 0), ("width", width, 1)):
            check_int(f"OccurrenceCounts.{name}", value, low=low)
        self.num_slots = num_slots
        self.vocab_offset = vocab_offset
        self.width = width
        self.device = torch.device(device)
        self._counts: torch.Tensor | None = None  # [num_slots + 1, width + 1] int32; last row/column: sinks
        self._seen: torch.Tensor | None = None  # [num_slots + 1, width + 1] bool

    @property
    def table_bytes(self) -> int:
        """Bytes the tables take once allocated (int32 counts and bool flags, a sink row and column)."""
        return (self.num_slots + 1) * (self.width + 1) * (4 + 1)

    def _tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._counts is None or self._seen is None:
            shape = (self.num_slots + 1, self.width + 1)
            self._counts = torch.zeros(shape, dtype=torch.int32, device=self.device)
            self._seen = torch.zeros(shape, dtype=torch.bool, device=self.device)
        return self._counts, self._seen

    @property
    def output_counts(self) -> torch.Tensor:
        """``[num_slots, width]`` int32 output occurrences per slot and local column."""
        return self._tables()[0][: self.num_slots, : self.width]

    @property
    def prompt_seen(self) -> torch.Tensor:
        """``[num_slots, width]`` bool: the local column's token is in the slot's prompt."""
        return self._tables()[1][: self.num_slots, : self.width]

    def tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(counts, seen)``, ``[num_slots + 1, width + 1]`` each (int32, bool), allocated on first
        use: the slots' rows, then the sink row of zeros that rows without a request read, and the
        sink column, never read."""
        return self._tables()

    def check_covers(self, vocab_offset: int, width: int) -> None:
        """``ValueError`` unless these counts cover exactly the global columns ``[vocab_offset,
        vocab_offset + width)`` of a logits slice."""
        if self.vocab_offset != vocab_offset or self.width != width:
            raise ValueError(f"the occurrence counts cover columns [{self.vocab_offset}, "
                             f"{self.vocab_offset + self.width}) but the logits hold [{vocab_offset}, "
                             f"{vocab_offset + width})")

    def _columns(self, tokens: torch.Tensor) -> torch.Tensor:
        """Local columns of global ``tokens``; the sink column for tokens this rank does not hold."""
        cols = tokens.to(device=self.device, dtype=torch.int64) - self.vocab_offset
        inside = (tokens.to(self.device) >= 0) & (cols >= 0) & (cols < self.width)
        return torch.where(inside, cols, torch.full_like(cols, self.width))

    def _slot_index(self, slots: torch.Tensor) -> torch.Tensor:
        slots = slots.to(device=self.device, dtype=torch.int64)
        valid = (slots >= 0) & (slots < self.num_slots)
        return torch.where(valid, slots, torch.full_like(slots, self.num_slots))

    def reset(self, slot: int, prompt_tokens: Sequence[int] | torch.Tensor) -> None:
        """A new request takes ``slot``: no output yet, its prompt's tokens marked seen."""
        check_int("slot", slot, low=0, below=self.num_slots)
        counts, seen = self._tables()
        counts[slot].zero_()
        seen[slot].zero_()
        prompt = torch.as_tensor(prompt_tokens, dtype=torch.int64).reshape(-1)
        seen[slot].index_fill_(0, self._columns(prompt), True)

    def add(self, slot_ids: torch.Tensor, tokens: torch.Tensor, lengths: torch.Tensor | None = None) -> None:
        """Count ``tokens`` ``[N, T]`` (negative = padding) as output of the requests in
        ``slot_ids`` ``[N]`` (-1 = none); with ``lengths`` ``[N]``, only the first ``lengths[n]``
        tokens of row ``n``. The same call on every rank; no host synchronization."""
        if tokens.dim() != 2 or slot_ids.dim() != 1 or slot_ids.shape[0] != tokens.shape[0]:
            raise ValueError(f"add needs slot_ids [N] and tokens [N, T], got {tuple(slot_ids.shape)} and "
                             f"{tuple(tokens.shape)}")
        if lengths is not None and tuple(lengths.shape) != (tokens.shape[0],):
            raise ValueError(f"lengths must be [{tokens.shape[0]}], got {tuple(lengths.shape)}")
        counts, _ = self._tables()
        if COUNT_KERNEL and use_key_kernels(self.device):
            from .kernels_triton import count_tokens  # the same counts in one launch

            count_tokens(counts, slot_ids, tokens, lengths, num_slots=self.num_slots, vocab_offset=self.vocab_offset,
                         width=self.width)
            return
        if lengths is not None:
            tokens = tokens.to(self.device)
            columns = torch.arange(tokens.shape[1], device=self.device).reshape(1, -1)
            tokens = torch.where(columns < lengths.to(self.device).reshape(-1, 1), tokens, torch.full_like(tokens, -1))
        rows = self._slot_index(slot_ids).reshape(-1, 1).expand(-1, tokens.shape[1])
        # Tokens of no slot go to the sink column too: the sink row stays zero (rows without
        # a request read it).
        cols = torch.where(rows < self.num_slots, self._columns(tokens), torch.full_like(rows, self.width))
        ones = torch.ones(tokens.shape, dtype=torch.int32, device=self.device)
        counts.index_put_((rows.reshape(-1), cols.reshape(-1)), ones.reshape(-1), accumulate=True)


def preceding_drafts(draft_tokens: torch.Tensor, row_request: torch.Tensor, row_position: torch.Tensor,
                     request_draft_len: torch.Tensor) -> torch.Tensor:
    """``[R, D]`` int64: for logits row ``r`` at position ``j`` of its request, that request's
    drafts ``0 .. j-1`` (the output the row is conditioned on beyond the counts), -1 elsewhere.

    ``draft_tokens`` ``[B, D]``; ``row_request``/``row_position`` ``[R]``; ``request_draft_len``
    ``[B]`` (0 for context and padding requests, whose rows precede no draft).
    """
    device = draft_tokens.device
    row_request = row_request.to(device)
    d = draft_tokens.shape[1]
    drafts = draft_tokens.to(torch.int64)[row_request]
    limit = torch.minimum(row_position.to(device), request_draft_len.to(device)[row_request])
    keep = torch.arange(d, device=device).reshape(1, -1) < limit.reshape(-1, 1)
    return torch.where(keep, drafts, torch.full_like(drafts, -1))


def apply_penalties(
    local_logits: torch.Tensor,
    *,
    vocab_offset: int,
    counts: OccurrenceCounts,
    slots: torch.Tensor,
    drafts: torch.Tensor | None,
    repetition: torch.Tensor,
    presence: torch.Tensor,
    frequency: torch.Tensor,
) -> torch.Tensor:
    """Penalised logits of one rank's slice: ``[R, W]`` -> ``[R, W]`` float32.

    ``local_logits``: global columns ``[vocab_offset, vocab_offset + W)`` of ``R`` rows
    (full rows: ``vocab_offset=0``, ``W`` = vocab); ``counts``: this rank's
    :class:`OccurrenceCounts` for exactly those columns. Per row (``[R]`` each): ``slots``
    (int, -1 = no request: counts are zero), ``drafts`` ``[R, D]`` tokens also counted as
    output for that row (-1 = none; see :func:`preceding_drafts`; None = no drafts),
    ``repetition``, ``presence``, ``frequency`` (float32; 1, 0, 0 = off). Local: no
    collective; every column's value is independent of the split.
    """
    if local_logits.dim() != 2:
        raise ValueError(f"local_logits must be [rows, width], got {tuple(local_logits.shape)}")
    rows, width = local_logits.shape
    counts.check_covers(vocab_offset, width)
    for name, t in (("slots", slots), ("repetition", repetition), ("presence", presence), ("frequency", frequency)):
        if t.dim() != 1 or t.shape[0] != rows:
            raise ValueError(f"{name} must be [{rows}], got {tuple(t.shape)}")
    device = local_logits.device
    table_counts, table_seen = counts._tables()
    index = counts._slot_index(slots)
    if (drafts is None or not drafts.numel()) and rows and width and table_counts.device == device \
            and use_key_kernels(device):
        from .kernels_triton import penalize  # the same values in one pass

        return penalize(local_logits, table_counts, table_seen, index, repetition, presence, frequency)
    out_counts = table_counts[index]  # [R, W + 1]: a copy (advanced indexing)
    if drafts is not None and drafts.numel():
        if drafts.dim() != 2 or drafts.shape[0] != rows:
            raise ValueError(f"drafts must be [{rows}, D], got {tuple(drafts.shape)}")
        ones = torch.ones(drafts.shape, dtype=torch.int32, device=counts.device)
        out_counts.scatter_add_(1, counts._columns(drafts), ones)
    out_counts = out_counts[:, :width].to(device)
    prompt_seen = table_seen[index][:, :width].to(device)

    def per_row(t: torch.Tensor) -> torch.Tensor:
        return t.to(device=device, dtype=torch.float32).reshape(-1, 1)

    r, p, f = per_row(repetition), per_row(presence), per_row(frequency)
    x = local_logits.to(torch.float32)
    in_output = out_counts > 0
    # Separate tensor operations: each rounds once (no fused multiply-add), on any device.
    repeated = torch.where(x > 0, x / r, x * r)
    x = torch.where(in_output | prompt_seen, repeated, x)
    # Only columns seen in the output change (x - 0 could turn -0.0 into +0.0 elsewhere).
    counted = (x - f * out_counts.to(torch.float32)) - p
    return torch.where(in_output, counted, x)


@dataclass
class RowPenalties:
    """The penalty inputs of one step's logits rows (``[R]`` each, ``drafts`` ``[R, D]``)
    and the rank's :class:`OccurrenceCounts`; see :func:`apply_penalties`."""

    counts: OccurrenceCounts
    slots: torch.Tensor
    drafts: torch.Tensor | None
    repetition: torch.Tensor
    presence: torch.Tensor
    frequency: torch.Tensor

    def apply(self, local_logits: torch.Tensor, vocab_offset: int) -> torch.Tensor:
        """:func:`apply_penalties` of ``local_logits`` with these rows' inputs."""
        return apply_penalties(local_logits, vocab_offset=vocab_offset, counts=self.counts, slots=self.slots,
                               drafts=self.drafts, repetition=self.repetition, presence=self.presence,
                               frequency=self.frequency)


def penalized_logits(logits: VocabShardedLogits, penalties: Any) -> VocabShardedLogits:
    """``logits`` (a ``VocabShardedLogits``) with ``penalties`` (a :class:`RowPenalties`, or a
    ``tpspec.sampling.controls.RowControls``: anything with ``apply(slice, vocab_offset)``)
    applied to every rank's slice: a new ``VocabShardedLogits`` over float32 values (the same
    object when ``penalties`` is None). Local on each rank; the result selects like any other
    sharded logits."""
    if penalties is None:
        return logits
    if type(logits) is not VocabShardedLogits:
        # Attention DP stacks other ranks' rows into the slice: their counts live there.
        raise ValueError(f"penalties need the plain VocabShardedLogits of one batch, got {type(logits).__name__} "
                         f"(attention DP does not support penalties)")
    local = penalties.apply(logits.local, logits.vocab_offset)
    return VocabShardedLogits(local, logits.vocab_offset, logits.vocab_size, logits.exchange)
