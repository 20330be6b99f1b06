"""The ``triton`` attention backend (:mod:`tpspec.model.paged_attention_triton`).

On CPU through Triton's interpreter (a subprocess sets ``TRITON_INTERPRET=1`` before Triton is
imported; skipped without ``triton``): the kernels against a float64 reference (decode,
verification, prefill chunks; GQA groups 1, 3, 4, 8; pages of 16 and 32; ragged lengths; a
sequence ending on a page boundary; one and several KV splits) in float32 and float16 (the
interpreter's ``tl.dot`` does not handle bfloat16), and ``LLM("tiny", attention_backend="triton")``
at TP 1 and 2 giving the torch backend's and Hugging Face transformers' greedy tokens; rotary and
the K/V write inside the kernel (``paged_attention_qkv``, ``FUSED_ROTARY``) against the rotary
kernel and the attention, bit for bit, and an engine's tokens with it on and off. On CUDA (``gpu``
marks): the kernels in bfloat16, float16 and float32, rotary inside in the 16-bit dtypes, a
CUDA-graph replay against an eager run, and engines on the triton backend against the torch backend.

The choice rule: ``attention_backend="auto"`` runs ``AUTO_CUDA_ATTENTION`` on CUDA (a backend a
GPU run has checked; never FlashInfer) and torch elsewhere; ``"triton"`` on CPU outside the
interpreter is a ``ValueError``. The checks shared with the GPU live in ``paged_attention_cases.py``.
"""

from __future__ import annotations

import os

import pytest
import torch

from interpreted import InterpretedGroups, has_triton, needs_triton
from tpspec.model import attention as attention_mod
from tpspec.model.attention import AUTO_CUDA_ATTENTION, choose_attention_backend


def _interpreter_too_old() -> bool:
    from tpspec.model import paged_attention_triton as kernels

    return kernels.triton_version() < kernels.INTERPRETER_MIN_TRITON


# The interpreter of Triton 3.9 or later: older ones cannot run the kernel's loops over bounds read
# from tensors (attention_backend="triton" refuses them on CPU: test_old_interpreter_is_refused).
needs_interpreter = pytest.mark.skipif(not has_triton or _interpreter_too_old(),
                                       reason="needs triton >= 3.9 (its interpreter runs the attention kernel)")


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    """This module's interpreted groups, started at once (side by side on the machine's cores)."""
    groups = InterpretedGroups("paged_attention_cases.py", {"kernels": ("float32", "float16"), "llm": ("float32",)},
                               tmp_path_factory.mktemp("paged_attention"))
    yield groups
    groups.close()


@needs_interpreter
def test_interpreted_kernels_match_the_float64_reference(interpreted):
    interpreted.check("kernels")


@needs_interpreter
def test_interpreted_llm_tokens_equal_torch_backend_and_transformers(interpreted):
    interpreted.check("llm")


@needs_triton
def test_launch_pipelines_only_long_decode_splits():
    """The launch rule (H100-sized splits given explicitly): a decode or verification program
    whose split spans ``PIPELINED_SPLIT_LEN`` page-table positions or more loops over tiles of
    ``BLOCK_N`` in ``NUM_STAGES`` stages; a shorter split reads tiles of ``BLOCK_N_SMALL_M``
    plainly; prefill blocks load plainly whatever the length."""
    from tpspec.model import paged_attention_triton as kernels

    def plan(q_max: int, kv_pages: int, splits: int) -> kernels.Launch:
        return kernels.plan_launch(num_tokens=8 * q_max, num_seqs=8, q_max=q_max, kv_pages=kv_pages, page_size=16,
                                   num_heads=32, kv_heads=8, head_dim=128, device="cpu", num_splits=splits)

    for q_max in (1, 4):  # decode, verification of 3 drafts
        long, short = plan(q_max, 512, 5), plan(q_max, 128, 5)  # 1639 and 410 positions a split
        assert (long.block_n, long.num_stages) == (kernels.BLOCK_N, kernels.NUM_STAGES)
        assert (short.block_n, short.num_stages) == (kernels.BLOCK_N_SMALL_M, 1)
    prefill = plan(64, 512, 1)
    assert prefill.block_m > kernels.SMALL_BLOCK_M and (prefill.block_n, prefill.num_stages) == (kernels.BLOCK_N, 1)
    assert kernels.NUM_STAGES > 1 and kernels.PIPELINED_SPLIT_LEN % kernels.BLOCK_N == 0


