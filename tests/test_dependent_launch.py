"""Programmatic dependent launch of the decoder's Triton kernels (:mod:`tpspec.model.dependent_launch`).

On CPU: the switch's rule, and every decoder kernel compiled for Hopper with its ``PDL`` flag (no
GPU: Triton's own ptxas): the machine code waits (``griddepcontrol.wait``) before it stores
anything and, but for the GEMVs' first weight tile, before it loads anything; it lets the next
kernel launch; without the flag neither instruction is there. On CUDA (``gpu`` marks): each kernel
launched with PDL gives the bits of an ordinary launch, eagerly and replayed in a CUDA graph, and
an engine's greedy tokens are the same with the switch on and off; the same for the GEMV's split
launches whose last program sums the splits (``gemv_triton.LAST_SPLIT_SUMS``).
"""

from __future__ import annotations

import pytest
import torch

from interpreted import needs_triton
from tpspec.model import dependent_launch

_POINTER_TYPES = {"part_ptr": "*fp32", "sq_ptr": "*fp32", "count_ptr": "*i32", "part_acc_ptr": "*fp32", "part_m_ptr": "*fp32",
                  "part_l_ptr": "*fp32", "page_table_ptr": "*i32", "seq_starts_ptr": "*i64",
                  "tok_visible_ptr": "*i32", "index_ptr": "*i64"}
_FLOATS = {"scale_log2", "eps", "hidden_f", "k_f"}


def _signature(fn, constants):
    """Argument types of ``fn`` as a launch with bfloat16 tensors types them."""
    sig = {}
    for name in fn.arg_names:
        if name in constants:
            continue
        if name.endswith("_ptr"):
            sig[name] = _POINTER_TYPES.get(name, "*bf16")
        else:
            sig[name] = "fp32" if name in _FLOATS else "i32"
    return sig


