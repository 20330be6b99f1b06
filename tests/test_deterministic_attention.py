"""Deterministic mode's Triton attention: close to a float64 reference, and each query row's bits
the same alone, in verification, in a prefill chunk, beside longer neighbours and with more
splits launched. On CPU through Triton's interpreter (a subprocess sets ``TRITON_INTERPRET=1``
before Triton is imported; skipped without ``triton``), on CUDA directly (``gpu`` marks: skipped
only without CUDA, failed on a CUDA machine without ``triton``).
The checks live in ``det_attention_cases.py``."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from interpreted import needs_triton, run_interpreted
from tpspec.model.attention import DeterministicPagedAttention


@needs_triton
def test_interpreted_kernel_float32_and_float16():
    run_interpreted("det_attention_cases.py", [], ("float32", "float16"))


@needs_triton
def test_split_kernel_loads_keys_and_values_in_16_byte_pieces():
    """Compiled for Hopper without a GPU, as a bfloat16 launch with head_dim 128 compiles it (its
    integers unspecialized, so one binary serves every batch and TP size): the K/V rows load as
    16-byte vectors, not element by element; with head_dims that are not whole 16-byte pieces the
    wrapper's ``VEC`` falls back to 1."""
    import re

    from interpreted import compile_for_hopper
    from tpspec.model import deterministic_attention_cuda as kernels

    signature = {**{name: "*bf16" for name in ("q_ptr", "k_ptr", "v_ptr")},
                 **{name: "*i32" for name in ("page_table_ptr", "tok_seq_ptr", "tok_visible_ptr")},
                 **{name: "*fp32" for name in ("part_acc_ptr", "part_m_ptr", "part_l_ptr")}, "scale_log2": "fp32",
                 **{name: "i32" for name in ("num_heads", "num_splits", "page_size", "stride_qt", "stride_qh",
                                             "stride_kp", "stride_ko", "stride_kh", "stride_vp", "stride_vo",
                                             "stride_vh", "stride_pt")}}
    loads = {}
    for vec in (8, 1):
        constants = dict(GROUP=4, GROUP_PAD=16, HEAD_DIM=128, HEAD_PAD=128, SPLIT=kernels.SPLIT_SIZE,
                         BLOCK=kernels.BLOCK_N, IEEE=False, VEC=vec)
        ptx = compile_for_hopper(kernels._split_kernel, signature, constants, aligned_pointers=True,
                                 num_warps=kernels.NUM_WARPS, enable_fp_fusion=True)["ptx"]
        loads[vec] = re.findall(r"ld\.global\.(v4\.b32|b16)", ptx)
    assert loads[8].count("v4.b32") >= 16 and loads[8].count("b16") <= 16, loads[8]
    assert "v4.b32" not in loads[1]


def test_cpu_backend_keeps_the_host_loop_and_refuses_graphs():
    attn = DeterministicPagedAttention(num_heads=4, num_kv_heads=2, head_dim=8, scale=0.5, dtype=torch.float32,
                                       device=torch.device("cpu"))
    assert attn.cuda_kernels is None and attn.supports_graphs is False
    with pytest.raises(RuntimeError, match="CUDA graphs"):
        attn.plan(None, graph=True)


@pytest.fixture
def cuda_triton():
    """GPU tests skip only without CUDA (conftest): on a CUDA machine a missing triton is a broken
    install (torch's CUDA wheels bring it) and fails them."""
    if importlib.util.find_spec("triton") is None:
        pytest.fail("triton is missing on a CUDA machine: deterministic mode's attention needs it "
                    "(pip install -e '.[triton]')")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_cuda_kernel_matches_reference_and_rows_are_invariant(cuda_triton, dtype):
    import det_attention_cases as cases

    cases.check_matches_reference("cuda", dtype)
    cases.check_rows_invariant("cuda", dtype)


@pytest.mark.gpu
def test_cuda_backend_is_the_kernel_and_captures_in_a_graph(cuda_triton):
    """On CUDA the backend runs the Triton path; captured in a CUDA graph and replayed with the
    next step's metadata copied in, it gives the bits of an eager run of that step."""
    import det_attention_cases as cases
    from tpspec.model.batch import AttentionMetadata, ForwardBatch
    from tpspec.model.kv_cache import KVPages

    attn = DeterministicPagedAttention(num_heads=cases.HEADS, num_kv_heads=cases.KV_HEADS, head_dim=cases.HEAD_DIM,
                                       scale=cases.SCALE, dtype=torch.bfloat16, device=torch.device("cuda"))
    assert attn.supports_graphs
    c = cases.Cache("cuda", torch.bfloat16)
    pages = KVPages(1, 1, 1, 1, dtype=torch.bfloat16, device="cuda")
    pages.k, pages.v = c.k, c.v

    def meta_of(cache_lens: list[int]) -> AttentionMetadata:
        tables = [c.x_table, c.other_table]
        batch = ForwardBatch(token_ids=torch.zeros(8, dtype=torch.int64), positions=torch.zeros(8, dtype=torch.int64),
                             block_tables=tables, cache_lens=cache_lens, query_lens=[4, 4])
        return AttentionMetadata.build(batch, "cuda", cases.PAGE, kv_pages=len(c.other_table))

    q = c.x_queries[:8].clone()
    split, long = cases.kernels.SPLIT_SIZE, cases.x_len() - 8  # X's longest 4-row step
    static = meta_of([3, 2 * split + 5])
    attn.plan(static, graph=True)
    attend = attn.bind(static)
    attend(q, pages)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = attend(q, pages)
    nxt = meta_of([long, 40])
    static.copy_(nxt)
    graph.replay()
    torch.cuda.synchronize()
    eager = attn.bind(nxt)(q, pages)
    assert torch.equal(out.view(torch.int16), eager.view(torch.int16))
    ref = c.reference(c.x_table, long + 1, q[0])
    assert (out[0].double() - ref).abs().max().item() < 3e-2
