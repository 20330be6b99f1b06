"""Deterministic mode on CUDA with the segment GEMM: the kernel's checks on CUDA tensors
(``segment_gemm_checks``: float64 reference, a row's bits alone vs in other batches and
column cuts, TP = 1 vs 2/4/8 partials), the dispatch, and the tiny model in bfloat16: a
request's logits alone, in batches, in verification and at TP = 1 and 2 (two ranks sharing
the GPU over gloo) bit-identical; float32 logits close to the CPU's."""

from __future__ import annotations

import importlib.util

import pytest
import torch

import segment_gemm_checks
from model_helpers import allocate_slots
from test_deterministic import SCENARIOS, _alone, _differs, run_scenarios
from tpspec.model import deterministic as det
from tpspec.model import load_model
from tpspec.runtime.llm import tiny_model_path
from tpspec.testing import run_ranks

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def segment_gemm():
    # On a CUDA machine a missing triton is a broken install (torch's CUDA wheels bring it), not a skip.
    if importlib.util.find_spec("triton") is None:
        pytest.fail("triton is missing on a CUDA machine: deterministic mode's kernels need it "
                    "(pip install -e '.[triton]')")
    gemm = det.segment_gemm(torch.device("cuda"))
    assert gemm is not None  # triton imports: the one rule picks the segment GEMM
    return gemm


@pytest.mark.parametrize("check,dtype", [("reference", torch.bfloat16), ("batch_invariance", torch.bfloat16),
                                         ("tp_invariance", torch.bfloat16), ("reference", torch.float32),
                                         ("tp_invariance", torch.float32)])
def test_segment_gemm_checks_on_cuda(segment_gemm, check, dtype):
    """Float32's batch invariance is checked on the model (``test_deterministic_on_cuda``):
    compiling its eight-segment variants takes long."""
    segment_gemm_checks.CHECKS[check]("cuda", dtype)


def test_fixed_order_matmul_dispatches_to_the_segment_gemm(segment_gemm):
    """``FixedOrderMatmul.partial`` on CUDA is the segment GEMM over ``min(8, S)`` segments, at
    TP = 1 and on a TP = 4 rank's slice; on CPU it stays the element tree."""
    gen = torch.Generator().manual_seed(5)
    x, w = torch.randn(9, 96, generator=gen).to(torch.bfloat16), torch.randn(13, 96, generator=gen).to(torch.bfloat16)
    c = det.Contraction.of(96)  # S = 32: 8 wide segments of 12 columns
    assert c.wide_segments == 8
    got = det.FixedOrderMatmul(c, 1).partial(x.cuda(), w.cuda())
    assert torch.equal(got, segment_gemm.segment_partial(x.cuda(), w.cuda(), 12))
    rank = det.FixedOrderMatmul(c, 4).partial(x[:, 24:48].cuda(), w[:, 24:48].cuda())
    assert torch.equal(rank, segment_gemm.segment_partial(x[:, 24:48].cuda(), w[:, 24:48].cuda(), 12))
    torch.testing.assert_close(got.cpu(), det.FixedOrderMatmul(c, 1).partial(x, w), rtol=1e-5, atol=1e-5)


def _cuda_scenarios(rank: int, world: int, path: str) -> dict[str, torch.Tensor] | None:
    from tpspec.mapping import Mapping

    torch.cuda.set_device(0)
    mapping = Mapping(world, rank, world) if world > 1 else None
    model = load_model(path, mapping, device="cuda", dtype=torch.bfloat16, deterministic=True)
    allocate_slots(model)
    out = {name: rows.cpu() for name, rows in run_scenarios(model).items()}
    return out if rank == 0 else None


@pytest.fixture(scope="module")
def bf16_tp1(segment_gemm) -> dict[str, torch.Tensor]:
    return _cuda_scenarios(0, 1, tiny_model_path())


def test_bf16_logits_equal_alone_in_batches_and_verification(bf16_tp1):
    assert bf16_tp1["alone"].dtype == torch.bfloat16
    assert _differs(bf16_tp1, bf16_tp1["alone"]) == []


def test_bf16_tp2_equals_tp1_on_one_gpu(bf16_tp1):
    tp2 = run_ranks(_cuda_scenarios, 2, tiny_model_path(), backend="gloo", timeout_s=300)[0]
    for name in SCENARIOS + ("alone",):
        assert torch.equal(tp2[name], bf16_tp1["alone"]), name


def test_fp32_cuda_is_close_to_cpu(segment_gemm):
    """Float32 on CUDA (the segment GEMM's float32 FMAs) computes the CPU tree's function up
    to rounding; the bits differ (another order) and need not match."""
    cuda = load_model(tiny_model_path(), device="cuda", deterministic=True)
    cpu = load_model(tiny_model_path(), deterministic=True)
    allocate_slots(cuda)
    allocate_slots(cpu)
    torch.testing.assert_close(_alone(cuda).cpu(), _alone(cpu), rtol=1e-4, atol=1e-4)
