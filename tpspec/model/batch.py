"""What one forward step computes: :class:`ForwardBatch`, and the index tensors the
attention layers derive from it once per step (:class:`AttentionMetadata`).

A batch is a list of sequences, each with its block table (the KV-cache pages it owns,
in order), the number of tokens already cached (``cache_len``) and the new tokens of
this step (``query_len``): a context chunk (prefill) or ``1 + D`` tokens of a generation
step that verifies ``D`` drafts. New token ``i`` of a sequence is stored at cache index
``cache_len + i`` — page ``block_table[(cache_len + i) // page_size]``, row
``(cache_len + i) % page_size`` — and attends to cache indices ``[0, cache_len + i]``.
``positions`` only feed the rotary embedding; normally ``positions == cache_len + i``.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import torch


@dataclass
class ForwardBatch:
    """One step's tokens (see the module docstring).

    token_ids:    ``[N]`` int64, every new token of every sequence, concatenated in sequence order.
    positions:    ``[N]`` int64, absolute position of each token (rotary embedding).
    block_tables: per sequence, the KV-cache pages it owns, in order; they must cover
                  ``cache_len + query_len`` tokens (extra pages are allowed and not read).
    cache_lens:   per sequence, tokens already in its pages before this step.
    query_lens:   per sequence, new tokens this step (>= 1).
    logits_rows:  optional ``[M]`` int64 indices into ``[0, N)``: rows that need logits, in
                  output order (default: the last token of each sequence).

    An empty batch (no sequences, ``N == 0``) is valid: under attention DP a rank with no
    requests still joins the step's collectives with one.
    """

    token_ids: torch.Tensor
    positions: torch.Tensor
    block_tables: list[list[int]]
    cache_lens: list[int]
    query_lens: list[int]
    logits_rows: torch.Tensor | None = None

    def __post_init__(self) -> None:
        self.block_tables = [[int(p) for p in table] for table in self.block_tables]
        self.cache_lens = [int(c) for c in self.cache_lens]
        self.query_lens = [int(q) for q in self.query_lens]
        self.validate()

    @property
    def num_seqs(self) -> int:
        return len(self.block_tables)

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def kv_lens(self) -> list[int]:
        """Per sequence, the cache length after this step (``cache_len + query_len``)."""
        return [c + q for c, q in zip(self.cache_lens, self.query_lens)]

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first inconsistency (host-side checks only:
        token values are checked when the tensor is on the CPU; page ids and page coverage
        are checked by the model, which knows its page count and size)."""
        for name in ("token_ids", "positions"):
            t = getattr(self, name)
            if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.dtype != torch.int64:
                got = f"{tuple(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(f"ForwardBatch.{name} must be a 1-D int64 tensor, got {got}")
        n = self.num_tokens
        if self.positions.shape[0] != n:
            raise ValueError(f"ForwardBatch.positions has {self.positions.shape[0]} entries, token_ids {n}")
        if not len(self.block_tables) == len(self.cache_lens) == len(self.query_lens):
            raise ValueError(
                f"ForwardBatch needs one block table, cache_len and query_len per sequence, got "
                f"{len(self.block_tables)}, {len(self.cache_lens)}, {len(self.query_lens)}"
            )
        if any(q < 1 for q in self.query_lens):
            raise ValueError(f"ForwardBatch.query_lens must all be >= 1, got {self.query_lens}")
        if any(c < 0 for c in self.cache_lens):
            raise ValueError(f"ForwardBatch.cache_lens must all be >= 0, got {self.cache_lens}")
        if any(p < 0 for table in self.block_tables for p in table):
            raise ValueError("ForwardBatch.block_tables must hold non-negative page ids")
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


