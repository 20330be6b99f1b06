"""The Triton GEMV (:mod:`tpspec.model.gemv_triton`) and the rule that sends linears to it
(:mod:`tpspec.model.linear`).

On CPU through Triton's interpreter (a subprocess sets ``TRITON_INTERPRET=1`` before Triton is
imported; skipped without ``triton``): the kernel against float64 ``x @ W.T`` in float32 and
float16 (the interpreter's ``tl.dot`` does not handle bfloat16) at small shapes (N not a multiple
of the block, a K tail, one and several K splits), M = 1, 3, 16 (and 40 in float32), bias on and
off; the norm fused in front of it (``norm_linear``) against the float64 norm and product, with
and without a residual; SwiGLU's ``silu(gate) * up`` fused in front of it (``silu_mul_linear``)
against the ``silu_mul`` kernel and ``linear``, and formed as the gate/up projection stores its
output (``linear_silu_mul``, ``norm_linear_silu_mul``) against ``linear`` or ``norm_linear`` and
the ``silu_mul`` kernel, all bit for bit; split launches whose last program sums the splits
(``LAST_SPLIT_SUMS``) against the reduction kernel, bit for bit (float32); and the tiny model's
greedy tokens with the switches on equal those of ``F.linear``. The kernels compile for Hopper
without a GPU (the last split sums with their barrier, count and L1-bypassing loads in that
order). The dispatch rule is pure logic, checked here without a kernel. On CUDA (``gpu`` marks):
bfloat16, float16 and float32 at the Llama-3-8B shapes for M = 1, 8, 16, 32, 64 (and the fused
norm at one row, ``silu(gate) * up`` in front of down_proj at 1 and 8, and stored by gate/up at 8
and 32, its norm inside or not), a CUDA-graph replay equal to an eager call, the last split sums in
bfloat16 and replayed 1,000 times, and the tiny model's tokens.
"""

from __future__ import annotations

import pytest
import torch

from interpreted import InterpretedGroups, needs_triton
from tpspec.model import linear as linear_mod


# Llama-3-8B at TP 1: qkv, o_proj, gate_up, down_proj, the LM head.
LLAMA_3_8B = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
              "lm_head": (128256, 4096)}


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    """This module's interpreted groups, started at once (side by side on the machine's cores)."""
    groups = InterpretedGroups("gemv_cases.py",
                               {"kernels": ("float32", "float16"), "rows_and_splits": ("float32",), "llm": ("float32",)},
                               tmp_path_factory.mktemp("gemv"))
    yield groups
    groups.close()


@needs_triton
def test_interpreted_kernel_matches_the_float64_reference(interpreted):
    interpreted.check("kernels")


@needs_triton
def test_interpreted_many_rows_and_last_split_sums(interpreted):
    """40 rows (padded to 64), the last split sums against the reduction kernel, and the ``tl.dot``
    rows with the operand order not chosen: float32 (the dtype does not enter their logic; the
    GPU tests run bfloat16)."""
    interpreted.check("rows_and_splits")


@needs_triton
def test_interpreted_tiny_model_tokens_equal_f_linear(interpreted):
    interpreted.check("llm")


