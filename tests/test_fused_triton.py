"""The fused layer kernels (:mod:`tpspec.model.fused_triton`) and the switch that turns them on.

On CPU through Triton's interpreter (a subprocess sets ``TRITON_INTERPRET=1`` before Triton is
imported; skipped without ``triton``): each kernel against the torch layers in float32 and float16
(rotary, the KV rows and the residual sum bit for bit; the norm and ``silu`` within 8 machine
epsilons, relative and absolute, in float32 and 2 in the half types, see ``fused_triton_cases.py``); and with the kernels against
without: a small random model's logits and greedy tokens at TP 1, TP 2 and under attention DP
(gloo ranks), the tiny EAGLE-3 head's drafts, and the tiny checkpoint's engine (n-gram drafts)
giving the same greedy tokens. On CUDA (``gpu`` marks): the kernels in float32, float16 and
bfloat16 at small and Llama-3-8B sizes, the kernels captured in a CUDA graph and replayed on new
inputs against an eager run, the engine with graphed steps, and two Llama-3-8B-shape layers in
bfloat16 with the kernels against without.

The switch: ``FUSED_CUDA_KERNELS`` (on: those GPU tests passed on a GPU) and
:func:`~tpspec.model.layers.use_fused_kernels`, never on in deterministic mode.
"""

from __future__ import annotations

import pytest
import torch

from interpreted import InterpretedGroups, needs_triton
from tpspec.model import layers


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    """This module's interpreted groups, started at once (side by side on the machine's cores)."""
    groups = InterpretedGroups("fused_triton_cases.py", {"kernels": ("float32", "float16"), "model": ("float32",),
                                                         "tp": ("float32",), "engine": ("float32",)},
                               tmp_path_factory.mktemp("fused_triton"))
    yield groups
    groups.close()


@needs_triton
def test_interpreted_kernels_match_torch_layers(interpreted):
    interpreted.check("kernels")


@needs_triton
def test_interpreted_model_logits_and_tokens_match_torch_layers(interpreted):
    interpreted.check("model")


@needs_triton
def test_interpreted_tp_and_attention_dp_match_torch_layers(interpreted):
    interpreted.check("tp")


@needs_triton
def test_interpreted_engine_tokens_equal_torch_layers(interpreted):
    interpreted.check("engine")


def test_switch_decides_per_device_and_mode(monkeypatch):
    """On CUDA while ``FUSED_CUDA_KERNELS`` is on (the default) and ``triton`` compiles; on CPU only
    under the interpreter with ``FUSED_UNDER_INTERPRETER``; never in deterministic mode or without
    ``triton``."""
    assert layers.FUSED_CUDA_KERNELS and not layers.FUSED_UNDER_INTERPRETER
    assert not layers.use_fused_kernels("cpu")

    class Kernels:
        INTERPRETED = False

    monkeypatch.setattr(layers, "fused_kernels", lambda: Kernels)
    assert layers.use_fused_kernels("cuda")
    assert not layers.use_fused_kernels("cuda", deterministic=True)
    assert not layers.use_fused_kernels("cpu")
    monkeypatch.setattr(layers, "FUSED_CUDA_KERNELS", False)
    assert not layers.use_fused_kernels("cuda")
    Kernels.INTERPRETED = True
    assert not layers.use_fused_kernels("cpu")
    monkeypatch.setattr(layers, "FUSED_UNDER_INTERPRETER", True)
    assert layers.use_fused_kernels("cpu") and not layers.use_fused_kernels("cuda")
    assert not layers.use_fused_kernels("cpu", deterministic=True)
    monkeypatch.setattr(layers, "FUSED_CUDA_KERNELS", True)
    monkeypatch.setattr(layers, "fused_kernels", lambda: None)
    assert not layers.use_fused_kernels("cuda") and not layers.use_fused_kernels("cpu")


def test_deterministic_layers_never_fuse():
    """A layer asked for both keeps deterministic mode's path."""
    from tpspec.model import ModelConfig
    from tpspec.model.tiny import tiny_config_dict

    cfg = ModelConfig.from_dict(tiny_config_dict())
    kw = {"dtype": torch.float32, "device": "cpu", "deterministic": True, "fused": True}
    assert not layers.RMSNorm("w", 8, 1e-5, **kw).fused
    assert not layers.Attention(cfg, 0, 1, 0, None, **kw).fused
    assert not layers.MLP(cfg, 0, 1, 0, None, **kw).fused
    assert not layers.RotaryEmbedding(cfg, **{k: v for k, v in kw.items() if k != "dtype"}).fused


@needs_triton
def test_once_a_step_kernels_compile_for_hopper():
    """The rotary cos and sin kernel compiled for Hopper (no GPU: Triton's own ptxas) calls CUDA's
    accurate ``cosf``/``sinf`` (what torch's ``cos``/``sin`` run), never the approximate
    instructions; the embedding kernel compiles too."""
    from interpreted import compile_for_hopper
    from tpspec.model import fused_triton

    signature = {"pos_ptr": "*i64", "inv_freq_ptr": "*fp32", "cos_ptr": "*bf16", "sin_ptr": "*bf16", "n": "i32"}
    asm = compile_for_hopper(fused_triton._cos_sin_kernel, signature,
                             {"HALF": 64, "HALF_PAD": 64, "BLOCK_T": 4, "ACCURATE": True}, num_warps=1,
                             enable_fp_fusion=False)
    assert "cubin" in asm
    assert "sin.approx" not in asm["ptx"] and "cos.approx" not in asm["ptx"]
    embed = compile_for_hopper(fused_triton._embed_kernel,
                               {"ids_ptr": "*i64", "weight_ptr": "*bf16", "out_ptr": "*bf16",
                                **{name: "i32" for name in ("offset", "real_width", "hidden", "stride_w", "stride_o")}},
                               {"BLOCK": fused_triton.EMBED_BLOCK}, num_warps=4, enable_fp_fusion=False)
    assert "cubin" in embed