def _decoder_kernels():
    """``(name, kernel, constants, options, prefetches)`` of every kernel a decode step may launch with
    PDL, at Llama-3-8B-like sizes; ``prefetches``: it reads its first weight tile before the wait."""
    from tpspec.model import fused_triton as fused
    from tpspec.model import gemv_triton as gemv
    from tpspec.model import paged_attention_triton as attn

    one_row = gemv.plan_gemv(1, 4096, 14336, device="cpu")
    gemv_constants = dict(M_PAD=1, BLOCK_N=one_row.block_n, BLOCK_K=one_row.block_k, USE_DOT=False, EVEN=True,
                          SPLIT=True, LAST_SUMS=False, HAS_BIAS=False, IEEE=False, NUM_STAGES=one_row.num_stages,
                          SILU_MUL=True, SILU_MUL_OUT=False, ACCURATE_EXP=True, W_LEFT=False)
    rows = gemv.plan_gemv(8, 4096, 4096, device="cpu")
    dot_constants = dict(gemv_constants, M_PAD=rows.m_pad, BLOCK_N=rows.block_n, BLOCK_K=rows.block_k, USE_DOT=True,
                         SILU_MUL=False, NUM_STAGES=rows.num_stages, W_LEFT=rows.w_left)
    norm_rows_constants = dict(M_PAD=rows.m_pad, BLOCK_N=rows.block_n, BLOCK_K=rows.block_k, EVEN=True, SPLIT=True,
                               HAS_RES=True, HAS_BIAS=False, IEEE=False, NUM_STAGES=rows.num_stages,
                               SILU_MUL_OUT=False, ACCURATE_EXP=True, W_LEFT=rows.w_left)
    few = gemv.plan_gemv(gemv.FEW_ROWS, 4096, 14336, device="cpu")
    few_constants = dict(BLOCK_N=few.block_n, BLOCK_K=few.block_k, EVEN=True, SPLIT=True, HAS_BIAS=False,
                         NUM_STAGES=few.num_stages, SILU_MUL=True, SILU_MUL_OUT=False, ACCURATE_EXP=True)
    launch = attn.plan_launch(num_tokens=1, num_seqs=1, q_max=1, kv_pages=64, page_size=16, num_heads=32, kv_heads=8,
                              head_dim=128, device="cpu")
    attend = dict(GROUP=4, HEAD_DIM=128, HEAD_PAD=128, PAGE_SIZE=16, BLOCK_Q=launch.block_q, BLOCK_M=launch.block_m,
                  BLOCK_N=launch.block_n, SPLIT=True, IEEE=False, ROTARY=False)
    warps = {"num_warps": 4, "enable_fp_fusion": True}
    return [
        ("gemv one row, silu", gemv._gemv_kernel, gemv_constants, dict(warps, num_stages=one_row.num_stages), True),
        ("gemv one row, silu, last split sums", gemv._gemv_kernel, dict(gemv_constants, LAST_SUMS=True),
         dict(warps, num_stages=one_row.num_stages), True),
        ("gemv rows", gemv._gemv_kernel, dot_constants, dict(warps, num_stages=rows.num_stages), True),
        ("gemv rows, last split sums", gemv._gemv_kernel, dict(dot_constants, LAST_SUMS=True),
         dict(warps, num_stages=rows.num_stages), True),
        ("gemv rows, the other operand order", gemv._gemv_kernel, dict(dot_constants, W_LEFT=not rows.w_left),
         dict(warps, num_stages=rows.num_stages), True),
        ("gemv rows, silu out", gemv._gemv_kernel, dict(dot_constants, SPLIT=False, SILU_MUL_OUT=True),
         dict(warps, num_stages=rows.num_stages), True),
        *[(f"norm gemv rows, weights left {left}", gemv._norm_rows_kernel, dict(norm_rows_constants, W_LEFT=left),
           dict(warps, num_stages=rows.num_stages), True) for left in (False, True)],
        ("norm gemv rows, silu out", gemv._norm_rows_kernel, dict(norm_rows_constants, SPLIT=False, SILU_MUL_OUT=True),
         dict(warps, num_stages=rows.num_stages), True),
        ("gemv few rows, silu", gemv._few_rows_kernel, few_constants, dict(warps, num_stages=few.num_stages), True),
        ("norm gemv few rows", gemv._norm_few_rows_kernel,
         dict(BLOCK_N=few.block_n, BLOCK_K=few.block_k, EVEN=True, SPLIT=True, HAS_RES=True, HAS_BIAS=False,
              NUM_STAGES=few.num_stages, SILU_MUL_OUT=False, ACCURATE_EXP=True),
         dict(warps, num_stages=few.num_stages), True),
        *[(f"gemv reduce, silu out {out}", gemv._reduce_kernel,
           dict(HAS_BIAS=True, SILU_MUL_OUT=out, ACCURATE_EXP=True, BLOCK=gemv.REDUCE_BLOCK), warps, False)
          for out in (False, True)],
        *[(f"norm gemv, last split sums {last}", gemv._norm_gemv_kernel,
           dict(BLOCK_N=16, BLOCK_K=256, EVEN=True, SPLIT=True, LAST_SUMS=last, HAS_RES=True, HAS_BIAS=False,
                NUM_STAGES=3), dict(warps, num_stages=3), True) for last in (False, True)],
        ("norm reduce", gemv._norm_reduce_kernel, dict(HAS_BIAS=False, BLOCK=gemv.REDUCE_BLOCK), warps, False),
        ("rms norm", fused._rms_norm_kernel, dict(HAS_RESIDUAL=True, BLOCK=4096),
         {"num_warps": 8, "enable_fp_fusion": False}, False),
        ("rotary kv", fused._rotary_kv_kernel, dict(NUM_HEADS=32, NUM_KV_HEADS=8, HEAD_DIM=128, HALF_PAD=64),
         {"num_warps": 1, "enable_fp_fusion": False}, False),
        ("silu mul", fused._silu_mul_kernel, dict(ACCURATE_EXP=True, BLOCK=fused.SILU_BLOCK),
         {"num_warps": 4, "enable_fp_fusion": False}, False),
        ("attention", attn._attend_kernel, attend, dict(warps, num_stages=launch.num_stages), False),
        ("attention, rotary inside", attn._attend_kernel, dict(attend, ROTARY=True),
         dict(warps, num_stages=launch.num_stages), False),
        ("merge", attn._merge_kernel, dict(HEAD_DIM=128, HEAD_PAD=128, SPLITS_PAD=8), warps, False),
    ]


def _first(ptx: str, *needles: str) -> int:
    found = [i for i in (ptx.find(n) for n in needles) if i >= 0]
    return min(found) if found else len(ptx)