@needs_triton
def test_norm_kernels_compile_for_hopper():
    """The fused norm + GEMV kernels compile to Hopper machine code without a GPU (Triton's own
    ptxas) as ``norm_linear`` launches them at the Llama-3-8B shapes: split (q/k/v) and not
    (gate/up, storing ``silu(gate) * up`` as ``norm_linear_silu_mul`` does), bfloat16, with a
    residual; one row, and several (a tensor-core product)."""
    from interpreted import compile_for_hopper
    from tpspec.model import gemv_triton as kernels

    ptr = "*bf16"
    for pdl in (False, True):
        for n, k in (LLAMA_3_8B["qkv"], LLAMA_3_8B["gate_up"]):
            launch = kernels.plan_gemv(1, n, k, device="cpu")
            signature = {"x_ptr": ptr, "res_ptr": ptr, "g_ptr": ptr, "w_ptr": ptr, "b_ptr": ptr, "out_ptr": ptr,
                         "h_ptr": ptr, "part_ptr": "*fp32", "sq_ptr": "*fp32", "count_ptr": "*i32", "N": "i32",
                         "K": "i32", "stride_wn": "i32", "k_iters": "i32", "k_f": "fp32", "eps": "fp32"}
            constants = {"BLOCK_N": launch.block_n, "BLOCK_K": launch.block_k, "EVEN": True, "SPLIT": n < 8192,
                         "LAST_SUMS": pdl and n < 8192, "HAS_RES": True, "HAS_BIAS": False,
                         "NUM_STAGES": launch.num_stages, "PDL": pdl}
            asm = compile_for_hopper(kernels._norm_gemv_kernel, signature, constants, num_warps=launch.num_warps,
                                     num_stages=launch.num_stages, enable_fp_fusion=True, launch_pdl=pdl)
            assert "cubin" in asm and "ld.global" in asm["ptx"]
            assert ("griddepcontrol.wait" in asm["ptx"]) == pdl
        asm = compile_for_hopper(kernels._norm_reduce_kernel,
                                 {"part_ptr": "*fp32", "sq_ptr": "*fp32", "b_ptr": ptr, "out_ptr": ptr, "N": "i32",
                                  "splits": "i32", "k_f": "fp32", "eps": "fp32"},
                                 {"HAS_BIAS": False, "BLOCK": kernels.REDUCE_BLOCK, "PDL": pdl}, num_warps=4,
                                 enable_fp_fusion=True, launch_pdl=pdl)
        assert "cubin" in asm
    # Several rows: h * g into the tensor cores (an mma), split (q/k/v) and not (gate/up), and the split reduction.
    ints = ("M", "N", "K", "stride_xm", "stride_rm", "stride_hm", "stride_om", "stride_wn", "k_iters")
    for (n, k), m_pad, pdl in ((LLAMA_3_8B["qkv"], 16, True), (LLAMA_3_8B["gate_up"], 32, False)):
        launch = kernels.plan_gemv(m_pad, n, k, device="cpu")
        signature = {"x_ptr": ptr, "res_ptr": ptr, "g_ptr": ptr, "w_ptr": ptr, "b_ptr": ptr, "out_ptr": ptr,
                     "h_ptr": ptr, "part_ptr": "*fp32", "sq_ptr": "*fp32", **{name: "i32" for name in ints},
                     "k_f": "fp32", "eps": "fp32"}
        constants = {"M_PAD": m_pad, "BLOCK_N": launch.block_n, "BLOCK_K": launch.block_k, "EVEN": True,
                     "SPLIT": pdl, "HAS_RES": True, "HAS_BIAS": False, "IEEE": False,
                     "NUM_STAGES": launch.num_stages, "SILU_MUL_OUT": not pdl, "ACCURATE_EXP": True,
                     "W_LEFT": launch.w_left, "PDL": pdl}
        asm = compile_for_hopper(kernels._norm_rows_kernel, signature, constants, num_warps=launch.num_warps,
                                 num_stages=launch.num_stages, enable_fp_fusion=True, launch_pdl=pdl)
        assert "cubin" in asm and "mma" in asm["ptx"] and ("griddepcontrol.wait" in asm["ptx"]) == pdl
    asm = compile_for_hopper(kernels._norm_rows_reduce_kernel,
                             {"part_ptr": "*fp32", "sq_ptr": "*fp32", "b_ptr": ptr, "out_ptr": ptr, "M": "i32",
                              "N": "i32", "splits": "i32", "stride_om": "i32", "k_f": "fp32", "eps": "fp32"},
                             {"HAS_BIAS": True, "SILU_MUL_OUT": True, "ACCURATE_EXP": True,
                              "BLOCK": kernels.REDUCE_BLOCK, "PDL": True}, num_warps=4,
                             enable_fp_fusion=True, launch_pdl=True)
    assert "cubin" in asm


