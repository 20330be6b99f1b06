"""What one forward step computes: :class:`ForwardBatch`, and the index tensors the
attention layers derive from it once per step (:class:`AttentionMetadata`).

A batch is a list of sequences, each with its KV-cache slot, the number of tokens
already cached (``cache_len``) and the new tokens of this step (``query_len``): a
context chunk (prefill) or ``1 + D`` tokens of a generation step that verifies ``D``
drafts. New token ``i`` of a sequence is stored at cache index ``cache_len + i`` and
attends to cache indices ``[0, cache_len + i]``. ``positions`` only feed the rotary
embedding; normally ``positions == cache_len + i``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ForwardBatch:
    """One step's tokens (see the module docstring).

    token_ids:   ``[N]`` int64, every new token of every sequence, concatenated in sequence order.
    positions:   ``[N]`` int64, absolute position of each token (rotary embedding).
    slot_ids:    one KV-cache slot per sequence (distinct within a batch).
    cache_lens:  per sequence, tokens already in its slot before this step.
    query_lens:  per sequence, new tokens this step (>= 1).
    logits_rows: optional ``[M]`` int64 indices into ``[0, N)``: rows that need logits, in
                 output order (default: the last token of each sequence).

    An empty batch (no sequences, ``N == 0``) is valid: under attention DP a rank with no
    requests still joins the step's collectives with one.
    """

    token_ids: torch.Tensor
    positions: torch.Tensor
    slot_ids: list[int]
    cache_lens: list[int]
    query_lens: list[int]
    logits_rows: torch.Tensor | None = None

    def __post_init__(self) -> None:
        self.slot_ids = [int(s) for s in self.slot_ids]
        self.cache_lens = [int(c) for c in self.cache_lens]
        self.query_lens = [int(q) for q in self.query_lens]
        self.validate()

    @property
    def num_seqs(self) -> int:
        return len(self.slot_ids)

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first inconsistency (host-side checks only:
        token values are checked when the tensor is on the CPU)."""
        for name in ("token_ids", "positions"):
            t = getattr(self, name)
            if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.dtype != torch.int64:
                got = f"{tuple(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(f"ForwardBatch.{name} must be a 1-D int64 tensor, got {got}")
        n = self.num_tokens
        if self.positions.shape[0] != n:
            raise ValueError(f"ForwardBatch.positions has {self.positions.shape[0]} entries, token_ids {n}")
        if not len(self.slot_ids) == len(self.cache_lens) == len(self.query_lens):
            raise ValueError(
                f"ForwardBatch needs one slot_id, cache_len and query_len per sequence, got "
                f"{len(self.slot_ids)}, {len(self.cache_lens)}, {len(self.query_lens)}"
            )
        if any(q < 1 for q in self.query_lens):
            raise ValueError(f"ForwardBatch.query_lens must all be >= 1, got {self.query_lens}")
        if any(c < 0 for c in self.cache_lens):
            raise ValueError(f"ForwardBatch.cache_lens must all be >= 0, got {self.cache_lens}")
        if any(s < 0 for s in self.slot_ids) or len(set(self.slot_ids)) != len(self.slot_ids):
            raise ValueError(f"ForwardBatch.slot_ids must be distinct non-negative ints, got {self.slot_ids}")
        if sum(self.query_lens) != n:
            raise ValueError(f"sum(query_lens)={sum(self.query_lens)} != number of tokens {n}")
        if self.logits_rows is not None:
            rows = self.logits_rows
            if not isinstance(rows, torch.Tensor) or rows.dim() != 1 or rows.dtype != torch.int64:
                raise ValueError("ForwardBatch.logits_rows must be a 1-D int64 tensor or None")
            if rows.device.type == "cpu" and rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= n):
                raise ValueError(f"ForwardBatch.logits_rows must lie in [0, {n}), got {rows.tolist()}")

    def default_logits_rows(self) -> torch.Tensor:
        """``[num_seqs]`` int64: the index of each sequence's last token."""
        ends = torch.tensor(self.query_lens, dtype=torch.int64).cumsum(0) - 1
        return ends

    def check_token_range(self, vocab_size: int) -> None:
        """Raise ``ValueError`` for token ids outside ``[0, vocab_size)`` (CPU tensors only:
        a check of a device tensor would cost a synchronization every step)."""
        t = self.token_ids
        if t.device.type == "cpu" and t.numel():
            lo, hi = int(t.min()), int(t.max())
            if lo < 0 or hi >= vocab_size:
                raise ValueError(f"token ids must lie in [0, {vocab_size}), got min {lo}, max {hi}")