@needs_triton
def test_decode_kernel_keeps_the_next_tiles_in_flight():
    """Compiled for Hopper without a GPU, as a bfloat16 decode launch of Llama 3's heads compiles
    it (pointers 16-byte aligned; the K/V strides, multiples of 16, specialized so): with a long
    split, the loop over its KV tiles is software-pipelined, the K and V tiles copied
    asynchronously (``cp.async``) while the previous tile is summed, with rotary and the K/V write
    inside too; with a short split's plan the same kernel loads them synchronously."""
    from interpreted import compile_for_hopper
    from tpspec.model import paged_attention_triton as kernels

    pointers = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "out_ptr": "*bf16", "page_table_ptr": "*i32",
                "seq_starts_ptr": "*i64", "tok_visible_ptr": "*i32", "part_acc_ptr": "*fp32", "part_m_ptr": "*fp32",
                "part_l_ptr": "*fp32", "cos_ptr": "*bf16", "sin_ptr": "*bf16"}
    integers = ["num_heads", "q_blocks", "num_splits", "stride_qt", "stride_qh", "stride_ot", "stride_oh", "stride_kp",
                "stride_ko", "stride_kh", "stride_vp", "stride_vo", "stride_vh", "stride_pt", "stride_ct", "stride_st"]
    signature = {**pointers, "scale_log2": "fp32", **{name: "i32" for name in integers}}
    async_copies = {}
    for kv_pages, rotary in ((512, False), (128, False), (512, True)):  # 1639 and 410 positions a split
        launch = kernels.plan_launch(num_tokens=8, num_seqs=8, q_max=1, kv_pages=kv_pages, page_size=16,
                                     num_heads=32, kv_heads=8, head_dim=128, device="cpu", num_splits=5)
        constants = dict(GROUP=4, HEAD_DIM=128, HEAD_PAD=launch.head_pad, PAGE_SIZE=16, BLOCK_Q=launch.block_q,
                         BLOCK_M=launch.block_m, BLOCK_N=launch.block_n, SPLIT=True, IEEE=False, ROTARY=rotary,
                         PDL=False)
        kv_strides = tuple(n for n in integers if n.startswith(("stride_k", "stride_v")))
        ptx = compile_for_hopper(kernels._attend_kernel, signature, constants, aligned_pointers=True,
                                 multiples_of_16=kv_strides, num_warps=kernels.NUM_WARPS,
                                 num_stages=launch.num_stages, enable_fp_fusion=True)["ptx"]
        async_copies[kv_pages, rotary] = ptx.count("cp.async.cg.shared.global")
    # With rotary and the K/V write inside (paged_attention_qkv), the loop over the cached tiles stays pipelined.
    assert async_copies[512, False] >= 16 and async_copies[128, False] == 0, async_copies
    assert async_copies[512, True] >= 16, async_copies


def test_auto_runs_only_the_checked_backend(monkeypatch):
    """``auto``: torch off CUDA; on CUDA ``AUTO_CUDA_ATTENTION`` (torch when it cannot run there),
    never FlashInfer, even where FlashInfer is installed; FlashInfer only by name."""
    assert AUTO_CUDA_ATTENTION in ("torch", "triton")
    monkeypatch.setattr(attention_mod, "flashinfer_available", lambda: True)
    assert choose_attention_backend("cpu", 128) == "torch"
    want = AUTO_CUDA_ATTENTION
    if want == "triton" and attention_mod._triton_unusable(torch.device("cuda")) is not None:
        want = "torch"
    assert choose_attention_backend("cuda", 128) == want
    assert choose_attention_backend("cuda", 128, "flashinfer") == "flashinfer"
    assert choose_attention_backend("cuda", 128, "torch") == "torch"
    monkeypatch.setattr(attention_mod, "AUTO_CUDA_ATTENTION", "triton")  # after the GPU check: the flip
    monkeypatch.setattr(attention_mod, "_triton_unusable", lambda device: None)
    assert choose_attention_backend("cuda", 128) == "triton"
    assert choose_attention_backend("cpu", 128) == "torch"
    monkeypatch.setattr(attention_mod, "_triton_unusable", lambda device: "no triton")
    assert choose_attention_backend("cuda", 128) == "torch"  # auto falls back; a forced triton raises
    with pytest.raises(ValueError, match="attention_backend='triton' cannot run here: no triton"):
        choose_attention_backend("cuda", 128, "triton")
    with pytest.raises(ValueError, match="fixed-order attention"):
        choose_attention_backend("cuda", 128, "triton", deterministic=True)