@needs_triton
def test_kernels_keep_their_values_in_registers_on_hopper():
    """Compiled for Hopper without a GPU as the launch rule launches them in bfloat16 at the Llama-3-8B
    shapes (split or not as there; the sizes and strides specialized as multiples of 16, as a launch
    specializes them at these shapes), no kernel keeps more than 32 bytes a thread in local memory (its
    stack, by ``cuobjdump``): one row's GEMV (o_proj), ``silu_mul_linear`` (down_proj) and
    ``norm_linear`` (q/k/v, gate/up), their split reductions, and the same three at 4 rows (the
    few-rows kernels) and at 16, 32 and 64 rows, where ``linear_silu_mul`` (gate/up) too.
    ``norm_linear`` keeps 8 bytes at one row and up to 24 at several, stored once before the K loop
    and read once after it; ``[64, 128]`` tiles of 4 warps with ``x`` as the product's left operand
    spilled up to 2.5 KB a thread at 16 and 32 rows, and a verification step of 4 rows a request
    through them took 3.3 times as long as through cuBLAS."""
    from interpreted import compile_for_hopper, resource_usage
    from test_dependent_launch import _signature
    from tpspec.model import gemv_triton as kernels

    compiled = {}

    def sixteens(kernel, consts):  # the integer arguments a launch at these shapes sees as multiples of 16
        return tuple(name for name in _signature(kernel, consts) if name in ("N", "K") or name.startswith("stride"))

    for m in (1, 4, 16, 32, 64):
        for name, (n, k) in (("o", LLAMA_3_8B["o"]), ("down", LLAMA_3_8B["down"]), ("qkv", LLAMA_3_8B["qkv"]),
                             ("gate_up", LLAMA_3_8B["gate_up"])):
            launch = kernels.plan_gemv(m, n, k, device="cpu")
            split = n < 8192  # as the rule splits these shapes on an H100
            opts = dict(num_warps=launch.num_warps, num_stages=launch.num_stages, enable_fp_fusion=True, launch_pdl=True)
            tile = dict(BLOCK_N=launch.block_n, BLOCK_K=launch.block_k, EVEN=True, SPLIT=split, HAS_BIAS=False,
                        NUM_STAGES=launch.num_stages, PDL=True)
            if m == kernels.FEW_ROWS:
                fn = kernels._few_rows_kernel if name in ("o", "down") else kernels._norm_few_rows_kernel
                consts = dict(tile, SILU_MUL=name == "down", SILU_MUL_OUT=False, ACCURATE_EXP=True) \
                    if name in ("o", "down") else dict(tile, HAS_RES=True, SILU_MUL_OUT=False, ACCURATE_EXP=True)
                compiled[name, m] = compile_for_hopper(fn, _signature(fn, consts), consts, aligned_pointers=True,
                                                       multiples_of_16=sixteens(fn, consts), **opts)
            elif name in ("o", "down"):
                consts = dict(tile, M_PAD=launch.m_pad, USE_DOT=m > 1, LAST_SUMS=False, IEEE=False,
                              SILU_MUL=name == "down", SILU_MUL_OUT=False, ACCURATE_EXP=True, W_LEFT=launch.w_left)
                compiled[name, m] = compile_for_hopper(kernels._gemv_kernel, _signature(kernels._gemv_kernel, consts),
                                                       consts, aligned_pointers=True,
                                                       multiples_of_16=sixteens(kernels._gemv_kernel, consts), **opts)
            elif m == 1:
                consts = dict(tile, LAST_SUMS=False, HAS_RES=True)
                compiled[name, m] = compile_for_hopper(kernels._norm_gemv_kernel,
                                                       _signature(kernels._norm_gemv_kernel, consts), consts,
                                                       aligned_pointers=True,
                                                       multiples_of_16=sixteens(kernels._norm_gemv_kernel, consts),
                                                       **opts)
            else:
                for out in (False, True) if name == "gate_up" else (False,):  # storing silu(gate) * up
                    consts = dict(tile, M_PAD=launch.m_pad, HAS_RES=True, IEEE=False, SILU_MUL_OUT=out,
                                  ACCURATE_EXP=True, W_LEFT=launch.w_left)
                    compiled[name, m, out] = compile_for_hopper(
                        kernels._norm_rows_kernel, _signature(kernels._norm_rows_kernel, consts), consts,
                        aligned_pointers=True, multiples_of_16=sixteens(kernels._norm_rows_kernel, consts), **opts)
                if name == "gate_up":  # storing silu(gate) * up (linear_silu_mul)
                    consts = dict(tile, M_PAD=launch.m_pad, USE_DOT=True, LAST_SUMS=False, IEEE=False, SILU_MUL=False,
                                  SILU_MUL_OUT=True, ACCURATE_EXP=True, W_LEFT=launch.w_left)
                    compiled["gate_up silu out", m] = compile_for_hopper(
                        kernels._gemv_kernel, _signature(kernels._gemv_kernel, consts), consts, aligned_pointers=True,
                        multiples_of_16=sixteens(kernels._gemv_kernel, consts), **opts)
    reduce = {"BLOCK": kernels.REDUCE_BLOCK, "HAS_BIAS": False, "PDL": True}
    silu_out = {"SILU_MUL_OUT": True, "ACCURATE_EXP": True}
    for kernel, extra in ((kernels._reduce_kernel, silu_out), (kernels._norm_reduce_kernel, {}),
                          (kernels._norm_rows_reduce_kernel, silu_out)):
        consts = dict(reduce, **extra)
        compiled[kernel.fn.__name__, 0] = compile_for_hopper(kernel, _signature(kernel, consts), consts, num_warps=4,
                                                            enable_fp_fusion=True, launch_pdl=True)
    usage = {key: resource_usage(asm) for key, asm in compiled.items()}
    spilled = {key: u for key, u in usage.items() if u["STACK"] > 32}
    assert not spilled, spilled


