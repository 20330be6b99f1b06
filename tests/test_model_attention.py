"""Paged attention (the torch path) against a dense reference: scattered pages, grouped-query
heads, prefill / decode / verification rows in one batch, and a bucketed page-table width."""

from __future__ import annotations

import pytest
import torch

from tpspec.model import AttentionMetadata, ForwardBatch, KVPages, choose_attention_backend
from tpspec.model.attention import TorchPagedAttention


def _reference(q, keys, values, cache_lens, query_lens, group, scale):
    out, t = [], 0
    for k, v, c, n in zip(keys, values, cache_lens, query_lens):
        for i in range(n):
            kk = k[: c + i + 1].repeat_interleave(group, dim=1)  # [L, H, hd]
            vv = v[: c + i + 1].repeat_interleave(group, dim=1)
            w = torch.softmax(torch.einsum("hd,lhd->hl", q[t], kk) * scale, dim=-1)
            out.append(torch.einsum("hl,lhd->hd", w, vv))
            t += 1
    return torch.stack(out)


@pytest.mark.parametrize("kv_pages", [None, 8], ids=["exact", "bucketed"])
def test_torch_paged_attention_equals_dense_reference(kv_pages):
    gen = torch.Generator().manual_seed(0)
    heads, kv_heads, hd, page = 8, 2, 16, 4
    cache_lens, query_lens = [5, 0, 9, 13], [1, 6, 3, 4]  # decode, prefill, chunk, verification
    perm = torch.randperm(24, generator=gen).tolist()
    tables = [perm[0:2], perm[2:4], perm[4:8], perm[8:13]]
    pages = KVPages(24, page, kv_heads, hd, dtype=torch.float32, device="cpu")
    keys = [torch.randn(c + n, kv_heads, hd, generator=gen) for c, n in zip(cache_lens, query_lens)]
    values = [torch.randn(c + n, kv_heads, hd, generator=gen) for c, n in zip(cache_lens, query_lens)]
    for table, k, v, c in zip(tables, keys, values, cache_lens):  # what earlier steps cached
        for j in range(c):
            pages.k[table[j // page], j % page] = k[j]
            pages.v[table[j // page], j % page] = v[j]
    n = sum(query_lens)
    batch = ForwardBatch(torch.zeros(n, dtype=torch.int64), torch.zeros(n, dtype=torch.int64), tables, cache_lens,
                         query_lens)
    meta = AttentionMetadata.build(batch, "cpu", page, kv_pages)
    assert meta.kv_pages == (kv_pages or 5) and meta.page_table.shape == (4, meta.kv_pages)
    assert meta.kv_indptr.tolist() == [0, 2, 4, 7, 12] and meta.kv_last_page_len.tolist() == [2, 2, 4, 1]
    pages.write(meta.write_index, torch.cat([k[c:] for k, c in zip(keys, cache_lens)]),
                torch.cat([v[c:] for v, c in zip(values, cache_lens)]))
    q = torch.randn(n, heads, hd, generator=gen)
    attention = TorchPagedAttention(num_heads=heads, num_kv_heads=kv_heads, head_dim=hd, scale=hd**-0.5,
                                    dtype=torch.float32, device=torch.device("cpu"))
    out = attention.bind(meta)(q, pages)
    want = _reference(q, keys, values, cache_lens, query_lens, heads // kv_heads, hd**-0.5)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


def test_backend_choice_and_bad_tables():
    assert choose_attention_backend("cpu", 128) == "torch"
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        choose_attention_backend("cpu", 128, "magic")
    t = torch.zeros(3, dtype=torch.int64)
    batch = ForwardBatch(t, t, [[0]], [2], [3])
    with pytest.raises(ValueError, match="block table has 1 pages of 4 tokens, 5 cached tokens need 2"):
        AttentionMetadata.build(batch, "cpu", 4)
    with pytest.raises(ValueError, match="kv_pages=1 is fewer than the batch reads"):
        AttentionMetadata.build(ForwardBatch(t, t, [[0, 1]], [2], [3]), "cpu", 4, kv_pages=1)
