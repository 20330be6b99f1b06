"""Checks of deterministic mode's CUDA segment GEMM (:mod:`tpspec.model.deterministic_cuda`),
shared by the GPU tests (CUDA tensors, in-process) and the CPU tests (CPU tensors under
``TRITON_INTERPRET=1``, in a subprocess so the interpreter never leaks into other tests):
``python tests/segment_gemm_checks.py CHECK DEVICE DTYPE...``.

The kernel relies on one property of the hardware's tile product (``tl.dot``): each output
element depends only on its row and column operands, not on where they sit in the tile.
Triton's interpreter computes ``tl.dot`` with the host BLAS, whose SIMD kernels round a row
differently at different places of a tile, so under the interpreter (``interpret_dot``)
``tl.dot`` is replaced by a plain per-element float32 sum in column order: the CPU checks
then test everything the kernel itself decides (tiles, masks, segment offsets, strides,
the segment tree, the rank slices), and the GPU run tests the hardware's part too.

Each check raises ``AssertionError`` on a mismatch:

* ``reference``: every segment sum is the float64 sum of its products within float32
  rounding, for odd shapes (M = 1, 3, 17, 130; N not a multiple of the tile; K with 8, 4 and 1
  segments, segments shorter and longer than the K block and not multiples of it), and the
  partial (``segment_partial``) equals the adjacent-pairs tree of those sums.
* ``batch_invariance``: a row's result is bit-identical alone and at other positions of
  another batch, and the columns are bit-identical when the weight is cut in two at a column
  that is not a tile boundary.
* ``tp_invariance``: TP = 1 equals TP = 2, 4, 8 bit for bit (each rank's partial over its
  column slice, then the adjacent-pairs tree over ranks).
"""

from __future__ import annotations

import os
import sys

import torch

# (global K, its number of segments G): segments of 24 and 16 columns (shorter than the K
# block), 80 and 75 (longer, with a masked tail), and one odd segment of 67.
SHAPES = ((192, 8), (640, 8), (300, 4), (67, 1))
ROWS = (1, 3, 17, 130)
COLUMNS = 70


def _randn(*shape: int, seed: int, dtype: torch.dtype, device: str) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(dtype).to(device)


def _tree(parts: torch.Tensor) -> torch.Tensor:
    while parts.shape[0] > 1:
        parts = parts[0::2] + parts[1::2]
    return parts[0]


def check_reference(device: str, dtype: torch.dtype) -> None:
    from tpspec.model import deterministic as det
    from tpspec.model import deterministic_cuda as dc

    for k, g in SHAPES:
        assert det.Contraction.of(k).wide_segments == g, k
        seg = k // g
        w = _randn(COLUMNS, k, seed=k, dtype=dtype, device=device)
        for m in ROWS:
            x = _randn(m, k, seed=1000 * m + k, dtype=dtype, device=device)
            sums = dc.segment_sums(x, w, seg)
            assert sums.shape == (g, m, COLUMNS) and sums.dtype == torch.float32
            xd, wd = x.double().cpu().view(m, g, seg), w.double().cpu().view(COLUMNS, g, seg)
            ref = torch.einsum("msk,nsk->smn", xd, wd)
            bound = torch.einsum("msk,nsk->smn", xd.abs(), wd.abs())
            err = (sums.double().cpu() - ref).abs()
            assert bool((err <= 2e-5 * bound + 1e-30).all()), (k, m, float((err / bound).max()))
            total = dc.segment_partial(x, w, seg)
            assert torch.equal(total, _tree(sums)), (k, m)


def check_batch_invariance(device: str, dtype: torch.dtype) -> None:
    from tpspec.model import deterministic_cuda as dc

    for k, g in SHAPES:
        seg = k // g
        x = _randn(130, k, seed=k + 1, dtype=dtype, device=device)
        w = _randn(COLUMNS, k, seed=k + 2, dtype=dtype, device=device)
        full = dc.segment_partial(x, w, seg)
        places = ((0, 70), (5, 0), (63, 99), (64, 6), (129, 64))
        batch = _randn(100, k, seed=k + 3, dtype=dtype, device=device)
        for r, pos in places:
            assert torch.equal(dc.segment_partial(x[r : r + 1], w, seg)[0], full[r]), (k, r)
            batch[pos] = x[r]  # the rows inside another batch, each at another place of another tile
        mixed = dc.segment_partial(batch, w, seg)
        for r, pos in places:
            assert torch.equal(mixed[pos], full[r]), (k, r, pos)
        for cut in (37, 64):  # column-parallel halves, at a non-tile and at a tile boundary
            assert torch.equal(dc.segment_partial(x, w[:cut], seg), full[:, :cut]), (k, cut)
            assert torch.equal(dc.segment_partial(x, w[cut:], seg), full[:, cut:]), (k, cut)


def check_tp_invariance(device: str, dtype: torch.dtype) -> None:
    from tpspec.model import deterministic_cuda as dc

    for k, g in SHAPES:
        seg = k // g
        x = _randn(17, k, seed=k + 4, dtype=dtype, device=device)
        w = _randn(COLUMNS, k, seed=k + 5, dtype=dtype, device=device)
        full = dc.segment_partial(x, w, seg)
        tp = 2
        while tp <= g:
            width = k // tp  # rank r holds columns [r * width, (r + 1) * width): strided views
            parts = torch.stack([dc.segment_partial(x[:, r * width : (r + 1) * width],
                                                    w[:, r * width : (r + 1) * width], seg) for r in range(tp)])
            assert torch.equal(_tree(parts), full), (k, tp)
            tp *= 2


def interpret_dot() -> None:
    """Under ``TRITON_INTERPRET=1``: make the interpreter's ``tl.dot`` a per-element float32
    sum (products, then the running sum over the K axis), the same for every place in a tile."""
    import numpy as np
    from triton.runtime import interpreter

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        assert a.data.dtype in (np.float16, np.float32) and b.data.dtype == a.data.dtype, a.data.dtype
        prod = a.data.astype(np.float32)[:, :, None] * b.data.astype(np.float32)[None, :, :]  # [M, K, N]
        acc = d.data.astype(np.float32).copy()
        for k in range(prod.shape[1]):
            acc = acc + prod[:, k, :]
        return interpreter.TensorHandle(acc, d.dtype.scalar)

    interpreter.InterpreterBuilder.create_dot = create_dot


CHECKS = {"reference": check_reference, "batch_invariance": check_batch_invariance,
          "tp_invariance": check_tp_invariance}


if __name__ == "__main__":
    name, device, *dtypes = sys.argv[1:]
    if os.environ.get("TRITON_INTERPRET") == "1":
        interpret_dot()
    for dtype_name in dtypes:
        CHECKS[name](device, getattr(torch, dtype_name))
    print(f"{name} on {device}: ok")
