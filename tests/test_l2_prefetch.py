"""Weights pulled into L2 ahead of their linear (:mod:`tpspec.model.l2_prefetch`), and the KV loads'
eviction policy (``paged_attention_triton.KV_EVICTION``).

On CPU: the prefetch kernel compiled for Hopper without a GPU (Triton's own ptxas) is one predicated
bulk prefetch per thread between ``launch_dependents`` and ``wait``; nothing launches off a Hopper
GPU; the switches stand off. On CUDA (``gpu`` marks): a prefetch and the KV loads' ``evict_first``
change no value (attention and a linear at Llama 3 8B's sizes, eagerly and in a CUDA graph), and an
engine's greedy tokens are the same with every prefetch on as with none.
"""

from __future__ import annotations

import pytest
import torch

from interpreted import needs_triton


@needs_triton
def test_prefetch_kernel_compiles_to_one_bulk_prefetch_a_thread():
    from interpreted import compile_for_hopper
    from tpspec.model import l2_prefetch

    asm = compile_for_hopper(l2_prefetch._prefetch_kernel, {"base_ptr": "*u8", "chunks": "i32", "chunk_bytes": "i32"},
                             {"PER_PROGRAM": l2_prefetch.CHUNKS_PER_PROGRAM, "PDL": True}, aligned_pointers=True,
                             num_warps=4, launch_pdl=True)
    ptx = asm["ptx"]
    assert ptx.count("cp.async.bulk.prefetch.L2.global") == 1 and "@p cp.async.bulk.prefetch" in ptx
    assert ptx.find("griddepcontrol.launch_dependents") < ptx.find("cp.async.bulk") < ptx.find("griddepcontrol.wait")
    assert "st.global" not in ptx and "ld.global" not in ptx
    assert l2_prefetch.CHUNK_BYTES % 16 == 0


@needs_triton
def test_kv_eviction_policy_reaches_the_loads():
    """``EVICT="evict_first"`` gives the K and V loads an L2 eviction hint; ``""`` none."""
    from interpreted import compile_for_hopper
    from tpspec.model import paged_attention_triton as kernels

    pointers = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "out_ptr": "*bf16", "page_table_ptr": "*i32",
                "seq_starts_ptr": "*i64", "tok_visible_ptr": "*i32", "part_acc_ptr": "*fp32", "part_m_ptr": "*fp32",
                "part_l_ptr": "*fp32"}
    integers = ["num_heads", "q_blocks", "num_splits", "stride_qt", "stride_qh", "stride_ot", "stride_oh", "stride_kp",
                "stride_ko", "stride_kh", "stride_vp", "stride_vo", "stride_vh", "stride_pt"]
    signature = {**pointers, "scale_log2": "fp32", **{name: "i32" for name in integers}}
    launch = kernels.plan_launch(num_tokens=32, num_seqs=8, q_max=4, kv_pages=128, page_size=16, num_heads=32,
                                 kv_heads=8, head_dim=128, device="cpu", num_splits=5)
    constants = dict(GROUP=4, HEAD_DIM=128, HEAD_PAD=launch.head_pad, PAGE_SIZE=16, BLOCK_Q=launch.block_q,
                     BLOCK_M=launch.block_m, BLOCK_N=launch.block_n, SPLIT=True, IEEE=False, PDL=False)
    hints = {}
    for policy in ("", "evict_first"):
        ptx = compile_for_hopper(kernels._attend_kernel, signature, dict(constants, EVICT=policy), aligned_pointers=True,
                                 num_warps=kernels.NUM_WARPS, num_stages=launch.num_stages)["ptx"]
        hints[policy] = ptx.count("L2::cache_hint")
    assert hints[""] == 0 and hints["evict_first"] > 0, hints


def test_nothing_launches_off_a_hopper_gpu_and_the_switches_stand_off():
    from tpspec.model import layers
    from tpspec.model import paged_attention_triton as kernels

    pytest.importorskip("triton")
    from tpspec.model import l2_prefetch

    assert not l2_prefetch.runs_on(torch.device("cpu"))
    l2_prefetch.prefetch(torch.zeros(1 << 16), 1 << 20)  # a CPU tensor: nothing to do, no error
    # Off until a GPU run shows a step they make shorter.
    assert (layers.QKV_PREFETCH_BYTES, layers.O_PROJ_PREFETCH_BYTES, layers.GATE_UP_PREFETCH_BYTES,
            layers.DOWN_PREFETCH_BYTES) == (0, 0, 0, 0)
    assert kernels.KV_EVICTION == ""