def test_rule_needs_the_switch_cuda_and_hopper(monkeypatch):
    assert dependent_launch.PDL_KERNELS is True  # on since a GPU run of the gpu tests below passed
    assert not dependent_launch.use_pdl(torch.device("cpu"))  # so never under Triton's interpreter
    monkeypatch.setattr(dependent_launch, "_has_pdl", lambda index: index == 1)  # an Ampere card at 0, Hopper at 1
    monkeypatch.setattr(dependent_launch, "_triton_has_pdl", lambda: True)
    assert dependent_launch.use_pdl(torch.device("cuda", 1))
    assert not dependent_launch.use_pdl(torch.device("cuda", 0))
    monkeypatch.setattr(dependent_launch, "_triton_has_pdl", lambda: False)  # a triton without griddepcontrol
    assert not dependent_launch.use_pdl(torch.device("cuda", 1))
    monkeypatch.setattr(dependent_launch, "_triton_has_pdl", lambda: True)
    monkeypatch.setattr(dependent_launch, "PDL_KERNELS", False)
    assert not dependent_launch.use_pdl(torch.device("cuda", 1))


@needs_triton
def test_this_triton_has_the_instructions():
    assert dependent_launch._triton_has_pdl()


def test_no_launch_option_without_pdl(monkeypatch):
    """A launch without PDL passes no option at all (a ``triton`` too old to know it still launches),
    and the kernel's flag always matches the option (no kernel launches early without waiting)."""
    assert dependent_launch.pdl_args(torch.device("cpu")) == {"PDL": False}
    monkeypatch.setattr(dependent_launch, "use_pdl", lambda device: True)
    assert dependent_launch.pdl_args(torch.device("cuda", 0)) == {"PDL": True, "launch_pdl": True}


@needs_triton
def test_kernels_wait_before_touching_memory():
    """Each kernel compiled with ``PDL``: ``griddepcontrol.wait`` comes before any store and, but for
    the GEMVs' first weight tile, before any load; ``launch_dependents`` is there. Without the flag,
    neither instruction."""
    from interpreted import compile_for_hopper

    for name, fn, constants, options, prefetches in _decoder_kernels():
        for pdl in (False, True):
            asm = compile_for_hopper(fn, _signature(fn, constants), dict(constants, PDL=pdl), aligned_pointers=True,
                                     launch_pdl=pdl, **options)
            ptx = asm["ptx"]
            assert ("griddepcontrol.wait" in ptx) == pdl, name
            assert ("griddepcontrol.launch_dependents" in ptx) == pdl, name
            if not pdl:
                continue
            wait = ptx.find("griddepcontrol.wait")
            assert _first(ptx, "st.global", "atom.global", "red.global") > wait, name
            loads_before = _first(ptx, "ld.global", "cp.async") < wait
            assert loads_before == prefetches, name


# ---------------------------------------------------------------------------------------- GPU

def _with_pdl(monkeypatch, on: bool) -> None:
    monkeypatch.setattr(dependent_launch, "PDL_KERNELS", on)


# (dependent launch, the GEMV's last split sums): every combination the GPU tests compare.
_SWITCHES = ((False, False), (True, False), (True, True), (False, True))


def _with_last_split(monkeypatch, on: bool) -> None:
    from tpspec.model import gemv_triton

    monkeypatch.setattr(gemv_triton, "LAST_SPLIT_SUMS", on)