@needs_triton
def test_last_split_sums_order_their_memory_accesses():
    """A split GEMV whose last program sums the splits, compiled for Hopper (one row with ``silu``
    fused in, and the fused norm): each program stores its partials, then a barrier, then one
    ``atom.global.gpu.acq_rel`` (the count), then the last program's partial loads bypass L1
    (``ld.global.cg``) and it resets its counter (a store after the loads)."""
    from interpreted import compile_for_hopper
    from test_dependent_launch import _signature
    from tpspec.model import gemv_triton as kernels

    one_row = kernels.plan_gemv(1, 4096, 14336, device="cpu")
    gemv = dict(M_PAD=1, BLOCK_N=one_row.block_n, BLOCK_K=one_row.block_k, USE_DOT=False, EVEN=True, SPLIT=True,
                LAST_SUMS=True, HAS_BIAS=False, IEEE=False, NUM_STAGES=one_row.num_stages, SILU_MUL=True,
                SILU_MUL_OUT=False, ACCURATE_EXP=True, W_LEFT=False, PDL=True)
    norm = dict(BLOCK_N=16, BLOCK_K=256, EVEN=True, SPLIT=True, LAST_SUMS=True, HAS_RES=True, HAS_BIAS=False,
                NUM_STAGES=3, PDL=True)
    for fn, constants in ((kernels._gemv_kernel, gemv), (kernels._norm_gemv_kernel, norm)):
        ptx = compile_for_hopper(fn, _signature(fn, constants), constants, aligned_pointers=True, launch_pdl=True,
                                 num_warps=4, num_stages=3, enable_fp_fusion=True)["ptx"]
        count = ptx.find("atom.global.gpu.acq_rel.add")
        assert count > 0 and ptx.count("atom.global") == 1, fn
        assert ptx.rfind("bar.sync", 0, count) > ptx.rfind("st.global", 0, count) > 0, fn
        loads = ptx.find("ld.global.cg", count)
        assert loads > count and ptx.find("ld.global.cg") == loads, fn  # no .cg load before the count
        assert ptx.rfind("st.global") > loads, fn


class _Kernels:
    INTERPRETED = False
    MAX_ROWS = 64