# ---------------------------------------------------------------------------------------- GPU

def _needs_hopper():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("the bulk L2 prefetch needs compute capability 9.0")


@pytest.mark.gpu
@needs_triton
def test_cuda_prefetch_and_evict_first_change_no_value(monkeypatch):
    """Verification of eight requests at Llama 3 8B's attention sizes, then o_proj's product, in
    bfloat16: with the o_proj weight prefetched (whole, and a part that is no whole chunk) and the KV
    loads ``evict_first``, the bits of the plain run, eagerly and replayed in a CUDA graph."""
    from tpspec.model import l2_prefetch
    from tpspec.model import paged_attention_triton as kernels

    _needs_hopper()
    gen = torch.Generator(device="cuda").manual_seed(0)
    heads, kv_heads, hd, page, seqs, rows = 32, 8, 128, 16, 8, 4
    w_o = (torch.randn(4096, heads * hd, generator=gen, device="cuda") * 0.02).to(torch.bfloat16)
    k_pages = torch.randn(seqs * 80, page, kv_heads, hd, generator=gen, device="cuda").to(torch.bfloat16)
    v_pages = torch.randn(seqs * 80, page, kv_heads, hd, generator=gen, device="cuda").to(torch.bfloat16)
    q = torch.randn(seqs * rows, heads, hd, generator=gen, device="cuda").to(torch.bfloat16)
    page_table = torch.randperm(seqs * 80, generator=gen, device="cuda").view(seqs, 80).to(torch.int32)
    seq_starts = torch.arange(0, seqs * rows + 1, rows, device="cuda")
    cache_lens = torch.tensor([1000, 17, 1270, 600, 3, 999, 1024, 640], device="cuda")
    tok_visible = (cache_lens.repeat_interleave(rows) + torch.arange(rows, device="cuda").repeat(seqs) + 1).int()

    def step(prefetch_bytes: int):
        monkeypatch.setattr(kernels, "KV_EVICTION", "evict_first" if prefetch_bytes else "")
        l2_prefetch.prefetch(w_o, prefetch_bytes)
        a = kernels.paged_attention(q, k_pages, v_pages, page_table, seq_starts, tok_visible, hd**-0.5, q_max=rows)
        return [a, a.view(seqs * rows, heads * hd) @ w_o.t()]

    plain = step(0)
    for prefetch_bytes in (1 << 30, 5 * l2_prefetch.CHUNK_BYTES + 48):
        eager = step(prefetch_bytes)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = step(prefetch_bytes)
        graph.replay()
        torch.cuda.synchronize()
        for want, got in zip(plain * 2, eager + captured):
            assert torch.equal(want, got), prefetch_bytes
    with pytest.raises(ValueError, match="contiguous"):
        l2_prefetch.prefetch(w_o.t(), 1 << 20)


@pytest.mark.gpu
@needs_triton
def test_cuda_engine_tokens_with_prefetch_equal_without(monkeypatch, tmp_path):
    """The tiny model in bfloat16 with graphed steps, greedy, batch 1 and 3: the same tokens with every
    linear's weight prefetched and the KV loads ``evict_first`` as with neither."""
    from tpspec.mapping import Mapping
    from tpspec.model import layers
    from tpspec.model import paged_attention_triton as kernels
    from tpspec.model.tiny import make_tiny_checkpoint
    from tpspec.runtime.config import EngineConfig, Request
    from tpspec.runtime.engine import Engine
    from tpspec.sampling.params import SamplingParams

    _needs_hopper()
    ckpt = str(make_tiny_checkpoint(str(tmp_path / "tiny"), seed=0))
    tokens = {}
    for on in (False, True):
        for name in ("QKV_PREFETCH_BYTES", "O_PROJ_PREFETCH_BYTES", "GATE_UP_PREFETCH_BYTES", "DOWN_PREFETCH_BYTES"):
            monkeypatch.setattr(layers, name, 1 << 30 if on else 0)
        monkeypatch.setattr(kernels, "KV_EVICTION", "evict_first" if on else "")
        engine = Engine(EngineConfig(ckpt, 1, "cuda", "bfloat16", max_batch_size=4, use_cuda_graphs=True,
                                     attention_backend="triton", gpu_memory_utilization=0.2), Mapping(), "cuda")
        try:
            tokens[on] = [[r.token_ids for r in engine.generate(
                [Request(i, (11 + i, 12, 13, 14 + i), SamplingParams(temperature=0.0), 24) for i in range(batch)])]
                for batch in (1, 3)]
        finally:
            engine.close()
    assert tokens[True] == tokens[False]
