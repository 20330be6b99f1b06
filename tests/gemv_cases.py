"""Checks of the Triton GEMV (``tpspec.model.gemv_triton``), run on CUDA tensors (GPU tests) or
on CPU tensors under Triton's interpreter (``python tests/gemv_cases.py kernels|llm DTYPE...`` with
``TRITON_INTERPRET=1`` set before Triton is imported; each check prints ``<name> <dtype>: ok``).

The kernel's outputs are compared with ``x @ W.T (+ b)`` in float64: every output may differ by
half a unit in the last place of its dtype (the one rounding) plus a float32 accumulation bound.
"""

from __future__ import annotations

import tempfile

import torch

from interpreted import interpreted_main
from tpspec.model import gemv_triton as kernels

# (N, K): N a multiple of the blocks and not, K one tile and several, a K tail, split-K forced.
SMALL_SHAPES = [(40, 64), (64, 512), (33, 520), (130, 1024)]
ROWS = (1, 3, 16)
_HALF_ULP = {torch.float32: 0.0, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}


def reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    ref = x.double() @ w.double().T
    return ref if b is None else ref + b.double()


def assert_close(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, what: str) -> None:
    """``y`` within its dtype's output rounding (and float32 accumulation) of the float64 result."""
    ref = reference(x, w, b)
    scale = x.double().abs() @ w.double().abs().T + (0 if b is None else b.double().abs())
    bound = _HALF_ULP[y.dtype] * ref.abs() * 1.01 + 1e-6 * scale + 1e-30
    err = (y.double() - ref).abs()
    assert y.dtype == x.dtype and y.shape == ref.shape, (what, y.dtype, y.shape)
    assert bool((err <= bound).all()), f"{what}: error {err.max().item():.3e}, worst excess " \
                                       f"{(err - bound).max().item():.3e}"


def _tensors(m: int, n: int, k: int, dtype: torch.dtype, device: str, bias: bool, seed: int = 0):
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(m, k, generator=gen, device=device).to(dtype)
    w = (torch.randn(n, k, generator=gen, device=device) / k**0.5).to(dtype)
    b = torch.randn(n, generator=gen, device=device).to(dtype) if bias else None
    return x, w, b


def check_kernels(device: str, dtype: torch.dtype, shapes=SMALL_SHAPES, rows=ROWS) -> None:
    """Every shape x rows x bias on/off, with the launch rule's splits and forced 1 and 3 splits;
    the split results also equal one another's bits on a repeat (a fixed reduction order)."""
    for n, k in shapes:
        for m in rows:
            for bias in (False, True):
                x, w, b = _tensors(m, n, k, dtype, device, bias)
                for splits in (None, 1, 3):
                    y = kernels.linear(x, w, b, splits=splits)
                    assert_close(y, x, w, b, f"{n}x{k} M={m} bias={bias} splits={splits}")
                    assert torch.equal(y, kernels.linear(x, w, b, splits=splits))


def check_llm(device: str, dtype: torch.dtype) -> None:
    """The tiny model, greedy, with n-gram drafts (prefill, verification and decode steps): the
    tokens with the switch on (the Triton GEMV running every small linear and the LM head) equal
    those of ``F.linear``."""
    from tpspec.mapping import Mapping
    from tpspec.model import linear as linear_mod
    from tpspec.model.tiny import make_tiny_checkpoint
    from tpspec.runtime.config import EngineConfig, Request, SpeculativeConfig
    from tpspec.runtime.engine import Engine
    from tpspec.sampling.params import SamplingParams

    calls = []
    run_kernel = kernels.linear

    def counted(*args, **kwargs):
        calls.append(args[1].shape)
        return run_kernel(*args, **kwargs)

    kernels.linear = counted
    name = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}[dtype]
    prompts = [[5, 6, 7, 8, 9, 10, 5, 6, 7], [100, 200, 300, 5, 6, 7], [7]]
    requests = [Request(i, tuple(p), SamplingParams(temperature=0.0), 10) for i, p in enumerate(prompts)]
    tokens = {}
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = str(make_tiny_checkpoint(f"{tmp}/tiny", seed=0))
        for on in (False, True):
            linear_mod.TRITON_GEMV = on
            engine = Engine(EngineConfig(ckpt, 1, device, name, speculative=SpeculativeConfig("ngram", 3),
                                         max_batch_size=4, use_cuda_graphs=device == "cuda",
                                         gpu_memory_utilization=0.2 if device == "cuda" else None), Mapping(), device)
            try:
                tokens[on] = [r.token_ids for r in engine.generate(requests)]
            finally:
                engine.close()
            if not on:
                assert not calls, "the kernel ran with the switch off"
    linear_mod.TRITON_GEMV = False
    kernels.linear = run_kernel
    assert calls, "the switch on never reached the kernel"
    assert tokens[True] == tokens[False], tokens


CHECKS = {"kernels": [check_kernels], "llm": [check_llm]}


if __name__ == "__main__":
    interpreted_main(CHECKS, kernels)
