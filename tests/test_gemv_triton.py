"""The Triton GEMV (:mod:`tpspec.model.gemv_triton`) and the rule that sends linears to it
(:mod:`tpspec.model.linear`).

On CPU through Triton's interpreter (a subprocess sets ``TRITON_INTERPRET=1`` before Triton is
imported; skipped without ``triton``): the kernel against float64 ``x @ W.T`` in float32 and
float16 (the interpreter's ``tl.dot`` does not handle bfloat16) at small shapes (N not a multiple
of the block, a K tail, one and several K splits), M = 1, 3, 16, bias on and off; and the tiny
model's greedy tokens with the switch on equal those of ``F.linear``. The dispatch rule is pure
logic, checked here without a kernel. On CUDA (``gpu`` marks): bfloat16, float16 and float32 at
the Llama-3-8B shapes for M = 1, 8, 16, and a CUDA-graph replay equal to an eager call.
"""

from __future__ import annotations

import pytest
import torch

from interpreted import needs_triton, run_interpreted
from tpspec.model import linear as linear_mod


# Llama-3-8B at TP 1: qkv, o_proj, gate_up, down_proj, the LM head.
LLAMA_3_8B = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
              "lm_head": (128256, 4096)}


def _interpret(group: str, *dtypes: str) -> None:
    run_interpreted("gemv_cases.py", [group], dtypes)


@needs_triton
def test_interpreted_kernel_matches_the_float64_reference():
    _interpret("kernels", "float32", "float16")


@needs_triton
def test_interpreted_tiny_model_tokens_equal_f_linear():
    _interpret("llm", "float32")


class _Kernels:
    INTERPRETED = False


def test_dispatch_rule(monkeypatch):
    """Off by default; with the switch on, only decode-sized, aligned, same-dtype calls on a
    device the kernels run on (CUDA compiled, CPU interpreted) go to the kernel."""
    assert linear_mod.TRITON_GEMV is False  # not ahead of cuBLAS (see TRITON_GEMV)
    use = linear_mod.use_triton_linear
    x, w, b = torch.zeros(4, 64), torch.zeros(32, 64), torch.zeros(32)
    assert not use(x, w, b)
    monkeypatch.setattr(linear_mod, "TRITON_GEMV", True)
    kernels = _Kernels()
    monkeypatch.setattr(linear_mod, "gemv_kernels", lambda: kernels)
    assert not use(x, w, b)  # CPU without the interpreter
    kernels.INTERPRETED = True
    assert use(x, w, b) and use(x, w) and use(x[:1], w) and use(torch.zeros(16, 64), w)
    assert use(x.half(), w.half(), b.half())
    assert not use(x.bfloat16(), w.bfloat16())  # the interpreter's tl.dot has no bfloat16
    assert not use(torch.zeros(17, 64), w)  # more rows than a decode batch: cuBLAS
    assert not use(torch.zeros(0, 64), w)
    assert not use(torch.zeros(4, 60), torch.zeros(32, 60))  # K not a multiple of 8
    assert not use(x, torch.zeros(64, 32).t())  # not contiguous
    assert not use(torch.zeros(4, 65)[:, 1:], torch.zeros(32, 65)[:, 1:])  # not contiguous
    assert not use(x, torch.zeros(32 * 64 + 1)[1:].view(32, 64))  # not 16-byte aligned
    assert not use(x.half(), w)  # mixed dtypes
    assert not use(x, w, b.half())
    assert not use(x.double(), w.double())
    assert not use(x[None], w)
    assert not use(x.requires_grad_(), w)
    with torch.no_grad():
        assert use(x, w)
    monkeypatch.setattr(linear_mod, "gemv_kernels", lambda: None)  # no triton
    assert not use(x.detach(), w)
    if torch.cuda.is_available():
        monkeypatch.setattr(linear_mod, "gemv_kernels", lambda: kernels)
        xc, wc = x.detach().cuda(), w.cuda()
        kernels.INTERPRETED = True
        assert not use(xc, wc)  # the interpreter runs CPU tensors only
        kernels.INTERPRETED = False
        assert use(xc, wc) and use(xc.bfloat16(), wc.bfloat16()) and not use(x.detach(), w) and not use(xc, w)


def test_linear_is_f_linear_with_the_switch_off():
    gen = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(3, 16, generator=gen), torch.randn(8, 16, generator=gen), torch.randn(8, generator=gen)
    assert torch.equal(linear_mod.linear(x, w, b), torch.nn.functional.linear(x, w, b))


# ---------------------------------------------------------------------------------------- GPU

@pytest.mark.gpu
@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_cuda_kernel_matches_the_float64_reference(dtype):
    import gemv_cases as cases

    cases.check_kernels("cuda", dtype)
    cases.check_kernels("cuda", dtype, shapes=list(LLAMA_3_8B.values()), rows=(1, 8, 16))


@pytest.mark.gpu
@needs_triton
@pytest.mark.parametrize("m", [1, 8])
def test_cuda_graph_replay_equals_eager(m):
    """Every Llama-3-8B linear (split-K ones included) with and without a bias, captured in one
    CUDA graph, replayed on new inputs copied in, gives the bits of eager calls on those inputs."""
    from tpspec.model import gemv_triton as kernels

    gen = torch.Generator(device="cuda").manual_seed(0)
    dtype = torch.bfloat16
    cases = []
    for n, k in LLAMA_3_8B.values():
        w = torch.randn(n, k, generator=gen, device="cuda").to(dtype)
        b = torch.randn(n, generator=gen, device="cuda").to(dtype)
        cases.append((torch.randn(m, k, generator=gen, device="cuda").to(dtype), w, b))
    assert any(kernels.plan_gemv(m, n, k, device="cuda").splits > 1 for n, k in LLAMA_3_8B.values())

    def forward():
        return [kernels.linear(x, w, bias) for x, w, b in cases for bias in (None, b)]

    forward()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = forward()
    for x, _, _ in cases:
        x.copy_(torch.randn(x.shape, generator=gen, device="cuda").to(dtype))
    graph.replay()
    torch.cuda.synchronize()
    for got, want in zip(outs, forward()):
        assert torch.equal(got, want)


@pytest.mark.gpu
@needs_triton
def test_cuda_tiny_model_tokens_equal_f_linear():
    """The tiny model (float32) on CUDA with graphed steps: the same greedy tokens with the switch
    on as with ``F.linear``, the kernel having run."""
    import gemv_cases as cases

    cases.check_llm("cuda", torch.float32)
