"""Checks of deterministic mode's Triton attention, run on CUDA tensors (GPU tests) or on CPU
tensors under Triton's interpreter (``python tests/det_attention_cases.py``, with
``TRITON_INTERPRET=1`` set before Triton is imported).

One cache holds a sequence ``X`` of :func:`x_len` positions whose keys, values and per-position
queries are fixed; its pages are out of order. Each check runs the kernel through the real
:class:`~tpspec.model.batch.AttentionMetadata`.
"""

from __future__ import annotations

import sys

import torch

from tpspec.model import deterministic_attention_cuda as kernels
from tpspec.model.batch import AttentionMetadata, ForwardBatch, pages_needed

PAGE = 16
KV_HEADS, HEADS, HEAD_DIM = 1, 3, 40  # GQA group of 3 (padded), head_dim not a power of two
SCALE = HEAD_DIM ** -0.5


def x_len() -> int:
    """X's length: its last rows see four or five splits (trees with dropped right subtrees)."""
    return 3 * kernels.SPLIT_SIZE + 37


class Cache:
    """Pages filled with random keys/values, ``x_table`` (X's pages, shuffled), ``other_table``
    (a longer neighbour's), and X's query of every position."""

    def __init__(self, device: str, dtype: torch.dtype, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        x_pages = pages_needed(x_len(), PAGE)
        num_pages = 2 * x_pages + 8
        shape = (num_pages, PAGE, KV_HEADS, HEAD_DIM)
        self.k = torch.randn(shape, generator=gen).to(device=device, dtype=dtype)
        self.v = torch.randn(shape, generator=gen).to(device=device, dtype=dtype)
        pages = torch.randperm(num_pages, generator=gen).tolist()
        self.x_table = pages[:x_pages]
        self.other_table = pages[x_pages:]  # a neighbour that reads more pages than X
        self.x_queries = torch.randn(x_len(), HEADS, HEAD_DIM, generator=gen).to(device=device, dtype=dtype)
        self.device, self.dtype = device, dtype

    def run(self, seqs: list[tuple[list[int], int, torch.Tensor]], kv_pages: int | None = None) -> torch.Tensor:
        """``seqs``: (block table, cache_len, queries ``[q, H, hd]``) per sequence -> ``[N, H, hd]``."""
        qlens = [q.shape[0] for _, _, q in seqs]
        n = sum(qlens)
        batch = ForwardBatch(token_ids=torch.zeros(n, dtype=torch.int64), positions=torch.zeros(n, dtype=torch.int64),
                             block_tables=[t for t, _, _ in seqs], cache_lens=[c for _, c, _ in seqs],
                             query_lens=qlens)
        meta = AttentionMetadata.build(batch, self.device, PAGE, kv_pages)
        q = torch.cat([q for _, _, q in seqs])
        return kernels.paged_attention(q, self.k, self.v, meta.page_table, meta.tok_seq, meta.tok_visible, SCALE)

    def reference(self, table: list[int], visible: int, query: torch.Tensor) -> torch.Tensor:
        """Float64 attention of one query ``[H, hd]`` over positions ``[0, visible)`` of ``table``."""
        rows = torch.tensor([table[p // PAGE] * PAGE + p % PAGE for p in range(visible)], device=self.device)
        group = HEADS // KV_HEADS
        keys = self.k.view(-1, KV_HEADS, HEAD_DIM)[rows].double().repeat_interleave(group, 1)  # [n, H, hd]
        values = self.v.view(-1, KV_HEADS, HEAD_DIM)[rows].double().repeat_interleave(group, 1)
        scores = torch.einsum("hd,nhd->hn", query.double(), keys) * SCALE
        return torch.einsum("hn,nhd->hd", scores.softmax(-1), values)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


def _tolerance(dtype: torch.dtype) -> float:
    return {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 3e-2}[dtype]


def check_matches_reference(device: str, dtype: torch.dtype) -> None:
    """Several sequences (decode, verification, a chunk crossing split boundaries, a cache length
    that is a multiple of the split, an empty cache) against the float64 reference."""
    c = Cache(device, dtype)
    split = kernels.SPLIT_SIZE
    seqs = [(c.x_table, x_len() - 1, c.x_queries[x_len() - 1 :]),
            (c.x_table, split + 100, c.x_queries[split + 100 : split + 104]),
            (c.other_table, split - 3, c.x_queries[:9]),
            (c.x_table, 0, c.x_queries[:5]),
            (c.other_table, 2 * split, c.x_queries[10:11])]
    out = c.run(seqs)
    row = 0
    for table, cache_len, q in seqs:
        for i in range(q.shape[0]):
            ref = c.reference(table, cache_len + i + 1, q[i])
            err = (out[row].double() - ref).abs().max().item()
            assert err < _tolerance(dtype), f"row {row} (cache_len {cache_len}, query {i}): error {err}"
            row += 1


def check_rows_invariant(device: str, dtype: torch.dtype) -> None:
    """X's row at position ``p`` has the same bits decoded alone, as row ``j`` of a 4-row
    verification, inside a prefill chunk (launched at once or a row at a time), in a batch
    beside longer neighbours, and with a page table padded far past what X reads (more splits
    launched)."""
    c = Cache(device, dtype)
    q = c.x_queries
    other = c.other_table
    split = kernels.SPLIT_SIZE
    for p in (2, split, 2 * split + 1, x_len() - 1):
        alone = c.run([(c.x_table, p, q[p : p + 1])])[0]
        j = min(p, 3)  # X's row p is row j of a verification of 4 rows ending at p
        views = {
            "verification": c.run([(c.x_table, p - j, q[p - j : p - j + 4])])[j],
            "chunk": c.run([(c.x_table, p // 3, q[p // 3 : p + 1])])[p - p // 3],
            "batch": c.run([(other, 2 * split + 40, q[:3]), (c.x_table, p, q[p : p + 1]),
                            (other, 10, q[:2])])[3],
            "padded pages": c.run([(c.x_table, p, q[p : p + 1])], kv_pages=len(c.x_table) + 40)[0],
            "chunk, one row a launch": _one_row_per_launch(
                lambda: c.run([(c.x_table, p // 3, q[p // 3 : p + 1])])[p - p // 3]),
        }
        for name, got in views.items():
            assert torch.equal(_bits(got), _bits(alone)), f"position {p}: {name} differs from decoding alone"


def _one_row_per_launch(fn):
    saved = kernels.PARTIALS_BYTES
    kernels.PARTIALS_BYTES = 1
    try:
        return fn()
    finally:
        kernels.PARTIALS_BYTES = saved


def run_all(device: str, dtypes: list[torch.dtype]) -> None:
    for dtype in dtypes:
        check_matches_reference(device, dtype)
        check_rows_invariant(device, dtype)
        print(f"{dtype}: ok", flush=True)


if __name__ == "__main__":
    # The interpreter runs every program in numpy: small splits and blocks keep it quick. The
    # contract holds for any constants; the GPU tests run the real ones. No bfloat16 here: the
    # interpreter's tl.dot gets bfloat16 inputs wrong (the GPU tests cover it).
    kernels.SPLIT_SIZE, kernels.BLOCK_N = 32, 16
    names = sys.argv[1:] or ["float32", "float16"]
    run_all("cpu", [getattr(torch, name) for name in names])