def test_dispatch_rule(monkeypatch):
    """On by default (GPU-checked); with the switch on, only one-row ``N >= K`` and two- to four-row
    ``N <= K``, aligned, same-dtype calls on a device the kernels run on (CUDA compiled, CPU
    interpreted) go to the kernel, and with ``TRITON_GEMV_ROWS`` raised the linears of five rows and
    more at least ``ROWS_MIN_WIDENING`` times as wide as their inputs; with it off, none. SwiGLU's down
    projection with ``silu(gate) * up`` inside: one row of ``2 K``, any ``N``, both switches on, and
    where ``FUSED_INPUT_ROWS`` says five rows and more of a wide enough weight (two to four only with
    ``FUSED_FEW_ROWS``)."""
    assert linear_mod.TRITON_GEMV is True
    use = linear_mod.use_triton_linear
    x, w, b = torch.zeros(1, 64), torch.zeros(64, 64), torch.zeros(64)
    kernels = _Kernels()
    kernels.INTERPRETED = True
    monkeypatch.setattr(linear_mod, "gemv_kernels", lambda: kernels)
    monkeypatch.setattr(linear_mod, "TRITON_GEMV", False)
    assert not use(x, w, b)
    monkeypatch.setattr(linear_mod, "TRITON_GEMV", True)
    kernels.INTERPRETED = False
    monkeypatch.setattr(linear_mod, "gemv_kernels", lambda: kernels)
    assert not use(x, w, b)  # CPU without the interpreter
    kernels.INTERPRETED = True
    assert use(x, w, b) and use(x, w) and use(x, torch.zeros(96, 64))
    assert use(x.half(), w.half(), b.half())
    assert not use(x, torch.zeros(32, 64))  # one row, K > N (down_proj): silu_mul_linear's rule, else cuBLAS
    assert not use(torch.zeros(2, 64), torch.zeros(96, 64))  # two rows, N > K (q/k/v, gate/up): cuBLAS
    assert not use(x.bfloat16(), w.bfloat16())  # the interpreter's tl.dot has no bfloat16
    assert not use(torch.zeros(0, 64), w)
    assert not use(torch.zeros(1, 60), torch.zeros(64, 60))  # K not a multiple of 8
    assert not use(x, torch.zeros(64, 64).t())  # not contiguous
    assert not use(torch.zeros(1, 65)[:, 1:], torch.zeros(64, 65)[:, 1:])  # not contiguous
    assert not use(x, torch.zeros(64 * 64 + 1)[1:].view(64, 64))  # not 16-byte aligned
    assert not use(x.half(), w)  # mixed dtypes
    assert not use(x, w, b.half())
    assert not use(x.double(), w.double())
    assert not use(x[None], w)
    assert not use(x.requires_grad_(), w)
    with torch.no_grad():
        assert use(x, w)
    x = x.detach()
    norm = linear_mod.use_triton_norm_linear
    g = torch.ones(64)
    assert norm(x, None, g, w, b) and norm(x, torch.zeros(1, 64), g, w)
    assert not norm(x, torch.zeros(1, 64).half(), g, w)  # the residual in another dtype
    assert not norm(x, torch.zeros(2, 64), g, w)
    assert not norm(x, None, torch.ones(32), w) and not norm(x, None, g.half(), w)
    assert not norm(x, None, g, torch.zeros(32, 64))  # the linear itself not taken
    silu = linear_mod.use_triton_silu_linear
    assert linear_mod.TRITON_SILU_DOWN is True
    gate_up = torch.zeros(1, 128)
    assert silu(gate_up, torch.zeros(32, 64)) and silu(gate_up, w)  # down_proj's K > N too
    assert not silu(torch.zeros(2, 128), torch.zeros(32, 64))  # one row only
    assert linear_mod.TRITON_GEMV_ROWS == 32
    monkeypatch.setattr(linear_mod, "TRITON_GEMV_ROWS", 4)  # up to four rows: at one N >= K, at two to four N <= K
    assert use(torch.zeros(4, 64), w) and not use(torch.zeros(5, 64), w)
    assert use(torch.zeros(4, 64), w[:32]) and use(torch.zeros(2, 64), w[:32]) and not use(x, w[:32])
    assert not use(torch.zeros(4, 64), torch.zeros(128, 64)) and use(x, torch.zeros(128, 64))
    assert linear_mod.FUSED_INPUT_ROWS == 1  # the norm and silu inside the GEMV at one row only
    assert not silu(torch.zeros(2, 128), torch.zeros(32, 64)) and not norm(torch.zeros(2, 64), None, g, w)
    assert silu(gate_up, torch.zeros(32, 64)) and norm(x, None, g, w)
    assert linear_mod.FUSED_FEW_ROWS is False
    monkeypatch.setattr(linear_mod, "FUSED_INPUT_ROWS", 4)  # the few-rows kernels take them only when told
    assert not silu(torch.zeros(4, 128), torch.zeros(32, 64)) and not norm(torch.zeros(2, 64), None, g, w)
    monkeypatch.setattr(linear_mod, "FUSED_FEW_ROWS", True)  # up to four rows: silu and the norm too
    assert silu(torch.zeros(4, 128), torch.zeros(32, 64)) and not silu(torch.zeros(5, 128), torch.zeros(32, 64))
    assert norm(torch.zeros(2, 64), None, g, w) and norm(torch.zeros(4, 64), torch.zeros(4, 64), g, w)
    assert not norm(torch.zeros(4, 64), torch.zeros(1, 64), g, w) and not norm(torch.zeros(5, 64), None, g, w)
    monkeypatch.setattr(linear_mod, "FUSED_FEW_ROWS", False)
    # Five rows and more (the tl.dot path): the linears at least ROWS_MIN_WIDENING times as wide as their
    # inputs (gate/up, the LM head), every linear with it at 0, and the norm and silu inside up to
    # FUSED_INPUT_ROWS, while two to four rows keep them outside.
    assert linear_mod.ROWS_MIN_WIDENING == 4
    monkeypatch.setattr(linear_mod, "TRITON_GEMV_ROWS", 8)
    monkeypatch.setattr(linear_mod, "FUSED_INPUT_ROWS", 6)
    wide = torch.zeros(256, 64)  # N = 4 K: as gate/up
    assert use(torch.zeros(5, 64), wide) and use(torch.zeros(8, 64), wide) and not use(torch.zeros(9, 64), wide)
    assert not use(torch.zeros(4, 64), wide) and use(torch.zeros(4, 64), torch.zeros(32, 64))
    assert not use(torch.zeros(8, 64), torch.zeros(32, 64)) and not use(torch.zeros(8, 64), torch.zeros(248, 64))
    assert norm(torch.zeros(5, 64), None, g, wide) and norm(torch.zeros(6, 64), torch.zeros(6, 64), g, wide)
    assert not norm(torch.zeros(7, 64), None, g, wide) and not norm(torch.zeros(4, 64), None, g, w)
    assert silu(torch.zeros(6, 32), torch.zeros(64, 16)) and not silu(torch.zeros(7, 32), torch.zeros(64, 16))
    assert not silu(torch.zeros(6, 128), torch.zeros(32, 64))  # down_proj's N < K: cuBLAS, silu outside
    assert not silu(torch.zeros(4, 128), torch.zeros(32, 64)) and silu(gate_up, torch.zeros(32, 64))
    monkeypatch.setattr(linear_mod, "ROWS_MIN_WIDENING", 0)  # every linear
    assert use(torch.zeros(8, 64), torch.zeros(32, 64)) and use(torch.zeros(8, 64), torch.zeros(96, 64))
    assert silu(torch.zeros(6, 128), torch.zeros(32, 64))
    monkeypatch.setattr(linear_mod, "ROWS_MIN_WIDENING", 4)
    monkeypatch.setattr(linear_mod, "FUSED_INPUT_ROWS", 1)
    monkeypatch.setattr(linear_mod, "TRITON_GEMV_ROWS", 1000)  # never past the kernels' MAX_ROWS
    assert use(torch.zeros(kernels.MAX_ROWS, 64), wide) and not use(torch.zeros(kernels.MAX_ROWS + 1, 64), wide)
    monkeypatch.setattr(linear_mod, "TRITON_GEMV_ROWS", 1)
    assert not use(torch.zeros(2, 64), w) and use(x, w)
    assert not silu(torch.zeros(1, 64), torch.zeros(32, 64))  # gate_up is 2 K wide
    assert not silu(gate_up.half(), torch.zeros(32, 64))
    monkeypatch.setattr(linear_mod, "TRITON_SILU_DOWN", False)
    assert not silu(gate_up, torch.zeros(32, 64))
    monkeypatch.setattr(linear_mod, "TRITON_SILU_DOWN", True)
    monkeypatch.setattr(linear_mod, "TRITON_GEMV", False)
    assert not silu(gate_up, torch.zeros(32, 64))
    monkeypatch.setattr(linear_mod, "TRITON_GEMV", True)
    monkeypatch.setattr(linear_mod, "gemv_kernels", lambda: None)  # no triton
    assert not use(x, w)
    if torch.cuda.is_available():
        monkeypatch.setattr(linear_mod, "gemv_kernels", lambda: kernels)
        xc, wc = x.cuda(), w.cuda()
        kernels.INTERPRETED = True
        assert not use(xc, wc)  # the interpreter runs CPU tensors only
        kernels.INTERPRETED = False
        assert use(xc, wc) and use(xc.bfloat16(), wc.bfloat16()) and not use(x, w) and not use(xc, w)


