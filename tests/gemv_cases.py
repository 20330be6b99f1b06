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
    on CUDA the results also equal their bits on a repeat (a fixed reduction order; Triton's
    interpreter runs the programs one after another, so a repeat there could not differ)."""
    for n, k in shapes:
        for m in rows:
            for bias in (False, True):
                x, w, b = _tensors(m, n, k, dtype, device, bias)
                for splits in (None, 1, 3):
                    y = kernels.linear(x, w, b, splits=splits)
                    assert_close(y, x, w, b, f"{n}x{k} M={m} bias={bias} splits={splits}")
                    if device == "cuda":
                        assert torch.equal(y, kernels.linear(x, w, b, splits=splits))


def check_many_rows(device: str, dtype: torch.dtype, shapes=SMALL_SHAPES[2:4], rows=(40,)) -> None:
    """40 rows of ``x``, padded to 64 in the ``tl.dot``: as :func:`check_kernels` and
    :func:`check_norm_kernels`."""
    check_kernels(device, dtype, shapes, rows)
    check_norm_kernels(device, dtype, shapes, rows)


def check_silu_kernels(device: str, dtype: torch.dtype, shapes=SMALL_SHAPES, rows=ROWS) -> None:
    """SwiGLU's ``silu(gate) * up`` formed inside the GEMV (``silu_mul_linear``): the bits of the
    ``silu_mul`` kernel followed by ``linear``, at every shape and row count, the rule's splits and
    forced 1 and 3, a bias on every other shape (the bias is the epilogue :func:`check_kernels`
    covers at every shape); and within the GEMV's rounding of the float64 product of those inputs."""
    from tpspec.model import fused_triton

    for index, (n, k) in enumerate(shapes):
        bias = index % 2 == 1
        for m in rows:
            x, w, b = _tensors(m, n, 2 * k, dtype, device, bias, seed=7 * n + k)
            w = w[:, :k].contiguous()
            hidden = fused_triton.silu_mul(x)
            for splits in (None, 1, 3):
                what = f"silu {n}x{k} M={m} bias={bias} splits={splits}"
                y = kernels.silu_mul_linear(x, w, b, splits=splits)
                assert torch.equal(y, kernels.linear(hidden, w, b, splits=splits)), what
                assert_close(y, hidden, w, b, what)


def check_silu_out_kernels(device: str, dtype: torch.dtype, shapes=SMALL_SHAPES, rows=ROWS) -> None:
    """SwiGLU's ``silu(gate) * up`` formed as the gate/up projection stores its output
    (``linear_silu_mul``): the bits of ``linear`` followed by the ``silu_mul`` kernel, at every
    shape (as ``I`` features: ``W`` ``[2 I, K]``) and row count, the rule's splits and forced 1 and
    3, a bias on every other shape; an odd number of weight rows is refused."""
    from tpspec.model import fused_triton

    for index, (n, k) in enumerate(shapes):
        bias = index % 2 == 0
        for m in rows:
            x, w, b = _tensors(m, 2 * n, k, dtype, device, bias, seed=11 * n + k)
            for splits in (None, 1, 3):
                what = f"silu out {n}x{k} M={m} bias={bias} splits={splits}"
                y = kernels.linear_silu_mul(x, w, b, splits=splits)
                assert y.shape == (m, n) and y.dtype == dtype, (what, y.shape, y.dtype)
                assert torch.equal(y, fused_triton.silu_mul(kernels.linear(x, w, b, splits=splits))), what
    try:
        kernels.linear_silu_mul(x, w[1:], None)
    except ValueError as exc:
        assert "even number of rows" in str(exc), exc
    else:
        raise AssertionError("an odd number of gate/up rows was accepted")


def norm_reference(x, r, g, eps, w, b):
    """``(y, scale, h)`` in float64: the norm of ``h = x + r`` (rounded to the dtype, as torch
    adds) times ``g``, through ``W`` (and ``b``); ``scale`` bounds the accumulated magnitudes."""
    h = x if r is None else x + r
    h64 = h.double()
    rstd = torch.rsqrt((h64 * h64).mean(-1, keepdim=True) + eps)
    a = h64 * g.double()
    y = (a @ w.double().T) * rstd
    scale = (a.abs() @ w.double().abs().T) * rstd
    if b is not None:
        y, scale = y + b.double(), scale + b.double().abs()
    return y, scale, h