# ---------------------------------------------------------------------------------------- GPU

@pytest.mark.gpu
@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_cuda_kernels_match_torch_layers(dtype):
    import fused_triton_cases as cases

    for check in cases.CHECKS["kernels"]:
        check("cuda", dtype)


@pytest.mark.gpu
@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_model_matches_torch_layers(dtype):
    import fused_triton_cases as cases

    cases.check_model("cuda", dtype)


@pytest.mark.gpu
@needs_triton
def test_cuda_graph_replay_equals_eager():
    """The four kernels at the Llama-3-8B decode shape (bfloat16) captured in one CUDA graph, replayed
    after new inputs (and new cache rows) are copied into its static tensors, give an eager run's bits."""
    from tpspec.model import fused_triton as kernels

    hidden, inter, heads, kv_heads, head_dim = 4096, 14336, 32, 8, 128
    n, num_pages, page = 4, 8, 16
    dtype, dev = torch.bfloat16, "cuda"
    gen = torch.Generator().manual_seed(0)

    def inputs():
        return {"x": torch.randn(n, hidden, generator=gen), "res": torch.randn(n, hidden, generator=gen),
                "qkv": torch.randn(n, (heads + 2 * kv_heads) * head_dim, generator=gen),
                "cos": torch.rand(n, head_dim, generator=gen), "sin": torch.rand(n, head_dim, generator=gen),
                "gate_up": torch.randn(n, 2 * inter, generator=gen),
                "index": torch.randperm(num_pages * page, generator=gen)[:n]}

    def to_dev(d):
        return {k: v.to(dev) if k == "index" else v.to(dev, dtype) for k, v in d.items()}

    weight = torch.randn(hidden, generator=gen).to(dev, dtype)
    k_pages = torch.zeros(num_pages, page, kv_heads, head_dim, dtype=dtype, device=dev)
    v_pages = torch.zeros_like(k_pages)

    def step(t, kp, vp):
        normed, h = kernels.add_rms_norm(t["x"], t["res"], weight, 1e-5)
        q = kernels.rotary_and_write_kv(t["qkv"], t["cos"], t["sin"], t["index"], kp, vp, heads, kv_heads,
                                        head_dim)
        return kernels.rms_norm(h, weight, 1e-5), normed, q, kernels.silu_mul(t["gate_up"])

    static = to_dev(inputs())
    step(static, k_pages, v_pages)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step(static, k_pages, v_pages)
    nxt = to_dev(inputs())
    for k, v in nxt.items():
        static[k].copy_(v)
    k_pages.zero_()
    v_pages.zero_()
    graph.replay()
    torch.cuda.synchronize()
    k_eager, v_eager = torch.zeros_like(k_pages), torch.zeros_like(v_pages)
    for got, want in zip(outs, step(nxt, k_eager, v_eager)):
        assert torch.equal(got, want)
    assert torch.equal(k_pages, k_eager) and torch.equal(v_pages, v_eager)
    assert k_pages.view(-1, kv_heads, head_dim)[nxt["index"]].abs().sum() > 0


@pytest.mark.gpu
@needs_triton
def test_cuda_engine_tokens_equal_torch_layers(tmp_path):
    """The tiny checkpoint (float32) on CUDA with graphed steps: the same greedy tokens with the
    fused kernels as without, n-gram drafts."""
    import fused_triton_cases as cases

    from tpspec.model.tiny import make_tiny_checkpoint

    ckpt = str(make_tiny_checkpoint(tmp_path / "tiny", seed=0))
    want = cases.engine_tokens("cuda", "float32", ckpt, False, gpu_memory_utilization=0.2)
    assert cases.engine_tokens("cuda", "float32", ckpt, True, gpu_memory_utilization=0.2) == want


@pytest.mark.gpu
@needs_triton
def test_cuda_llama_3_8b_layers_match_torch_layers():
    """Two layers of the Llama-3-8B shape in bfloat16 (vocabulary 4096, random weights of seed 0):
    prefill, verification, decode and a rewound step give the torch layers' logits (within 3e-2)."""
    import fused_triton_cases as cases
    from model_helpers import allocate_slots, mixed_scenario

    from tpspec.model import random_model, shape_config

    cfg = shape_config("llama-3-8b", num_layers=2, vocab_size=4096)
    logits = {}
    for on in (False, True):
        with cases.fused_switch(on):
            model = random_model(cfg, device="cuda", dtype=torch.bfloat16, seed=0)
        assert model.fused is on
        allocate_slots(model, 4)
        logits[on] = [t.float() for t in mixed_scenario(model)]
    for got, want in zip(logits[True], logits[False]):
        torch.testing.assert_close(got, want, atol=3e-2, rtol=3e-2)