def test_old_interpreter_is_refused(monkeypatch):
    """On CPU, Triton's interpreter before 3.9 (which cannot run the kernel's loops) is a
    ValueError naming the version it needs, and ``auto`` never picks triton there anyway."""
    from types import SimpleNamespace

    old = SimpleNamespace(INTERPRETED=True, INTERPRETER_MIN_TRITON=(3, 9), triton_version=lambda: (3, 6))
    monkeypatch.setattr(attention_mod, "triton_kernels", lambda: old)
    with pytest.raises(ValueError, match=r"Triton 3\.9 or later.*this is Triton 3\.6"):
        choose_attention_backend("cpu", 16, "triton")
    assert choose_attention_backend("cpu", 16) == "torch"
    monkeypatch.setattr(old, "triton_version", lambda: (3, 9))
    assert choose_attention_backend("cpu", 16, "triton") == "triton"


def test_triton_on_cpu_needs_the_interpreter(capsys):
    """Outside the interpreter, ``attention_backend="triton"`` on CPU is a ValueError that says
    how to run it, raised by ``LLM`` before any worker starts (``tpspec generate`` prints it, exit 2)."""
    from tpspec import LLM
    from tpspec.runtime.config import EngineConfig

    why = "TRITON_INTERPRET=1" if has_triton else "needs the triton package"
    if has_triton and os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("this process runs Triton's interpreter")
    with pytest.raises(ValueError, match=why):
        choose_attention_backend("cpu", 16, "triton")
    with pytest.raises(ValueError, match=why):
        LLM("tiny", device="cpu", attention_backend="triton")
    from tpspec.cli import main

    assert main(["generate", "--device", "cpu", "--attention-backend", "triton", "--max-tokens", "2"]) == 2
    assert why in capsys.readouterr().err
    assert EngineConfig("x", 1, "cpu", "float32", attention_backend="triton").attention_backend == "triton"
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        EngineConfig("x", 1, "cpu", "float32", attention_backend="Triton")


# ---------------------------------------------------------------------------------------- GPU

@pytest.mark.gpu
@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16,
                                   pytest.param(torch.float32, marks=pytest.mark.slow)])  # IEEE dots: the slowest
def test_cuda_kernels_match_the_float64_reference(dtype):
    import paged_attention_cases as cases

    cases.check_kernels("cuda", dtype)
    cases.check_backend("cuda", dtype)


@pytest.mark.gpu
@pytest.mark.slow  # not in the quick group's share: `gpu_run.sh OUT fused` runs it by name
@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_cuda_rotary_inside_equals_the_two_kernels(dtype):
    """``paged_attention_qkv`` gives the bits of ``rotary_and_write_kv`` and ``paged_attention`` (the
    output and the pages) in the 16-bit dtypes, and an engine with ``FUSED_ROTARY`` on (graphed
    steps) the greedy tokens of one with it off."""
    import paged_attention_cases as cases

    cases.check_rotary_in_the_kernel("cuda", dtype)
    if dtype == torch.bfloat16:
        cases.check_engine_rotary_inside("cuda", dtype)