@dataclass
class AttentionMetadata:
    """Index tensors shared by every attention layer of one step (built on the host once).

    Sequences are padded to ``[B, q_max]`` query rows and ``kv_len`` cache columns:
    token ``t`` is row ``(tok_seq[t], tok_qi[t])``; ``mask[b, 0, i, j]`` allows key ``j``
    iff ``j <= cache_lens[b] + i``.
    """

    num_tokens: int
    num_seqs: int
    seq_slots: torch.Tensor  # [B] int64
    tok_slot: torch.Tensor  # [N] int64: slot of each token
    tok_cache_idx: torch.Tensor  # [N] int64: cache index each token's K/V goes to
    tok_seq: torch.Tensor  # [N] int64
    tok_qi: torch.Tensor  # [N] int64
    q_max: int
    kv_len: int
    mask: torch.Tensor  # [B, 1, q_max, kv_len] bool

    @classmethod
    def build(cls, batch: ForwardBatch, device: torch.device | str, kv_len: int | None = None) -> "AttentionMetadata":
        """Index tensors of ``batch`` on ``device``. ``kv_len``: cache columns to attend over
        (default: the longest ``cache_len + query_len`` of the batch; a CUDA graph passes a
        fixed one, e.g. the cache's ``max_seq_len``, so every step has the same shapes)."""
        qlens = torch.tensor(batch.query_lens, dtype=torch.int64)
        clens = torch.tensor(batch.cache_lens, dtype=torch.int64)
        b = batch.num_seqs
        tok_seq = torch.repeat_interleave(torch.arange(b, dtype=torch.int64), qlens)
        starts = qlens.cumsum(0) - qlens
        tok_qi = torch.arange(batch.num_tokens, dtype=torch.int64) - starts[tok_seq]
        tok_cache_idx = clens[tok_seq] + tok_qi
        slots = torch.tensor(batch.slot_ids, dtype=torch.int64)
        q_max = max(batch.query_lens, default=0)
        needed = max((c + q for c, q in zip(batch.cache_lens, batch.query_lens)), default=0)
        if kv_len is None:
            kv_len = needed
        elif kv_len < needed:
            raise ValueError(f"kv_len={kv_len} is shorter than the batch needs ({needed})")
        # The mask is built on the device from the [B] cache lengths (no [B, q, kv] host copy).
        clens_dev = clens.to(device)
        limit = clens_dev[:, None] + torch.arange(q_max, dtype=torch.int64, device=device)[None, :]  # [B, q_max]
        mask = torch.arange(kv_len, dtype=torch.int64, device=device)[None, None, :] <= limit[:, :, None]
        return cls(
            num_tokens=batch.num_tokens,
            num_seqs=b,
            seq_slots=slots.to(device),
            tok_slot=slots[tok_seq].to(device),
            tok_cache_idx=tok_cache_idx.to(device),
            tok_seq=tok_seq.to(device),
            tok_qi=tok_qi.to(device),
            q_max=q_max,
            kv_len=kv_len,
            mask=mask[:, None],
        )

    def copy_(self, other: "AttentionMetadata") -> "AttentionMetadata":
        """Copy ``other``'s tensors into this one's (same shapes) in place: how a captured
        CUDA graph's static metadata takes the next step's values. Returns ``self``."""
        for name in ("num_tokens", "num_seqs", "q_max", "kv_len"):
            if getattr(self, name) != getattr(other, name):
                raise ValueError(f"metadata shapes differ: {name} {getattr(self, name)} != {getattr(other, name)}")
        for name in ("seq_slots", "tok_slot", "tok_cache_idx", "tok_seq", "tok_qi", "mask"):
            getattr(self, name).copy_(getattr(other, name), non_blocking=True)
        return self
