"""Checks of the fused layer kernels (``tpspec.model.fused_triton``), run on CUDA tensors (GPU
tests) or on CPU tensors under Triton's interpreter (``python tests/fused_triton_cases.py
kernels|model|engine DTYPE...`` with ``TRITON_INTERPRET=1`` set before Triton is imported; each
check prints ``<name> <dtype>: ok``).

References are the torch layers themselves (``RMSNorm``, ``apply_rotary`` + ``KVPages.write``,
``F.silu(gate) * up``). Tolerances: the residual add, rotary and the KV rows are compared bit for
bit (each output is one rounding of a sum of two products, as in torch). The norm's sum of
squares (up to 16384 terms) is reduced in another order and ``rsqrt`` may differ by an ulp, so
its float32 statistic can differ by a few ulps: :func:`tolerance` allows 8 machine epsilons
(relative and absolute) in float32 and 2 in float16 / bfloat16 (where that difference shows only
as a rounding flipped in the normalized value or the weight product). ``silu`` calls another ``exp`` (numpy's under the
interpreter, libdevice's on CUDA): the same tolerance.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from interpreted import interpreted_main
from tpspec.model import fused_triton as kernels
from tpspec.model import layers
from tpspec.model.kv_cache import KVPages
from tpspec.model.layers import RMSNorm, apply_rotary

# (hidden, intermediate, heads, KV heads, head_dim): the CPU sizes stay small for the interpreter
# (a hidden size and a head size that are not powers of two among them); CUDA adds Llama-3-8B's.
CPU_SHAPES = [(96, 80, 4, 2, 16), (160, 1100, 5, 1, 40)]
CUDA_SHAPES = CPU_SHAPES + [(4096, 14336, 32, 8, 128), (16384, 1024, 8, 8, 64)]


def tolerance(dtype: torch.dtype) -> float:
    """rtol = atol of the norm and silu checks: 8 machine epsilons in float32, 2 in float16 and bfloat16."""
    return (8 if dtype == torch.float32 else 2) * torch.finfo(dtype).eps


@contextlib.contextmanager
def fused_switch(on: bool):
    """``FUSED_CUDA_KERNELS`` and ``FUSED_UNDER_INTERPRETER`` set to ``on`` while models are built
    (they are read at construction)."""
    old = layers.FUSED_CUDA_KERNELS, layers.FUSED_UNDER_INTERPRETER
    layers.FUSED_CUDA_KERNELS = layers.FUSED_UNDER_INTERPRETER = on
    try:
        yield
    finally:
        layers.FUSED_CUDA_KERNELS, layers.FUSED_UNDER_INTERPRETER = old


def _randn(gen: torch.Generator, *shape: int, device: str, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen) * scale).to(device, dtype)


def check_norm(device: str, dtype: torch.dtype, shapes=None) -> None:
    gen = torch.Generator().manual_seed(0)
    for hidden, *_ in shapes or (CUDA_SHAPES if device == "cuda" else CPU_SHAPES):
        norm = RMSNorm("w", hidden, 1e-5, dtype=dtype, device=device)
        norm.weight.copy_(_randn(gen, hidden, device=device, dtype=dtype))
        x = _randn(gen, 7, hidden, device=device, dtype=dtype, scale=3.0)
        res = _randn(gen, 7, hidden, device=device, dtype=dtype, scale=3.0)
        x_before, res_before = x.clone(), res.clone()
        normed, h = kernels.add_rms_norm(x, res, norm.weight, norm.eps)
        assert torch.equal(h, res + x), "the residual sum must be torch's bit for bit"
        assert torch.equal(x, x_before) and torch.equal(res, res_before), "inputs must stay untouched"
        tol = tolerance(dtype)
        torch.testing.assert_close(normed, norm(res + x), rtol=tol, atol=tol)
        torch.testing.assert_close(kernels.rms_norm(x, norm.weight, norm.eps), norm(x), rtol=tol, atol=tol)
        strided = torch.cat([x, x], dim=1)[:, :hidden]  # rows with a stride: the kernel reads them in place
        torch.testing.assert_close(kernels.rms_norm(strided, norm.weight, norm.eps), norm(x), rtol=tol, atol=tol)
        assert kernels.rms_norm(x[:0], norm.weight, norm.eps).shape == (0, hidden)


def check_rotary(device: str, dtype: torch.dtype, shapes=None) -> None:
    gen = torch.Generator().manual_seed(1)
    for _, _, heads, kv_heads, head_dim in shapes or (CUDA_SHAPES if device == "cuda" else CPU_SHAPES):
        n, num_pages, page = 6, 5, 4
        qkv = _randn(gen, n, (heads + 2 * kv_heads) * head_dim, device=device, dtype=dtype, scale=2.0)
        angles = torch.rand(n, head_dim // 2, generator=gen) * 100.0
        emb = torch.cat((angles, angles), dim=-1)
        cos, sin = emb.cos().to(device, dtype), emb.sin().to(device, dtype)
        write_index = torch.tensor([9, 0, 19, 4, 13, 10], device=device)  # scattered over pages, one page's last row
        got = KVPages(num_pages, page, kv_heads, head_dim, dtype=dtype, device=device)
        got.k.copy_(_randn(gen, *got.k.shape, device=device, dtype=dtype))
        got.v.copy_(_randn(gen, *got.v.shape, device=device, dtype=dtype))
        want = KVPages(num_pages, page, kv_heads, head_dim, dtype=dtype, device=device)
        want.k.copy_(got.k)
        want.v.copy_(got.v)
        q = kernels.rotary_and_write_kv(qkv, cos, sin, write_index, got.k, got.v, heads, kv_heads, head_dim)
        tq, tk, tv = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
        want_q = apply_rotary(tq.view(n, heads, head_dim), cos, sin)
        want.write(write_index, apply_rotary(tk.view(n, kv_heads, head_dim), cos, sin),
                   tv.reshape(n, kv_heads, head_dim))
        assert q.is_contiguous() and q.shape == (n, heads, head_dim)
        assert torch.equal(q, want_q), "q must be apply_rotary's bit for bit"
        assert torch.equal(got.k, want.k) and torch.equal(got.v, want.v), "the pages must be KVPages.write's"
        # A row outside the pages is skipped (never written out of bounds); the others are written.
        before_k, before_v = got.k.clone(), got.v.clone()
        rows = [3, 7, 11, 15]
        outside = torch.tensor([-1, num_pages * page, *rows], device=device)
        kernels.rotary_and_write_kv(qkv, cos, sin, outside, got.k, got.v, heads, kv_heads, head_dim)
        flat_k, flat_v = got.k.view(-1, kv_heads, head_dim), got.v.view(-1, kv_heads, head_dim)
        want_k = apply_rotary(tk.view(n, kv_heads, head_dim), cos, sin)
        assert torch.equal(flat_k[rows], want_k[2:])
        assert torch.equal(flat_v[rows], tv.reshape(n, kv_heads, head_dim)[2:])
        kept = torch.ones(num_pages * page, dtype=torch.bool, device=device)
        kept[rows] = False
        assert torch.equal(flat_k[kept], before_k.view(-1, kv_heads, head_dim)[kept])
        assert torch.equal(flat_v[kept], before_v.view(-1, kv_heads, head_dim)[kept])


def check_cos_sin(device: str, dtype: torch.dtype, shapes=None) -> None:
    """``rotary_cos_sin`` against ``RotaryEmbedding``'s torch ops: bit for bit on CUDA (CUDA's
    ``cosf``/``sinf`` both ways) at Llama 3.1's frequencies, positions up to 131071; under the
    interpreter (numpy's ``cos``/``sin``) within one rounding of the dtype. The rotary of a fused
    model with the kernel switched on is the torch ops' too."""
    import dataclasses

    from tpspec.model.layers import RotaryEmbedding
    from tpspec.model.shapes import shape_config

    cfg = shape_config("llama-3-8b")
    if device != "cuda":
        cfg = dataclasses.replace(cfg, head_dim=40)  # 20 frequencies: a padded half
    plain = RotaryEmbedding(cfg, device=device)
    limit = 131072 if device == "cuda" else 5000
    positions = torch.cat([torch.arange(0, limit, 1 if device == "cuda" else 7), torch.tensor([limit - 1])]).to(device)
    want = plain(positions, dtype)
    got = kernels.rotary_cos_sin(positions, plain.inv_freq, dtype)
    for g, w, name in zip(got, want, ("cos", "sin")):
        assert g.shape == w.shape and g.dtype == dtype
        if device == "cuda":
            assert torch.equal(g, w), f"{name} must be the torch ops' bit for bit"
        else:
            eps = torch.finfo(dtype).eps
            assert torch.allclose(g.float(), w.float(), rtol=eps, atol=eps), name
    fused = RotaryEmbedding(cfg, device=device, fused=True)
    with _switched_on("ROTARY_KERNEL", "rotary_cos_sin") as calls:
        again = fused(positions, dtype)
    assert calls == [1] and all(torch.equal(a, g) for a, g in zip(again, got))


@contextlib.contextmanager
def _switched_on(switch: str, kernel: str):
    """``layers.<switch>`` on and ``kernels.<kernel>`` counted: yields the list its calls are appended to."""
    calls: list[int] = []
    saved, real = getattr(layers, switch), getattr(kernels, kernel)
    setattr(layers, switch, True)
    setattr(kernels, kernel, lambda *a: calls.append(1) or real(*a))
    try:
        yield calls
    finally:
        setattr(layers, switch, saved)
        setattr(kernels, kernel, real)


def check_embed(device: str, dtype: torch.dtype, shapes=None) -> None:
    """``embed`` against ``VocabParallelEmbedding``'s torch ops, bit for bit: the whole table
    (TP 1) and a padded last slice (TP 3's third rank), ids inside, outside and negative (zeros);
    a fused embedding with the kernel switched on runs it, to the same rows."""
    from tpspec.model.layers import VocabParallelEmbedding

    gen = torch.Generator().manual_seed(5)
    for hidden, *_ in shapes or (CUDA_SHAPES if device == "cuda" else CPU_SHAPES):
        for vocab, tp, rank in ((1000, 1, 0), (1000, 3, 2)):
            kw = dict(dtype=dtype, device=device)
            plain = VocabParallelEmbedding("w", vocab, hidden, tp, rank, None, **kw)
            plain.weight.copy_(_randn(gen, *plain.weight.shape, device=device, dtype=dtype))
            ids = torch.tensor([0, 999, 668, 667, 5, 1000, -1, 700, 2**40], device=device)
            want = plain(ids)
            got = kernels.embed(ids, plain.weight, plain.offset, plain.real_width)
            assert torch.equal(got, want), f"embed {dtype} {hidden} tp {tp}"
            fused = VocabParallelEmbedding("w", vocab, hidden, tp, rank, None, fused=True, **kw)
            fused.weight.copy_(plain.weight)
            with _switched_on("EMBED_KERNEL", "embed") as calls:
                assert torch.equal(fused(ids), want) and calls == [1]


def check_silu_mul(device: str, dtype: torch.dtype, shapes=None) -> None:
    gen = torch.Generator().manual_seed(2)
    for _, inter, *_ in shapes or (CUDA_SHAPES if device == "cuda" else CPU_SHAPES):
        gate_up = _randn(gen, 5, 2 * inter, device=device, dtype=dtype, scale=4.0)
        gate, up = gate_up.chunk(2, dim=-1)
        tol = tolerance(dtype)
        torch.testing.assert_close(kernels.silu_mul(gate_up), F.silu(gate) * up, rtol=tol, atol=tol)


def check_errors(device: str, dtype: torch.dtype) -> None:
    """Shapes that do not fit are a ValueError before any launch."""
    x = torch.zeros(2, 8, device=device, dtype=dtype)
    for call in (lambda: kernels.rms_norm(x, torch.ones(7, device=device, dtype=dtype), 1e-5),
                 lambda: kernels.add_rms_norm(x, x[:, :4], torch.ones(8, device=device, dtype=dtype), 1e-5),
                 lambda: kernels.silu_mul(torch.zeros(2, 7, device=device, dtype=dtype)),
                 lambda: kernels.rotary_and_write_kv(x, x, x, torch.zeros(2, dtype=torch.int64, device=device),
                                                     torch.zeros(1, 4, 1, 8, device=device, dtype=dtype),
                                                     torch.zeros(1, 4, 1, 8, device=device, dtype=dtype), 1, 1, 8)):
        try:
            call()
        except ValueError:
            continue
        raise AssertionError("expected a ValueError")


def check_model(device: str, dtype: torch.dtype) -> None:
    """A small random model (GQA group 4; prefill, verification, decode and a rewound step) with
    the fused kernels gives the torch layers' logits (float32: to 1e-4) and greedy tokens."""
    from model_helpers import allocate_slots, greedy_generate, mixed_scenario

    from tpspec.model import ModelConfig, random_model
    from tpspec.model.tiny import tiny_config_dict

    cfg = ModelConfig.from_dict(tiny_config_dict(hidden_size=64, intermediate_size=96, num_heads=4, num_kv_heads=1))
    out = {}
    for on in (False, True):
        with fused_switch(on):
            model = random_model(cfg, device=device, dtype=dtype, seed=3)
        assert model.fused is on and model.layers[0].self_attn.fused is on
        allocate_slots(model, 4)
        logits = mixed_scenario(model)
        tokens = greedy_generate(model, [[5, 6, 7], [100, 3]], 6, slots=[2, 3])
        out[on] = logits, tokens
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    for got, want in zip(out[True][0], out[False][0]):
        torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
    if dtype == torch.float32:
        assert out[True][1] == out[False][1], out


def _small_config():
    from tpspec.model import ModelConfig
    from tpspec.model.tiny import tiny_config_dict

    return ModelConfig.from_dict(tiny_config_dict(hidden_size=64, intermediate_size=96, num_heads=4, num_kv_heads=2))


def _tp_rank(rank: int, world: int, fused: bool, adp: bool):
    """One rank of a TP-2 (or attention-DP) small random model: mixed-step logits and greedy tokens."""
    from model_helpers import allocate_slots, greedy_generate, mixed_scenario

    from tpspec.mapping import Mapping
    from tpspec.model import random_model

    with fused_switch(fused):
        model = random_model(_small_config(), Mapping(world, rank, enable_attention_dp=adp), dtype=torch.float32,
                             seed=3)
    assert model.fused is fused
    allocate_slots(model, 4)
    logits = mixed_scenario(model)
    return logits, greedy_generate(model, [[5, 6, 7], [100, 3]], 6, slots=[2, 3])


def check_tp(device: str, dtype: torch.dtype) -> None:
    """TP 2 and attention DP (gloo ranks, each setting the switch itself): the fused kernels give
    the torch layers' logits (to 1e-4) and greedy tokens."""
    from tpspec.testing import run_ranks

    for adp in (False, True):  # random weights are drawn per rank: each rank against its own torch run
        want = run_ranks(_tp_rank, 2, False, adp, timeout_s=120)
        for (logits, tokens), (want_logits, want_tokens) in zip(run_ranks(_tp_rank, 2, True, adp, timeout_s=120), want):
            assert tokens == want_tokens, (adp, tokens, want_tokens)
            for got, ref in zip(logits, want_logits):
                torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


def eagle3_drafts(device: str, target_dir: str, head_dir: str, fused: bool) -> tuple[list[list[int]], torch.Tensor]:
    """Prefill three prompts through the tiny target, then 3 chained EAGLE-3 drafts per prompt:
    ``(drafts, the head's last outputs)``."""
    from tpspec.model import ForwardBatch, load_model
    from tpspec.model.eagle3 import Eagle3Drafter

    prompts = [[5, 6, 7, 8, 9, 10, 5, 6, 7], [100, 200, 300, 5, 6, 7, 8], [42, 43]]
    with fused_switch(fused):
        model = load_model(target_dir, device=device)
        head = Eagle3Drafter(head_dir, model)
    assert model.fused is fused and head.fused is fused and head.self_attn.fused is fused
    model.allocate_kv_cache(8 * len(prompts), 8)
    head.allocate_kv_cache(8 * len(prompts), 8)
    slots = [list(range(8 * i, 8 * i + 8)) for i in range(len(prompts))]
    model(ForwardBatch(torch.tensor([t for p in prompts for t in p]),
                       torch.tensor([i for p in prompts for i in range(len(p))]),
                       slots, [0] * len(prompts), [len(p) for p in prompts]))
    keep = torch.cat([torch.arange(len(p) - 1) + sum(len(q) for q in prompts[:i]) for i, p in enumerate(prompts)])
    batch = ForwardBatch(torch.tensor([t for p in prompts for t in p[1:]]),
                         torch.tensor([i for p in prompts for i in range(len(p) - 1)]), slots, [0] * len(prompts),
                         [len(p) - 1 for p in prompts])
    cur, out = head.greedy_drafts(batch, model.aux_hidden_states.index_select(0, keep.to(device)))
    drafts = [cur]
    for j in range(1, 3):
        at = [len(p) - 2 + j for p in prompts]
        cur, out = head.greedy_drafts(ForwardBatch(cur.cpu(), torch.tensor(at), slots, at, [1] * len(prompts)), out)
        drafts.append(cur)
    return torch.stack(drafts, 1).tolist(), out


def check_eagle3(device: str, dtype: torch.dtype) -> None:
    """The tiny target with its tiny EAGLE-3 head: the same drafts with the fused kernels as
    without (float32), the head's outputs within 1e-4."""
    import tempfile

    from tpspec.model.tiny import make_tiny_checkpoint, make_tiny_eagle3_head

    with tempfile.TemporaryDirectory() as tmp:
        target = make_tiny_checkpoint(f"{tmp}/tiny", seed=0)
        head = make_tiny_eagle3_head(f"{tmp}/head", target, seed=1)
        want, want_out = eagle3_drafts(device, str(target), str(head), False)
        got, got_out = eagle3_drafts(device, str(target), str(head), True)
    assert got == want, (got, want)
    torch.testing.assert_close(got_out, want_out, rtol=1e-4, atol=1e-4)


def engine_tokens(device: str, dtype: str, ckpt: str, fused: bool, **options) -> list[list[int]]:
    """Greedy tokens of the tiny checkpoint's engine (n-gram drafts: prefill, verification and
    decode steps), with the fused kernels on or off."""
    from tpspec.mapping import Mapping
    from tpspec.runtime.config import EngineConfig, Request, SpeculativeConfig
    from tpspec.runtime.engine import Engine
    from tpspec.sampling.params import SamplingParams

    prompts = [[5, 6, 7, 8, 9, 10, 5, 6, 7], [100, 200, 300, 5, 6, 7], [42] * 12, [7]]
    requests = [Request(i, tuple(p), SamplingParams(temperature=0.0), 8) for i, p in enumerate(prompts)]
    with fused_switch(fused):
        engine = Engine(EngineConfig(ckpt, 1, device, dtype, speculative=SpeculativeConfig("ngram", 3),
                                     max_batch_size=4, **options), Mapping(), device)
    try:
        assert engine.model.fused is fused
        return [list(r.token_ids) for r in engine.generate(requests)]
    finally:
        engine.close()


def check_engine(device: str, dtype: torch.dtype) -> None:
    """The tiny checkpoint's engine: the same greedy tokens with the fused kernels as without."""
    import tempfile

    from tpspec.model.tiny import make_tiny_checkpoint

    name = str(dtype).removeprefix("torch.")
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = str(make_tiny_checkpoint(f"{tmp}/tiny", seed=0))
        torch_tokens = engine_tokens(device, name, ckpt, False)
        assert engine_tokens(device, name, ckpt, True) == torch_tokens


CHECKS = {"kernels": [check_norm, check_rotary, check_cos_sin, check_embed, check_silu_mul, check_errors],
          "model": [check_model, check_eagle3],
          "tp": [check_tp],
          "engine": [check_engine]}


if __name__ == "__main__":
    interpreted_main(CHECKS, kernels)
