"""Deterministic mode's layer kernels (:mod:`tpspec.model.deterministic_cuda`: the segment sums'
tree, the norm, ``silu * up``) and the switch that turns them on.

On CPU through Triton's interpreter (a subprocess sets ``TRITON_INTERPRET=1``; skipped without
``triton``): each kernel bit for bit against the torch functions of ``tpspec.model.deterministic``,
in float32 and float16, widths that are powers of two and widths with padded leaves, and a row's
norm alone equal to its norm in a batch (``det_layer_kernels_cases.py``); every kernel compiled for
Hopper without a fused multiply-add. On CUDA (``gpu`` marks): the same against the torch ops on the
GPU in three dtypes at Llama 3 sizes. Whether deterministic layers run them:
``tpspec.model.deterministic.LAYER_KERNELS_ON_CUDA``.
"""

from __future__ import annotations

import pytest
import torch

from interpreted import needs_triton, run_interpreted
from tpspec.model import deterministic as det


@needs_triton
def test_interpreted_kernels_equal_the_torch_ops():
    run_interpreted("det_layer_kernels_cases.py", ["kernels"], ("float32", "float16"))


def test_switch_runs_them_only_on_cuda(monkeypatch):
    """Never on CPU; on CUDA only with ``LAYER_KERNELS_ON_CUDA``."""
    monkeypatch.setattr(det, "_triton_module", lambda name: name)
    monkeypatch.setattr(det, "LAYER_KERNELS_ON_CUDA", True)
    assert det.layer_kernels(torch.device("cuda")) == "deterministic_cuda"
    assert det.layer_kernels(torch.device("cpu")) is None
    monkeypatch.setattr(det, "LAYER_KERNELS_ON_CUDA", False)
    assert det.layer_kernels(torch.device("cuda")) is None


@needs_triton
def test_kernels_compile_for_hopper_without_fused_multiply_add():
    from interpreted import compile_for_hopper
    from tpspec.model import deterministic_cuda as dc
    from tpspec.model import fused_triton

    rotary_args = {name: "*bf16" for name in ("qkv_ptr", "cos_ptr", "sin_ptr", "q_ptr", "k_ptr", "v_ptr")}
    rotary_args.update(index_ptr="*i64", num_rows="i32",
                       **{name: "i32" for name in ("stride_t", "stride_c", "stride_s", "stride_qt", "stride_qh",
                                                   "stride_kr", "stride_kh", "stride_vr", "stride_vh")})
    kernels = [
        (dc._tree_sum_kernel, {"sums_ptr": "*fp32", "out_ptr": "*fp32", "count": "i32"},
         {"G": 8, "BLOCK": dc._ELEMENTS}),
        (dc._tree_sum_kernel, {"sums_ptr": "*fp32", "out_ptr": "*bf16", "count": "i32"},
         {"G": 8, "BLOCK": dc._ELEMENTS}),
        # The rotary and K/V write of the fused layers, which deterministic layers run too: every product
        # rounded before its sum, as apply_rotary rounds it.
        (fused_triton._rotary_kv_kernel, rotary_args,
         {"NUM_HEADS": 32, "NUM_KV_HEADS": 8, "HEAD_DIM": 128, "HALF_PAD": 64, "PDL": False}),
        (dc._rms_norm_kernel, {"x_ptr": "*bf16", "w_ptr": "*bf16", "leaves_ptr": "*i64", "out_ptr": "*bf16",
                               "hidden": "i32", "stride_x": "i32", "stride_o": "i32", "inv_hidden": "fp32",
                               "eps": "fp32"}, {"LEAVES": 4096, "BLOCK": 4096}),
        (dc._silu_mul_kernel, {"x_ptr": "*bf16", "out_ptr": "*bf16", "inter": "i32", "stride_x": "i32",
                               "stride_o": "i32"}, {"BLOCK": dc._ELEMENTS}),
    ]
    for fn, signature, constants in kernels:
        asm = compile_for_hopper(fn, signature, constants, num_warps=4, enable_fp_fusion=False)
        ptx = asm["ptx"]
        assert "cubin" in asm
        assert "fma" not in ptx and "div.full" not in ptx and "div.approx" not in ptx, fn
        assert "sqrt.approx" not in ptx, fn


@pytest.mark.gpu
@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_cuda_kernels_equal_the_torch_ops(dtype):
    import det_layer_kernels_cases as cases

    for check in cases.CHECKS["kernels"]:
        check("cuda", dtype)