def test_gate_up_silu_rule(monkeypatch):
    """``silu(gate) * up`` stored by the gate/up GEMV (on by default): from two rows where the rule
    takes the linear (gate/up from five rows to ``TRITON_GEMV_ROWS``), an even number of weight
    rows; never at one row (the down projection takes ``silu`` inside there); none with the switch off."""
    assert linear_mod.TRITON_GATE_UP_SILU is True
    after = linear_mod.use_triton_linear_silu_mul
    kernels = _Kernels()
    kernels.INTERPRETED = True
    monkeypatch.setattr(linear_mod, "gemv_kernels", lambda: kernels)
    gate_up, rows = torch.zeros(256, 64), torch.zeros(8, 64)  # N = 4 K, as gate/up
    monkeypatch.setattr(linear_mod, "TRITON_GATE_UP_SILU", False)
    assert linear_mod.use_triton_linear(rows, gate_up) and not after(rows, gate_up)
    monkeypatch.setattr(linear_mod, "TRITON_GATE_UP_SILU", True)
    monkeypatch.setattr(linear_mod, "TRITON_GEMV_ROWS", 8)
    assert after(rows, gate_up) and after(rows, gate_up, torch.zeros(256)) and after(torch.zeros(5, 64), gate_up)
    assert not after(torch.zeros(1, 64), gate_up)  # one row: silu inside the down projection
    assert not after(torch.zeros(4, 64), gate_up)  # two to four rows: gate/up (N > K) in cuBLAS
    assert after(torch.zeros(4, 64), torch.zeros(32, 64))  # ... a narrow one in the few-rows kernels
    assert not after(torch.zeros(9, 64), gate_up)  # past TRITON_GEMV_ROWS
    odd = torch.zeros(257, 64)  # an odd number of rows
    assert linear_mod.use_triton_linear(rows, odd) and not after(rows, odd)
    assert not after(rows, torch.zeros(128, 64))  # narrower than ROWS_MIN_WIDENING allows from five rows
    assert not after(rows.half(), gate_up) and not after(rows[None], gate_up)
    monkeypatch.setattr(linear_mod, "TRITON_GEMV", False)
    assert not after(rows, gate_up)