def check_norm_kernels(device: str, dtype: torch.dtype, shapes=SMALL_SHAPES, rows=(1, 3)) -> None:
    """The norm fused in front of the GEMV (``norm_linear``), one row and several: every shape
    without a residual, and with one with and without a bias, the rule's splits and forced 3: ``y``
    within its rounding of the float64 result (several rows: plus the rounding of ``h * g`` to the
    dtype before the product), ``h`` the bits of torch's ``x + residual`` (``x`` itself without
    one), and on CUDA the same bits on a repeat."""
    eps = 1e-5
    for n, k in shapes:
        for m in rows:
            for residual, bias in ((False, True), (True, False), (True, True)):
                x, w, b = _tensors(m, n, k, dtype, device, bias, seed=n + k)
                gen = torch.Generator(device=device).manual_seed(k)
                r = torch.randn(m, k, generator=gen, device=device).to(dtype) if residual else None
                g = (1 + 0.5 * torch.randn(k, generator=gen, device=device)).to(dtype)
                ref, scale, h_want = norm_reference(x, r, g, eps, w, b)
                inputs = _HALF_ULP[dtype] * 1.01 * scale if m > 1 else 0
                bound = _HALF_ULP[dtype] * ref.abs() * 1.01 + inputs + 1e-6 * scale + 1e-30
                for splits in (None, 3):
                    what = f"norm {n}x{k} M={m} residual={residual} bias={bias} splits={splits}"
                    y, h = kernels.norm_linear(x, r, g, eps, w, b, splits=splits)
                    err = (y.double() - ref).abs()
                    assert y.dtype == dtype and y.shape == (m, n), (what, y.dtype, y.shape)
                    assert bool((err <= bound).all()), f"{what}: worst excess {(err - bound).max().item():.3e}"
                    assert torch.equal(h, h_want), what
                    assert (h is x) == (r is None), what
                    if device == "cuda":
                        assert torch.equal(y, kernels.norm_linear(x, r, g, eps, w, b, splits=splits)[0]), what


def check_norm_silu_out_kernels(device: str, dtype: torch.dtype, shapes=SMALL_SHAPES, rows=(3, 16)) -> None:
    """The norm in front and ``silu(gate) * up`` stored (``norm_linear_silu_mul``): the bits of
    ``norm_linear`` followed by the ``silu_mul`` kernel, and its ``h``, at every shape (as ``I``
    features) and row count, with and without a residual and a bias, the rule's splits and forced
    1 and 3; one row and an odd number of weight rows are refused."""
    from tpspec.model import fused_triton

    eps = 1e-5
    for index, (n, k) in enumerate(shapes):
        for m in rows:
            for residual in (False, True):
                bias = (index + residual) % 2 == 0
                x, w, b = _tensors(m, 2 * n, k, dtype, device, bias, seed=13 * n + k)
                gen = torch.Generator(device=device).manual_seed(k + m)
                r = torch.randn(m, k, generator=gen, device=device).to(dtype) if residual else None
                g = (1 + 0.5 * torch.randn(k, generator=gen, device=device)).to(dtype)
                for splits in (None, 1, 3):
                    what = f"norm silu out {n}x{k} M={m} residual={residual} bias={bias} splits={splits}"
                    y, h = kernels.norm_linear_silu_mul(x, r, g, eps, w, b, splits=splits)
                    y_want, h_want = kernels.norm_linear(x, r, g, eps, w, b, splits=splits)
                    assert y.shape == (m, n) and y.dtype == dtype, (what, y.shape, y.dtype)
                    assert torch.equal(y, fused_triton.silu_mul(y_want)) and torch.equal(h, h_want), what
    for bad, message in (((x[:1], None, g, eps, w), "2 or more rows"), ((x, None, g, eps, w[1:]), "even number")):
        try:
            kernels.norm_linear_silu_mul(*bad)
        except ValueError as exc:
            assert message in str(exc), exc
        else:
            raise AssertionError(f"accepted: {message}")


def check_the_other_operand_order(device: str, dtype: torch.dtype, shapes=SMALL_SHAPES, rows=(16,)) -> None:
    """The ``tl.dot`` rows with the operand order that ``ROWS_WEIGHTS_LEFT`` does not choose (``x`` on
    the left, as it stands; the other checks run the chosen one): as :func:`check_kernels`,
    :func:`check_norm_kernels` and :func:`check_silu_kernels` at 16 rows, each within its rounding of
    the float64 result."""
    saved = kernels.ROWS_WEIGHTS_LEFT
    try:
        kernels.ROWS_WEIGHTS_LEFT = not saved
        assert kernels.plan_gemv(rows[0], 64, 64, device=device).w_left == (not saved)
        check_kernels(device, dtype, shapes, rows)
        check_norm_kernels(device, dtype, shapes, rows)
        check_silu_kernels(device, dtype, shapes[:2], rows)
        check_silu_out_kernels(device, dtype, shapes[:2], rows)
        check_norm_silu_out_kernels(device, dtype, shapes[:2], rows)
    finally:
        kernels.ROWS_WEIGHTS_LEFT = saved


