"""Checks of deterministic mode's layer kernels (``tpspec.model.deterministic_cuda``: the segment
sums' tree, the norm, ``silu * up``), run on CUDA tensors (GPU tests) or on CPU tensors under
Triton's interpreter (``python tests/det_layer_kernels_cases.py kernels DTYPE...`` with
``TRITON_INTERPRET=1`` set before Triton is imported; each check prints ``<name> <dtype>: ok``).

Each kernel is compared bit for bit with the torch functions of ``tpspec.model.deterministic`` it
replaces. On CUDA torch divides by a Python number as a multiplication by its float32 reciprocal,
and so does the norm kernel; on CPU the reference makes that multiplication explicit and rounds a
float64 square root (torch's vectorized CPU one can be an ulp off the correctly rounded value that
CUDA and the kernel compute).
"""

from __future__ import annotations

import torch

from interpreted import interpreted_main
from tpspec.model import deterministic as det
from tpspec.model import deterministic_cuda as kernels


def _same(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    assert a.shape == b.shape and a.dtype == b.dtype, (what, a.shape, b.shape, a.dtype, b.dtype)
    same = (a == b) | (torch.isnan(a) & torch.isnan(b))
    if not bool(same.all()):
        raise AssertionError(f"{what}: differs at {(~same).nonzero()[:5].tolist()}")
    if a.is_floating_point():  # +0.0 and -0.0 compare equal: compare the sign bits too
        assert torch.equal(torch.signbit(a), torch.signbit(b)), f"{what}: signs of zeros differ"


def _sizes(device: str) -> tuple[list[int], list[int]]:
    """Norm widths and ``silu`` widths: powers of two and not (padded leaves); Llama 3 8B's on CUDA."""
    if device == "cuda":
        return [64, 96, 4096, 3584, 8192], [80, 1024, 14336]
    return [64, 96, 256], [80, 1500]


def check_tree_sum(device: str, dtype) -> None:
    """The float32 tree, and the tree rounded to ``dtype`` inside the kernel (``FixedOrderMatmul.rounded``)
    equal to torch's cast of it; sums of every magnitude, ties of the rounding among them."""
    gen = torch.Generator().manual_seed(21)
    for g in (1, 2, 4, 8):
        for m, n in ((1, 7), (5, 1030), (3, 4096)):
            sums = (torch.randn(g, m, n, generator=gen) * torch.logspace(-3, 3, n)).to(device)
            want = sums
            while want.shape[0] > 1:
                want = want[0::2] + want[1::2]
            _same(kernels.tree_sum(sums), want[0], f"tree_sum G={g} {m}x{n}")
            _same(kernels.tree_sum(sums, dtype), want[0].to(dtype), f"tree_sum G={g} {m}x{n} to {dtype}")
    # Exact halfway cases of a 16-bit rounding (the low bits 1 followed by zeros) and values past its range.
    ties = torch.tensor([1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8, 1.0 + 2.0**-11, 1.0 + 3 * 2.0**-11, 7.0e4, -1.0e39,
                         float("inf"), float("nan"), -0.0, 1.0e-42], dtype=torch.float32)
    sums = torch.stack([ties, torch.zeros_like(ties)])[:, None, :].to(device)
    _same(kernels.tree_sum(sums, dtype), (sums[0] + sums[1]).to(dtype), f"tree_sum ties to {dtype}")
    try:
        kernels.tree_sum(sums, torch.int32)
    except ValueError:
        pass
    else:
        raise AssertionError("tree_sum must refuse an integer dtype")


def _reference_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``deterministic.rms_norm`` as torch runs it on CUDA: dividing the tree sum by the width is
    multiplying it by the width's float32 reciprocal, and the square root is correctly rounded
    (torch's vectorized CPU square root can be an ulp off: the CPU reference rounds a float64 one)."""
    if x.is_cuda:
        return det.rms_norm(x, weight, eps)
    x32 = x.to(torch.float32)
    inv = torch.tensor(1.0, dtype=torch.float32) / torch.tensor(float(x.shape[-1]), dtype=torch.float32)
    mean = det.fixed_order_sum(x32 * x32) * inv
    root = torch.sqrt((mean + eps).to(torch.float64)).to(torch.float32)
    x32 = x32 * (1.0 / root)[:, None]
    return weight * x32.to(x.dtype)


def check_rms_norm(device: str, dtype) -> None:
    gen = torch.Generator().manual_seed(22)
    for hidden in _sizes(device)[0]:
        x = (torch.randn(6, hidden, generator=gen) * torch.rand(6, 1, generator=gen) * 4).to(device, dtype)
        x[1] = 0  # a row of zeros: the norm of eps alone
        weight = (torch.randn(hidden, generator=gen) + 1).to(device, dtype)
        got = kernels.rms_norm(x, weight, 1e-5, det.leaf_source(hidden, 1, x.device))
        _same(got, _reference_rms_norm(x, weight, 1e-5), f"rms_norm {hidden}")
        rows = kernels.rms_norm(x[3:5], weight, 1e-5, det.leaf_source(hidden, 1, x.device))
        _same(rows, got[3:5], "a row's norm alone and in a batch")


def check_silu_mul(device: str, dtype) -> None:
    gen = torch.Generator().manual_seed(23)
    for inter in _sizes(device)[1]:
        gate_up = (torch.randn(5, 2 * inter, generator=gen) * 6).to(device, dtype)
        special = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 90.0, -90.0, 1e-30])
        gate_up[0, :8] = special.to(dtype)
        gate, up = gate_up.chunk(2, dim=-1)
        _same(kernels.silu_mul(gate_up), det.silu(gate) * up, f"silu_mul {inter}")


CHECKS = {"kernels": [check_tree_sum, check_rms_norm, check_silu_mul]}


if __name__ == "__main__":
    interpreted_main(CHECKS, kernels)