@needs_triton
def test_rule_and_kernels_agree_on_the_few_rows():
    """The rule's two-to-four-row band is the few-rows kernels' (the rule's module imports no triton)."""
    from tpspec.model import gemv_triton as kernels

    assert linear_mod._FEW_ROWS == kernels.FEW_ROWS
    assert kernels.plan_gemv(kernels.FEW_ROWS, 64, 64, device="cpu").m_pad == kernels.FEW_ROWS
    assert kernels.plan_gemv(kernels.FEW_ROWS + 1, 64, 64, device="cpu").m_pad > kernels.FEW_ROWS


def test_linear_is_f_linear_with_the_switch_off():
    gen = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(3, 16, generator=gen), torch.randn(8, 16, generator=gen), torch.randn(8, generator=gen)
    assert torch.equal(linear_mod.linear(x, w, b), torch.nn.functional.linear(x, w, b))


# ---------------------------------------------------------------------------------------- GPU

@pytest.mark.gpu
@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_cuda_kernel_matches_the_float64_reference(dtype):
    import gemv_cases as cases

    cases.check_kernels("cuda", dtype)
    cases.check_kernels("cuda", dtype, shapes=list(LLAMA_3_8B.values()), rows=(1, 4, 8, 16, 32, 64))
    cases.check_norm_kernels("cuda", dtype)
    cases.check_norm_kernels("cuda", dtype, shapes=[LLAMA_3_8B["qkv"], LLAMA_3_8B["gate_up"]], rows=(1, 4, 32))
    cases.check_silu_kernels("cuda", dtype)
    cases.check_silu_kernels("cuda", dtype, shapes=[LLAMA_3_8B["down"]], rows=(1, 4, 8))
    cases.check_silu_out_kernels("cuda", dtype)