class _CountingLaunches:
    """Stands in for a kernel in its module: counts the launches, runs the kernel."""

    def __init__(self, kernel) -> None:
        self.kernel, self.launches = kernel, 0

    def __getitem__(self, grid):
        self.launches += 1
        return self.kernel[grid]


def check_last_split_sums(device: str, dtype: torch.dtype, shapes=SMALL_SHAPES[2:], rows=(1, 16)) -> None:
    """Split launches whose last program sums the splits (``LAST_SPLIT_SUMS``): ``linear``,
    ``silu_mul_linear``, ``linear_silu_mul`` and (one row) ``norm_linear`` give the bits of the launches followed by the
    reduction kernel (one row and the ``tl.dot`` rows: the few-rows kernels always reduce by kernel),
    with forced 2 and 3 splits (and on CUDA the rule's), twice in a row (each
    launch leaves the counters at zero for the next), and no reduction kernel runs; with more
    feature blocks than counters the reduction kernel runs again, same bits."""
    from tpspec.model import split_counters

    saved = kernels.LAST_SPLIT_SUMS, split_counters.MAX_COUNTERS, kernels._reduce_kernel, kernels._norm_reduce_kernel
    reduce, norm_reduce = _CountingLaunches(saved[2]), _CountingLaunches(saved[3])
    kernels._reduce_kernel, kernels._norm_reduce_kernel = reduce, norm_reduce
    eps = 1e-5
    splits_tried = (2, 3) if device == "cpu" else (None, 2, 3)  # the interpreter's rule does not split these

    def calls(x, w, b, gate_up, w_down, r, g, splits):
        out = [kernels.linear(x, w, b, splits=splits), kernels.silu_mul_linear(gate_up, w_down, b, splits=splits),
               kernels.linear_silu_mul(x, torch.cat((w, w.flip(0))), b.repeat(2), splits=splits)]
        if x.shape[0] == 1:
            out += kernels.norm_linear(x, r, g, eps, w, b, splits=splits)
        return out

    try:
        for n, k in shapes:
            for m in rows:
                x, w, b = _tensors(m, n, k, dtype, device, True, seed=3 * n + k + m)
                gate_up, w_down, _ = _tensors(m, n, 2 * k, dtype, device, False, seed=5 * n + k + m)
                w_down = w_down[:, :k].contiguous()
                gen = torch.Generator(device=device).manual_seed(n + m)
                r = torch.randn(1, k, generator=gen, device=device).to(dtype)
                g = (1 + 0.5 * torch.randn(k, generator=gen, device=device)).to(dtype)
                for splits in splits_tried:
                    what = f"{n}x{k} M={m} splits={splits}"
                    kernels.LAST_SPLIT_SUMS = False
                    want = calls(x, w, b, gate_up, w_down, r, g, splits)
                    kernels.LAST_SPLIT_SUMS = True
                    launches = reduce.launches + norm_reduce.launches
                    for _ in range(2):
                        for got, expected in zip(calls(x, w, b, gate_up, w_down, r, g, splits), want):
                            assert torch.equal(got, expected), what
                    assert reduce.launches + norm_reduce.launches == launches, what
                    counts = split_counters._COUNTERS.get(x.device)
                    assert counts is None or not bool(counts.any()), what
        assert split_counters._COUNTERS.get(x.device) is not None  # some launch was split
        split_counters.MAX_COUNTERS = 1
        x, w, b = _tensors(1, 130, 1024, dtype, device, True)
        launches = reduce.launches
        kernels.LAST_SPLIT_SUMS = False
        want = kernels.linear(x, w, b, splits=3)
        kernels.LAST_SPLIT_SUMS = True
        assert torch.equal(kernels.linear(x, w, b, splits=3), want)
        assert reduce.launches == launches + 2
    finally:
        (kernels.LAST_SPLIT_SUMS, split_counters.MAX_COUNTERS, kernels._reduce_kernel,
         kernels._norm_reduce_kernel) = saved


