"""Draft tokens under TP and the draft distributions rejection sampling needs, on shards.

* :func:`select_draft_tokens`: draft tokens from a vocab-sharded draft head go through the
  exchange on the **draft channel** (``Channel.DRAFT``), so they never share slots with the
  target's exchange; under attention DP the draft head is replicated (its exchange spans
  one rank) and the pick is local, with no collective. Greedy drafts take the argmax.
  Drafts of requests with logit controls obey them (bias and token masks) either way.
  Sampled drafts (rejection sampling) are drawn with each request's own penalties,
  temperature and filters from its draft-step stream on the shards, and come back with this
  rank's columns of the (penalised) logits they were drawn from.
* :class:`DraftLogitsStore`: those columns kept per KV slot and draft position (``[slots + 1,
  K, shard]`` on each rank: its own columns only), stable when the batch is reshuffled
  between drafting and verification, with a scratch row for padding requests (slot -1).
  Every draft position a step verifies is written by that step's drafting first, so a slot's
  new owner never reads its predecessor's rows.

Drafts are in the target's column layout: a draft model shares the target's vocabulary, and
an EAGLE-3 head's logits come out in the target layout (``tpspec.model.eagle3``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..exchange.base import Channel
from ..keys import SamplingRows
from ..sampling.penalties import penalized_logits
from ..sampling.select import FilterPlan, draw_filtered, sample_tokens


@dataclass
class DraftSelection:
    """``tokens`` ``[M]`` int64 target ids; ``logits`` this rank's ``[M, shard]`` columns of the
    draft logits the tokens were sampled from, or None (greedy drafts: one-hot q); ``decided``:
    None, or from a deferred selection with filters a 0-dim bool, False when a filtered row could
    not be decided without a host sync (the tokens then mean nothing)."""

    tokens: torch.Tensor
    logits: torch.Tensor | None
    decided: torch.Tensor | None = None


def select_draft_tokens(
    draft_logits: Any, meta: Any, step: int, *, sample: bool = False, first_request: int = 0,
    previous_drafts: torch.Tensor | None = None, channel: int = Channel.DRAFT, deferred: bool = False,
    filter_plan: FilterPlan | None = None,
    bitmask: torch.Tensor | None = None,
) -> DraftSelection:
    """Draft tokens of draft step ``step`` from ``draft_logits`` (a ``VocabShardedLogits`` whose
    rows are the requests ``first_request, first_request + 1, ...`` of ``meta``, a prepared
    ``SpecMetadata``).

    ``sample=False``: greedy tokens of the raw logits through the exchange and no logits
    (rejection sampling then treats the drafts as one-hot, which is lossless). ``sample=True``:
    penalised requests' rows are penalised first (the request's repetition, presence and
    frequency penalties with its slot's counts, and ``previous_drafts`` ``[rows, step]`` int64,
    the rows' drafts ``0 .. step-1`` of this chain, counted as output: the rule of the
    verification row that checks this draft; required for ``step > 0`` when a request has
    penalties); then each request draws from its filtered softmax(logits / T) (its own
    temperature, top-k, top-p and min-p) with its draft-step stream, on the shards (greedy
    requests take the argmax), and this rank's columns of the penalised logits come back, the
    exact rows the draws were made from (an all-greedy batch: argmax, no logits). ``sample``
    must be the same on every rank (a configuration switch); the batch flags are group-synced.
    Logit controls apply either way (``meta.draft_controls``): the requests' logit biases, and
    ``bitmask`` (``[rows, words]`` int32 token bitmask of the positions drafted, None = every
    token; ``tpspec.sampling.controls``), so a draft obeys the mask of the verification row that
    checks it. ``deferred``: no host sync (a CUDA graph); ``filter_plan`` gives the filters' host facts when
    the requests have filters, and ``decided`` says whether every filtered row was decided.
    Every rank returns the same tokens.
    """
    rows = draft_logits.num_rows
    if first_request < 0 or first_request + rows > meta.num_requests:
        raise ValueError(f"draft logits have {rows} rows from request {first_request}, but the step has "
                         f"{meta.num_requests} requests")
    penalties = None
    if sample and meta.local_any_penalties:  # local arithmetic on each rank's columns: no path depends on it
        if step > 0 and (previous_drafts is None or previous_drafts.shape[-1] != step):
            raise ValueError(f"penalised draft step {step} needs the {step} previous drafts of its rows, got "
                             f"{None if previous_drafts is None else tuple(previous_drafts.shape)}")
        penalties = meta.draft_penalties(previous_drafts if step > 0 else None, first_request=first_request,
                                         num_requests=rows)
    if meta.local_any_controls or bitmask is not None:
        penalties = meta.draft_controls(penalties, bitmask, first_request=first_request, num_requests=rows)
    draft_logits = penalized_logits(draft_logits, penalties)
    if not sample or meta.is_all_greedy:
        return DraftSelection(draft_logits.argmax(channel=channel), None)
    rs = meta.request_sampling(meta.draft_offsets(step))
    pick = slice(first_request, first_request + rows)

    def part(f):
        return None if f is None else f[pick]

    if deferred and rs.has_filters:
        if filter_plan is None:
            raise ValueError("deferred draft selection with filters needs their FilterPlan")
        sub = SamplingRows(rs.temperature[pick], rs.seeds[pick], rs.offsets[pick], top_k=part(rs.top_k),
                           top_p=part(rs.top_p), min_p=part(rs.min_p))
        tokens, decided = draw_filtered(draft_logits, sub, filter_plan, channel=channel)
        return DraftSelection(tokens, draft_logits.local, decided.all())
    tokens = sample_tokens(draft_logits, rs.temperature[pick], rs.seeds[pick], rs.offsets[pick],
                           top_k=part(rs.top_k), top_p=part(rs.top_p), min_p=part(rs.min_p), channel=channel,
                           check_values=False)
    return DraftSelection(tokens, draft_logits.local)


class DraftLogitsStore:
    """This rank's columns of the draft logits per KV slot and draft position:
    ``[num_slots + 1, max_draft_len, shard_width]`` float32. Row ``num_slots`` is scratch:
    padding requests (slot -1) write and read it."""

    def __init__(self, num_slots: int, max_draft_len: int, shard_width: int, *,
                 device: str | torch.device = "cpu") -> None:
        if num_slots < 1 or max_draft_len < 1 or shard_width < 0:
            raise ValueError("num_slots and max_draft_len must be positive, shard_width non-negative")
        self.num_slots = num_slots
        self.max_draft_len = max_draft_len
        self.buffer = torch.zeros(num_slots + 1, max_draft_len, shard_width, dtype=torch.float32, device=device)

    def _rows(self, slot_ids: torch.Tensor | list[int], check: bool = True) -> torch.Tensor:
        slots = torch.as_tensor(slot_ids, dtype=torch.int64).to(self.buffer.device)
        if check and bool(((slots < -1) | (slots >= self.num_slots)).any()):
            raise ValueError(f"slot ids must lie in [-1, {self.num_slots})")
        return torch.where(slots == -1, self.num_slots, slots)

    def write(self, slot_ids: torch.Tensor | list[int], step: int, logits: torch.Tensor, *,
              check: bool = True) -> None:
        """Store draft step ``step``'s ``[B, shard_width]`` logits columns of the given slots
        (``check=False``: no host range check of the slot ids, as in :meth:`read`)."""
        if not 0 <= step < self.max_draft_len:
            raise ValueError(f"step={step} is out of range [0, {self.max_draft_len})")
        rows = self._rows(slot_ids, check)
        if logits.shape != (rows.shape[0], self.buffer.shape[2]):
            raise ValueError(f"logits must be [{rows.shape[0]}, {self.buffer.shape[2]}], got {tuple(logits.shape)}")
        self.buffer[rows, step] = logits.to(self.buffer.dtype)

    def read(self, slot_ids: torch.Tensor | list[int], draft_len: int, *, check: bool = True) -> torch.Tensor:
        """``[B, draft_len, shard_width]`` float32 columns of the given slots' drafts.
        ``check=False``: the slot ids are not range-checked on the host (no sync; a CUDA graph
        reads the store with the step's metadata slots, which ``SpecMetadata`` checked)."""
        if not 0 <= draft_len <= self.max_draft_len:
            raise ValueError(f"draft_len={draft_len} is out of range [0, {self.max_draft_len}]")
        return self.buffer[self._rows(slot_ids, check), :draft_len]