@pytest.mark.gpu
@needs_triton
@pytest.mark.parametrize("rows", [1, 4])
def test_cuda_kernels_with_pdl_equal_plain_launches(monkeypatch, rows):
    """A chain of every decoder kernel, each reading the one before's output, in bfloat16 at
    Llama-3-8B sizes, for one decode row and for a verification step's four rows (the few-rows
    GEMV kernels): with PDL the bits of ordinary launches, eagerly and replayed in a CUDA graph."""
    from tpspec.model import fused_triton as fused
    from tpspec.model import gemv_triton as gemv
    from tpspec.model import paged_attention_triton as attn

    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("programmatic dependent launch needs compute capability 9.0")
    gen = torch.Generator(device="cuda").manual_seed(0)
    bf16 = torch.bfloat16

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, device="cuda") * scale).to(bf16)

    hidden, heads, kv_heads, hd, inter, page = 4096, 32, 8, 128, 14336, 16
    w_qkv = randn((heads + 2 * kv_heads) * hd, hidden, scale=hidden**-0.5)
    w_o = randn(hidden, heads * hd, scale=hidden**-0.5)
    w_gu = randn(2 * inter, hidden, scale=hidden**-0.5)
    w_down = randn(hidden, inter, scale=inter**-0.5)
    g1, g2 = randn(hidden, scale=0.1) + 1, randn(hidden, scale=0.1) + 1
    k_pages, v_pages = randn(128, page, kv_heads, hd), randn(128, page, kv_heads, hd)
    x, res = randn(rows, hidden), randn(rows, hidden)
    cache_len = 1000
    page_table = torch.randperm(128, generator=gen, device="cuda")[None, :].to(torch.int32)
    positions = torch.arange(cache_len, cache_len + rows, device="cuda")
    write_index = page_table[0, positions // page].long() * page + positions % page
    seq_starts = torch.tensor([0, rows], device="cuda")
    tok_visible = (positions + 1).to(torch.int32)
    angles = torch.arange(hd, device="cuda", dtype=torch.float32)[None] * 0.01 * positions[:, None]
    cos, sin = angles.cos().to(bf16), angles.sin().to(bf16)
    assert gemv.plan_gemv(rows, hidden, hidden, device="cuda").m_pad == (1 if rows == 1 else gemv.FEW_ROWS)

    def layer():
        qkv, h = gemv.norm_linear(x, res, g1, 1e-5, w_qkv)
        q = fused.rotary_and_write_kv(qkv, cos, sin, write_index, k_pages, v_pages, heads, kv_heads, hd)
        a = attn.paged_attention(q, k_pages, v_pages, page_table, seq_starts, tok_visible, hd**-0.5, q_max=rows)
        o = gemv.linear(a.view(rows, heads * hd), w_o)
        gu, h2 = gemv.norm_linear(o, h, g2, 1e-5, w_gu)
        outs = [qkv, h, q, a, o, gu, h2, gemv.silu_mul_linear(gu, w_down), gemv.linear(fused.silu_mul(gu), w_down)]
        normed, h3 = fused.add_rms_norm(outs[-1], h2, g1, 1e-5)
        return outs + [normed, h3, k_pages.clone(), v_pages.clone()]

    results = {}
    for pdl, last_sums in _SWITCHES:
        _with_pdl(monkeypatch, pdl)
        _with_last_split(monkeypatch, last_sums)
        eager = layer()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = layer()
        graph.replay()
        torch.cuda.synchronize()
        results[pdl, last_sums] = (eager, [t.clone() for t in captured])
    plain = results[False, False]
    for switches, got in results.items():
        for eager_or_graph in (0, 1):
            for i, (want, have) in enumerate(zip(plain[eager_or_graph], got[eager_or_graph])):
                assert torch.equal(want, have), (switches, eager_or_graph, i)


@pytest.mark.gpu
@needs_triton
def test_cuda_engine_tokens_with_pdl_equal_without(monkeypatch, tmp_path):
    """The tiny model in bfloat16 with graphed steps, greedy, batch 1 (every one-row kernel) and 3:
    the same tokens with the switches on and off (dependent launch; the GEMV's last split sums)."""
    from tpspec.mapping import Mapping
    from tpspec.model.tiny import make_tiny_checkpoint
    from tpspec.runtime.config import EngineConfig, Request
    from tpspec.runtime.engine import Engine
    from tpspec.sampling.params import SamplingParams

    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("programmatic dependent launch needs compute capability 9.0")
    ckpt = str(make_tiny_checkpoint(str(tmp_path / "tiny"), seed=0))
    tokens = {}
    for on in _SWITCHES[:3]:  # off, dependent launch, both
        _with_pdl(monkeypatch, on[0])
        _with_last_split(monkeypatch, on[1])
        engine = Engine(EngineConfig(ckpt, 1, "cuda", "bfloat16", max_batch_size=4, use_cuda_graphs=True,
                                     gpu_memory_utilization=0.2), Mapping(), "cuda")
        try:
            tokens[on] = [[r.token_ids for r in engine.generate(
                [Request(i, (11 + i, 12, 13, 14 + i), SamplingParams(temperature=0.0), 24) for i in range(batch)])]
                for batch in (1, 3)]
        finally:
            engine.close()
    assert all(t == tokens[False, False] for t in tokens.values()), tokens