@pytest.mark.gpu
@needs_triton
def test_cuda_gate_up_stores_silu_mul():
    """At gate/up's Llama-3-8B shape in bfloat16, 8 and 32 rows: ``linear_silu_mul`` and
    ``norm_linear_silu_mul`` give the bits of ``linear`` or ``norm_linear`` and the ``silu_mul`` kernel."""
    import gemv_cases as cases

    features = (LLAMA_3_8B["gate_up"][0] // 2, LLAMA_3_8B["gate_up"][1])
    cases.check_silu_out_kernels("cuda", torch.bfloat16, shapes=[features], rows=(8, 32))
    cases.check_norm_silu_out_kernels("cuda", torch.bfloat16, shapes=[features], rows=(8, 32))


@pytest.mark.gpu
@needs_triton
def test_cuda_last_split_sums_equal_the_reduction_kernel():
    """The last program of a split launch summing the splits: the bits of the reduction kernel at
    the split Llama-3-8B shapes (one row and 8), and in a CUDA graph of 50 split launches, each on
    its own input, replayed 20 times: every output the reduction kernel's bits (the partials of
    the other splits visible to the program that sums them, and the counters back at zero, on
    every launch)."""
    import gemv_cases as cases
    from tpspec.model import gemv_triton as kernels
    from tpspec.model import split_counters

    cases.check_last_split_sums("cuda", torch.bfloat16, shapes=[LLAMA_3_8B["o"], LLAMA_3_8B["down"]], rows=(1, 8))
    gen = torch.Generator(device="cuda").manual_seed(1)
    n, k = LLAMA_3_8B["down"]
    w = (torch.randn(n, k, generator=gen, device="cuda") * k**-0.5).to(torch.bfloat16)
    xs = [torch.randn(1, k, generator=gen, device="cuda").to(torch.bfloat16) for _ in range(50)]
    assert kernels.plan_gemv(1, n, k, device="cuda").splits > 1
    want = [kernels.linear(x, w) for x in xs]
    saved = kernels.LAST_SPLIT_SUMS
    kernels.LAST_SPLIT_SUMS = True
    try:
        kernels.linear(xs[0], w)  # the counters, outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = [kernels.linear(x, w) for x in xs]
        for _ in range(20):
            for out in outs:
                out.zero_()
            graph.replay()
            torch.cuda.synchronize()
            assert all(torch.equal(a, b) for a, b in zip(outs, want))
        assert not bool(split_counters._COUNTERS[xs[0].device].any())
    finally:
        kernels.LAST_SPLIT_SUMS = saved


@pytest.mark.gpu
@needs_triton
@pytest.mark.parametrize("m", [1, 4, 8])
def test_cuda_graph_replay_equals_eager(m):
    """Every Llama-3-8B linear (split-K ones included) with and without a bias, and the norm fused in
    front of q/k/v and gate/up, captured in one CUDA graph, replayed on new inputs copied in, gives
    the bits of eager calls on those inputs."""
    from tpspec.model import gemv_triton as kernels

    gen = torch.Generator(device="cuda").manual_seed(0)
    dtype = torch.bfloat16
    cases = []
    for n, k in LLAMA_3_8B.values():
        w = torch.randn(n, k, generator=gen, device="cuda").to(dtype)
        b = torch.randn(n, generator=gen, device="cuda").to(dtype)
        cases.append((torch.randn(m, k, generator=gen, device="cuda").to(dtype), w, b))
    o_proj = cases[1]
    assert kernels.plan_gemv(m, *o_proj[1].shape, device="cuda", splits=4).splits == 4  # a split launch at every m

    res = torch.randn(m, 4096, generator=gen, device="cuda").to(dtype)
    g = torch.randn(4096, generator=gen, device="cuda").to(dtype)

    def forward():
        outs = [kernels.linear(x, w, bias) for x, w, b in cases for bias in (None, b)]
        outs.append(kernels.linear(*o_proj, splits=4))
        for x, w, _ in cases[:3:2]:  # the norm fused in front of q/k/v and gate/up, with a residual and without
            outs += kernels.norm_linear(x, res, g, 1e-5, w) + kernels.norm_linear(x, None, g, 1e-5, w)[:1]
        return outs

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