def check_llm(device: str, dtype: torch.dtype) -> None:
    """The tiny model with its layers' fused kernels, greedy, two requests of different lengths (steps
    of two rows, then of one): the tokens with the switches on equal those of ``F.linear``, in two
    settings. "inside": the Triton GEMV runs the linears of up to ``MAX_ROWS`` rows (every linear
    from five rows on: ``ROWS_MIN_WIDENING`` 0) with the norms fused into q/k/v and gate/up and
    ``silu(gate) * up`` into down_proj, at one row and from five rows on (``FUSED_INPUT_ROWS``
    raised); every kernel ran at one row and at the prompts' seven rows, the GEMV at two rows too
    (the norm's linears, ``N > K``, take the GEMV at one row and from five rows on). "after": the
    norms outside from two rows on, and gate/up storing ``silu(gate) * up``
    (``TRITON_GATE_UP_SILU``), which ran at the prompts' seven rows. "both": the norm inside and
    ``silu(gate) * up`` stored by gate/up at seven rows."""
    from tpspec.mapping import Mapping
    from tpspec.model import layers as layers_mod
    from tpspec.model import linear as linear_mod
    from tpspec.model.tiny import make_tiny_checkpoint
    from tpspec.runtime.config import EngineConfig, Request
    from tpspec.runtime.engine import Engine
    from tpspec.sampling.params import SamplingParams

    names = ("linear", "norm_linear", "silu_mul_linear", "linear_silu_mul", "norm_linear_silu_mul")
    originals = {name: getattr(kernels, name) for name in names}
    rows_seen: dict[str, set[int]] = {}

    def counting(name):
        def run(*args, **kwargs):
            rows_seen[name].add(args[0].shape[0])
            return originals[name](*args, **kwargs)
        return run

    for name in names:
        setattr(kernels, name, counting(name))
    name = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}[dtype]
    greedy = SamplingParams(temperature=0.0)
    requests = [Request(0, (11, 12, 13, 14), greedy, 12), Request(1, (21, 22, 23), greedy, 4)]
    switches = ("TRITON_GEMV", "TRITON_SILU_DOWN", "TRITON_GEMV_ROWS", "FUSED_INPUT_ROWS", "ROWS_MIN_WIDENING",
                "TRITON_GATE_UP_SILU")
    settings = {"off": (False, False, 4, 1, 4, False),
                "inside": (True, True, kernels.MAX_ROWS, kernels.MAX_ROWS, 0, False),
                "after": (True, True, kernels.MAX_ROWS, 1, 0, True),
                "both": (True, True, kernels.MAX_ROWS, kernels.MAX_ROWS, 0, True)}
    saved = layers_mod.FUSED_UNDER_INTERPRETER, {switch: getattr(linear_mod, switch) for switch in switches}
    layers_mod.FUSED_UNDER_INTERPRETER = True
    tokens, seen = {}, {}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            ckpt = str(make_tiny_checkpoint(f"{tmp}/tiny", seed=0))
            for setting, values in settings.items():
                for switch, value in zip(switches, values):
                    setattr(linear_mod, switch, value)
                rows_seen.update({name: set() for name in names})
                engine = Engine(EngineConfig(ckpt, 1, device, name, max_batch_size=4, use_cuda_graphs=device == "cuda",
                                             gpu_memory_utilization=0.2 if device == "cuda" else None), Mapping(), device)
                try:
                    tokens[setting] = [r.token_ids for r in engine.generate(requests)]
                finally:
                    engine.close()
                seen[setting] = {name: set(rows) for name, rows in rows_seen.items()}
    finally:
        layers_mod.FUSED_UNDER_INTERPRETER = saved[0]
        for switch, value in saved[1].items():
            setattr(linear_mod, switch, value)
        for name, fn in originals.items():
            setattr(kernels, name, fn)
    assert not any(seen["off"].values()), f"a kernel ran with the switch off: {seen['off']}"
    # q/k/v and gate/up (N > K) take the GEMV, with their norm inside, at one row and at five rows or
    # more (the prompts' seven), not at two to four (the rule of use_triton_linear); o_proj, down_proj and
    # the LM head at two rows too.
    few = set(range(2, kernels.FEW_ROWS + 1))
    inside = seen["inside"]
    assert all(1 in inside[name] for name in names[:3]) and 7 in inside["norm_linear"], inside
    assert not inside["norm_linear"] & few and inside["linear"] & few, inside
    assert not inside["linear_silu_mul"] and not inside["norm_linear_silu_mul"], inside
    assert max(inside["silu_mul_linear"]) > kernels.FEW_ROWS, inside
    after = seen["after"]
    assert after["linear_silu_mul"] == {7} and after["norm_linear"] == after["silu_mul_linear"] == {1}, after
    assert not after["norm_linear_silu_mul"], after
    both = seen["both"]
    assert both["norm_linear_silu_mul"] == {7} and both["norm_linear"] == {1, 7} and not both["linear_silu_mul"], both
    assert all(tokens[setting] == tokens["off"] for setting in settings), tokens


CHECKS = {"kernels": [check_kernels, check_norm_kernels, check_silu_kernels, check_silu_out_kernels,
                      check_norm_silu_out_kernels],
          "rows_and_splits": [check_many_rows, check_last_split_sums, check_the_other_operand_order], "llm": [check_llm]}


if __name__ == "__main__":
    interpreted_main(CHECKS, kernels)
