"""Draft tokens under TP and the draft distributions rejection sampling needs.

* :func:`select_draft_tokens`: greedy draft tokens from a vocab-sharded draft head go
  through the exchange on the **draft channel** (0), so they never share slots with
  the target's exchange; under attention DP the draft head is replicated (its exchange
  spans one rank) and the argmax is local, with no collective. Sampled drafts (for
  rejection sampling) gather the draft shards first and draw from each request's
  draft-step stream, returning the distribution they were drawn from.
* :class:`DraftProbsStore`: draft distributions kept per KV slot (stable when the
  batch is reshuffled between draft steps and verification), a scratch row for
  padding requests (slot -1), and a draft vocabulary smaller than the target's via a
  draft-to-target token map.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..exchange.base import Channel
from ..sampling.ops import filtered_probs, sample_from_logits


@dataclass
class DraftSelection:
    """``tokens`` ``[B]`` int64 (draft vocab); ``probs`` ``[B, V_draft]`` float32 or None (greedy)."""

    tokens: torch.Tensor
    probs: torch.Tensor | None


def select_draft_tokens(
    draft_logits: Any, meta: Any, step: int, *, sample: bool = False, channel: int = Channel.DRAFT
) -> DraftSelection:
    """Draft tokens of draft step ``step`` from ``draft_logits`` (a ``VocabShardedLogits``
    with one row per request of ``meta``, a prepared ``SpecMetadata``).

    ``sample=False`` (or an all-greedy batch): greedy tokens through the exchange, no
    probabilities (rejection sampling then treats the drafts as one-hot). ``sample=True``:
    gather the shards, draw from each request's filtered distribution with its
    draft-step stream, and return that distribution. ``sample`` must be the same on
    every rank (a configuration switch); the all-greedy flag is group-synced.
    Every rank returns the same tensors.
    """
    if draft_logits.num_rows != meta.num_requests:
        raise ValueError(f"draft logits have {draft_logits.num_rows} rows but the step has {meta.num_requests} requests")
    if not sample or meta.is_all_greedy:
        return DraftSelection(draft_logits.argmax(channel=channel), None)
    rs = meta.request_sampling(meta.draft_offsets(step))
    full = draft_logits.gather()
    probs = filtered_probs(full, rs.temperature, rs.top_k, rs.top_p, rs.min_p)
    tokens = sample_from_logits(
        full, rs.temperature, rs.seeds, rs.offsets, rs.top_k, rs.top_p, rs.min_p, needs_reproducible_streams=True
    )
    return DraftSelection(tokens, probs)


class DraftProbsStore:
    """Draft distributions per KV slot: ``[num_slots + 1, max_draft_len, draft_vocab]``.

    Row ``num_slots`` is scratch: padding requests (slot -1) write and read it.
    ``draft_to_target``: ``[draft_vocab]`` int64 distinct target ids of the draft tokens
    (default: identity, which needs ``draft_vocab == target_vocab``).
    """

    def __init__(
        self,
        num_slots: int,
        max_draft_len: int,
        draft_vocab_size: int,
        *,
        target_vocab_size: int | None = None,
        draft_to_target: torch.Tensor | None = None,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> None:
        if num_slots < 1 or max_draft_len < 1 or draft_vocab_size < 1:
            raise ValueError("num_slots, max_draft_len and draft_vocab_size must be positive")
        self.device = torch.device(device)
        self.num_slots = num_slots
        self.max_draft_len = max_draft_len
        self.draft_vocab_size = draft_vocab_size
        self.target_vocab_size = target_vocab_size or draft_vocab_size
        if draft_to_target is None:
            if self.target_vocab_size != draft_vocab_size:
                raise ValueError("a draft vocab that differs from the target's needs draft_to_target")
            self.draft_to_target = None
        else:
            d2t = draft_to_target.to(device=self.device, dtype=torch.int64)
            if d2t.shape != (draft_vocab_size,):
                raise ValueError(f"draft_to_target must be [{draft_vocab_size}], got {tuple(d2t.shape)}")
            if bool(((d2t < 0) | (d2t >= self.target_vocab_size)).any()) or d2t.unique().numel() != draft_vocab_size:
                raise ValueError(f"draft_to_target must hold distinct ids in [0, {self.target_vocab_size})")
            self.draft_to_target = d2t
        self.buffer = torch.zeros(num_slots + 1, max_draft_len, draft_vocab_size, dtype=dtype, device=self.device)

    def _rows(self, slot_ids: torch.Tensor) -> torch.Tensor:
        slots = slot_ids.to(device=self.device, dtype=torch.int64)
        if bool(((slots < -1) | (slots >= self.num_slots)).any()):
            raise ValueError(f"slot ids must lie in [-1, {self.num_slots})")
        return torch.where(slots == -1, self.num_slots, slots)

    def write(self, slot_ids: torch.Tensor, step: int, probs: torch.Tensor) -> None:
        """Store draft step ``step``'s ``[B, draft_vocab]`` distributions of the given slots."""
        if not 0 <= step < self.max_draft_len:
            raise ValueError(f"step={step} is out of range [0, {self.max_draft_len})")
        if probs.dim() != 2 or probs.shape != (slot_ids.shape[0], self.draft_vocab_size):
            raise ValueError(f"probs must be [{slot_ids.shape[0]}, {self.draft_vocab_size}], got {tuple(probs.shape)}")
        self.buffer[self._rows(slot_ids), step] = probs.to(self.buffer.dtype)

    def read(self, slot_ids: torch.Tensor, draft_len: int) -> torch.Tensor:
        """``[B, draft_len, target_vocab]`` float32 draft distributions in the target vocab."""
        if not 0 <= draft_len <= self.max_draft_len:
            raise ValueError(f"draft_len={draft_len} is out of range [0, {self.max_draft_len}]")
        probs = self.buffer[self._rows(slot_ids), :draft_len].to(torch.float32)
        if self.draft_to_target is None:
            return probs
        out = torch.zeros(probs.shape[0], draft_len, self.target_vocab_size, dtype=torch.float32, device=self.device)
        return out.scatter_(2, self.draft_to_target.expand(probs.shape[0], draft_len, -1), probs)

    def map_tokens(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocab token ids -> target-vocab ids (identity without a map; -1 stays -1)."""
        if self.draft_to_target is None:
            return draft_ids.to(torch.int64)
        ids = draft_ids.to(device=self.device, dtype=torch.int64)
        return torch.where(ids < 0, ids, self.draft_to_target[ids.clamp(min=0)])