@pytest.mark.gpu
@needs_triton
@pytest.mark.parametrize("query_len", [1, 4], ids=["decode", "verify"])
def test_cuda_graph_replay_equals_eager(query_len):
    """The backend's bind + attend captured in a CUDA graph (a small batch with long contexts:
    several KV splits), replayed after the next step's metadata is copied in, gives the bits
    of an eager run of that step."""
    import paged_attention_cases as cases
    from tpspec.model import paged_attention_triton as kernels
    from tpspec.model.attention import TritonPagedAttention
    from tpspec.model.batch import AttentionMetadata, ForwardBatch
    from tpspec.model.kv_cache import KVPages

    heads, kv_heads, head_dim, page = 32, 8, 128, 16
    dtype = torch.bfloat16
    width = 128  # page-table columns: 2048 positions
    gen = torch.Generator().manual_seed(0)
    num_pages = 2 * width + 1
    pages = KVPages(num_pages, page, kv_heads, head_dim, dtype=dtype, device="cuda")
    pages.k.copy_(torch.randn(pages.k.shape, generator=gen))
    pages.v.copy_(torch.randn(pages.v.shape, generator=gen))
    perm = torch.randperm(num_pages, generator=gen).tolist()
    tables = [perm[:width], perm[width : 2 * width]]
    attn = TritonPagedAttention(num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, scale=head_dim**-0.5,
                                dtype=dtype, device=torch.device("cuda"))

    def meta_of(cache_lens: list[int]) -> AttentionMetadata:
        n = 2 * query_len
        batch = ForwardBatch(torch.zeros(n, dtype=torch.int64), torch.zeros(n, dtype=torch.int64), tables,
                             cache_lens, [query_len] * 2)
        return AttentionMetadata.build(batch, "cuda", page, kv_pages=width)

    q = torch.randn(2 * query_len, heads, head_dim, generator=gen).to("cuda", dtype)
    static = meta_of([3, 1500])
    launch = kernels.plan_launch(num_tokens=q.shape[0], num_seqs=2, q_max=query_len, kv_pages=width,
                                 page_size=page, num_heads=heads, kv_heads=kv_heads, head_dim=head_dim, device="cuda")
    assert launch.num_splits > 1
    attn.plan(static, graph=True)
    attn.bind(static)(q, pages)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = attn.bind(static)(q, pages)
    nxt = meta_of([2000, 17])
    static.copy_(nxt)
    attn.plan(static, graph=True)
    graph.replay()
    torch.cuda.synchronize()
    eager = attn.bind(nxt)(q, pages)
    assert torch.equal(out.view(torch.int16), eager.view(torch.int16))
    case = cases.Case((heads, kv_heads, head_dim, page), "cuda", dtype, lens=([2000, 17], [query_len] * 2))
    case.tables, case.k, case.v, case.q = tables, pages.k, pages.v, q
    assert (out.double() - case.reference()).abs().max().item() < 3e-2


@pytest.mark.gpu
@needs_triton
def test_cuda_engine_tokens_equal_torch_backend(tmp_path):
    """The tiny model (float32) on CUDA with graphed steps: the same greedy tokens on the triton
    and torch backends, with n-gram drafts."""
    from tpspec.mapping import Mapping
    from tpspec.model.tiny import make_tiny_checkpoint
    from tpspec.runtime.config import EngineConfig, Request, SpeculativeConfig
    from tpspec.runtime.engine import Engine
    from tpspec.sampling.params import SamplingParams

    ckpt = str(make_tiny_checkpoint(tmp_path / "tiny", seed=0))
    prompts = [[5, 6, 7, 8, 9, 10, 5, 6, 7], [100, 200, 300, 5, 6, 7], [42] * 12, list(range(3, 43)), [7]]
    requests = [Request(i, tuple(p), SamplingParams(temperature=0.0), 24) for i, p in enumerate(prompts)]
    tokens = {}
    for backend in ("torch", "triton"):
        engine = Engine(EngineConfig(ckpt, 1, "cuda", "float32", speculative=SpeculativeConfig("ngram", 3),
                                     max_batch_size=4, gpu_memory_utilization=0.2, attention_backend=backend),
                        Mapping(), "cuda")
        assert engine.model.attention.name == backend
        tokens[backend] = [r.token_ids for r in engine.generate(requests)]
        assert engine.graphs is not None and engine.graphs.graphs  # graphed steps ran
        engine.close()
    assert tokens["triton"] == tokens["torch"]


@pytest.mark.gpu
@needs_triton
def test_cuda_llama_3_8b_layers_match_torch_backend():
    """Two layers of the Llama-3-8B shape in bfloat16: prefill, verification, decode and a rewound
    step give the torch backend's logits."""
    from model_helpers import assert_shape_logits_match_torch_backend

    assert_shape_logits_match_torch_backend("triton")