def pages_needed(num_tokens: int, page_size: int) -> int:
    """Pages that hold ``num_tokens`` cache entries."""
    return -(-num_tokens // page_size)


def check_paged_batch(batch: Any, num_pages: int, page_size: int, vocab_size: int) -> None:
    """What a paged model checks before a forward: ``batch`` is a :class:`ForwardBatch`, the
    cache is allocated (``num_pages > 0``), every sequence's block table holds the pages its
    cached and new tokens need, with ids in ``[0, num_pages)``, and its token ids lie in
    ``[0, vocab_size)``. Raises ``ValueError`` (``RuntimeError`` for a missing cache)."""
    if not isinstance(batch, ForwardBatch):
        raise ValueError(f"expected a ForwardBatch, got {type(batch).__name__}")
    if not num_pages:
        raise RuntimeError("call allocate_kv_cache(num_pages, page_size) before the first forward")
    for i, (table, cached, new) in enumerate(zip(batch.block_tables, batch.cache_lens, batch.query_lens)):
        need = pages_needed(cached + new, page_size)
        if len(table) < need:
            raise ValueError(f"sequence {i}: cache_len {cached} + query_len {new} needs {need} pages of "
                             f"{page_size} tokens, its block table has {len(table)}")
        if any(p >= num_pages for p in table[:need]):
            raise ValueError(f"sequence {i}: page ids must lie in [0, {num_pages}), got {table[:need]}")
    batch.check_token_range(vocab_size)


def page_table_rows(tables: Sequence[Sequence[int]], used: Sequence[int], out: np.ndarray) -> np.ndarray:
    """Write each sequence's first ``used[b]`` pages into row ``b`` of ``out`` (``[B, kv_pages]``
    int64, zeros after them) and return it."""
    out.fill(0)
    rows = np.repeat(np.arange(len(used)), used)
    cols = np.fromiter(itertools.chain.from_iterable(range(n) for n in used), dtype=np.int64, count=len(rows))
    out[rows, cols] = np.fromiter(itertools.chain.from_iterable(t[:n] for t, n in zip(tables, used)),
                                  dtype=np.int64, count=len(rows))
    return out


def write_rows(table: np.ndarray, tok_seq: np.ndarray, positions: np.ndarray, page_size: int) -> np.ndarray:
    """The cache row each token writes (``[N]`` int64): position ``p`` of sequence ``tok_seq[t]``
    goes to row ``p % page_size`` of its page ``table[tok_seq[t], p // page_size]``."""
    return table[tok_seq, positions // page_size] * page_size + positions % page_size


def causal_mask(cache_lens: torch.Tensor, q_max: int, kv_len: int) -> torch.Tensor:
    """``[B, q_max, kv_len]`` bool on ``cache_lens``' device: query row ``i`` of sequence ``b``
    sees key ``j`` iff ``j <= cache_lens[b] + i`` (``cache_lens``: ``[B]`` int64)."""
    dev = cache_lens.device
    limit = cache_lens[:, None] + torch.arange(q_max, dtype=torch.int64, device=dev)[None, :]  # [B, q_max]
    cols = torch.arange(kv_len, dtype=torch.int64, device=dev)
    return cols[None, None, :] <= limit[:, :, None]


@dataclass
class AttentionMetadata:
    """Index tensors shared by every attention layer of one step (built on the host once).

    Writes: new token ``t`` goes to row ``write_index[t]`` of a layer's pages viewed as
    ``[num_pages * page_size, kv_heads, head_dim]``.

    Reads: sequence ``b`` reads pages ``page_table[b, :]`` (``[B, kv_pages]``, only the pages
    its ``kv_lens[b]`` tokens occupy, padded with page 0 up to the batch's longest; a CUDA
    graph passes a fixed, bucketed ``kv_pages``). Token ``t`` is query row
    ``(tok_seq[t], tok_qi[t])`` of the padded ``[B, q_max]`` layout and sees the cache's first
    ``tok_visible[t] = cache_lens[b] + i + 1`` positions; ``mask[b, 0, i, j]`` allows
    key ``j`` (of the ``kv_pages * page_size`` gathered rows) iff ``j <= cache_lens[b] + i``.
    ``qo_indptr``/``kv_indptr``/``kv_indices``/``kv_last_page_len`` are the same pages in the
    compressed-row form paged attention kernels take (int32; ``kv_indices`` on ``device``, the
    three small ones on the host, where kernels plan from them).
    """

    num_tokens: int
    num_seqs: int
    page_size: int
    q_max: int
    kv_pages: int
    write_index: torch.Tensor  # [N] int64
    tok_seq: torch.Tensor  # [N] int64
    tok_qi: torch.Tensor  # [N] int64
    tok_visible: torch.Tensor  # [N] int64
    page_table: torch.Tensor  # [B, kv_pages] int64
    mask: torch.Tensor  # [B, 1, q_max, kv_pages * page_size] bool
    qo_indptr: torch.Tensor  # [B + 1] int32
    kv_indptr: torch.Tensor  # [B + 1] int32
    kv_indices: torch.Tensor  # [sum of pages used] int32
    kv_last_page_len: torch.Tensor  # [B] int32
    kv_lens: list[int]  # host copy, per sequence
    query_lens: list[int]  # host copy, per sequence
    backend_state: dict[str, Any] = field(default_factory=dict)  # what the attention backend planned

    @property
    def kv_len(self) -> int:
        """Cache rows the torch path gathers per sequence (``kv_pages * page_size``)."""
        return self.kv_pages * self.page_size

    @classmethod
    def build(cls, batch: ForwardBatch, device: torch.device | str, page_size: int,
              kv_pages: int | None = None) -> "AttentionMetadata":
        """Index tensors of ``batch`` on ``device`` for pages of ``page_size`` tokens.

        ``kv_pages``: page-table columns (default: the most pages a sequence of the batch
        reads; a CUDA graph passes a bucketed one so replays share shapes). Raises
        ``ValueError`` when a block table does not cover its sequence or ``kv_pages`` is too small.
        """
        # Host arrays first, one tensor each: cheaper than device arithmetic for a step's few tokens.
        qlens, clens, tables = batch.query_lens, batch.cache_lens, batch.block_tables
        b = batch.num_seqs
        kv_lens = batch.kv_lens
        used = [pages_needed(n, page_size) for n in kv_lens]
        for i, (table, n) in enumerate(zip(tables, used)):
            if len(table) < n:
                raise ValueError(f"sequence {i}: its block table has {len(table)} pages of {page_size} tokens, "
                                 f"{kv_lens[i]} cached tokens need {n}")
        needed = max(used, default=0)
        if kv_pages is None:
            kv_pages = needed
        elif kv_pages < needed:
            raise ValueError(f"kv_pages={kv_pages} is fewer than the batch reads ({needed})")
        table = page_table_rows(tables, used, np.empty((b, kv_pages), dtype=np.int64))
        tok_seq = np.repeat(np.arange(b), qlens)
        tok_qi = np.arange(len(tok_seq)) - np.repeat(np.cumsum([0, *qlens], dtype=np.int64)[:-1], qlens)
        positions = np.asarray(clens, dtype=np.int64)[tok_seq] + tok_qi
        q_max = max(qlens, default=0)
        # The mask is built on the device from the [B] cache lengths (no [B, q, kv] host copy).
        mask = causal_mask(torch.tensor(clens, dtype=torch.int64).to(device), q_max, kv_pages * page_size)
        kv_indices = torch.from_numpy(table[np.arange(kv_pages)[None, :] < np.asarray(used)[:, None]]).to(torch.int32)
        last = torch.tensor([n - (u - 1) * page_size for n, u in zip(kv_lens, used)], dtype=torch.int32)
        i64 = torch.int64
        return cls(
            num_tokens=batch.num_tokens,
            num_seqs=b,
            page_size=page_size,
            q_max=q_max,
            kv_pages=kv_pages,
            write_index=torch.from_numpy(write_rows(table, tok_seq, positions, page_size)).to(device),
            tok_seq=torch.from_numpy(tok_seq).to(device=device, dtype=i64),
            tok_qi=torch.from_numpy(tok_qi).to(device=device, dtype=i64),
            tok_visible=torch.from_numpy(positions + 1).to(device),
            page_table=torch.from_numpy(table).to(device),
            mask=mask[:, None],
            qo_indptr=torch.tensor([0, *itertools.accumulate(qlens)], dtype=torch.int32),
            kv_indptr=torch.tensor([0, *itertools.accumulate(used)], dtype=torch.int32),
            kv_indices=kv_indices.to(device),
            kv_last_page_len=last,
            kv_lens=list(kv_lens),
            query_lens=list(batch.query_lens),
        )

    def copy_(self, other: "AttentionMetadata") -> "AttentionMetadata":
        """Copy ``other``'s fixed-shape tensors into this one's in place: how a captured CUDA
        graph's static metadata takes the next step's values (the compressed-row page lists,
        whose length varies, are replaced, not copied: kernels that read them are planned
        on the host before the replay). Returns ``self``."""
        for name in ("num_tokens", "num_seqs", "page_size", "q_max", "kv_pages"):
            if getattr(self, name) != getattr(other, name):
                raise ValueError(f"metadata shapes differ: {name} {getattr(self, name)} != {getattr(other, name)}")
        for name in ("write_index", "tok_seq", "tok_qi", "tok_visible", "page_table", "mask"):
            getattr(self, name).copy_(getattr(other, name), non_blocking=True)
        for name in ("qo_indptr", "kv_indptr", "kv_indices", "kv_last_page_len", "kv_lens", "query_lens"):
            setattr(self, name, getattr(other, name))
        return self
