"""Deterministic mode's CUDA segment GEMM run by Triton's interpreter on CPU tensors: segment
sums against float64, a row's bits alone vs at other places of other batches and with the
columns cut in two, TP = 1 vs 2/4/8 partials (``segment_gemm_checks``; there, why the
interpreter's ``tl.dot`` is made a per-element sum). Each check runs in a subprocess with
``TRITON_INTERPRET=1``, so the interpreter never reaches other tests; the three run side by side. Skipped without
``triton``; the same checks run on CUDA in ``test_deterministic_gpu.py``."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")]


CHECKS = ("reference", "batch_invariance", "tp_invariance")


@pytest.fixture(scope="module")
def interpreted_checks(tmp_path_factory):
    """The checks started at once, each in its own process (the interpreter runs on one
    core; they share the machine's): ``check -> Started``."""
    from started import Started

    from interpreted import interpreter_env

    env = interpreter_env(OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    logs = tmp_path_factory.mktemp("segment_gemm")
    runs = {check: Started([sys.executable, os.path.join(TESTS, "segment_gemm_checks.py"), check, "cpu", "float32",
                            "float16"], Path(ROOT), env, logs=logs, name=check) for check in CHECKS}
    yield runs
    for run in runs.values():
        run.close()


@pytest.mark.parametrize("check", CHECKS)
def test_segment_gemm_under_the_interpreter(interpreted_checks, check):
    assert f"{check} on cpu: ok" in interpreted_checks[check].stdout(timeout=600)


@pytest.mark.parametrize("dtype,instruction", [("bf16", "wgmma"), ("fp16", "wgmma"), ("fp32", "fma.rn.f32")])
def test_segment_gemm_compiles_for_hopper(dtype, instruction):
    """The kernel compiles to Hopper machine code without a GPU (Triton's own ptxas), with the options
    its launch passes: the tensor cores' wgmma for 16-bit inputs, float32 FMAs (never TF32) for
    float32 ones."""
    from interpreted import compile_for_hopper
    from tpspec.model import deterministic_cuda as dc

    signature = {"x_ptr": f"*{dtype}", "w_ptr": f"*{dtype}", "out_ptr": "*fp32", "M": "i32", "N": "i32",
                 "stride_xm": "i32", "stride_wn": "i32"}
    constants = {"SEG_LEN": 80, "IEEE": dtype == "fp32", "BLOCK_M": dc.BLOCK_M,
                 "BLOCK_N": dc.BLOCK_N, "BLOCK_K": dc.BLOCK_K}
    asm = compile_for_hopper(dc._segment_gemm_kernel, signature, constants, num_warps=dc.NUM_WARPS,
                             num_stages=dc.NUM_STAGES, enable_fp_fusion=True)
    ptx = asm["ptx"]
    assert instruction in ptx and "cubin" in asm
    if dtype == "fp32":
        assert "wgmma" not in ptx and "mma.sync" not in ptx and "tf32" not in ptx
