"""The selection kernels (:mod:`tpspec.keys_triton`, :mod:`tpspec.sampling.kernels_triton`) and the
switch that turns them on.

On CPU through Triton's interpreter (a subprocess sets ``TRITON_INTERPRET=1`` before Triton is
imported; skipped without ``triton``): every kernel bit for bit against the torch function it
stands for, and the token selection, the deferred selection and the logprobs with the kernels
against without at TP 1 and TP 2 (gloo ranks), each kernel seen to run (``key_kernels_cases.py``).
On CUDA (``gpu`` marks): the same checks at Llama 3 sizes (a 128256-column row, 64 rows, up to
8192 candidates a row).

The switch: ``tpspec.vocab_parallel.KEY_KERNELS_ON_CUDA`` and ``use_key_kernels``.
"""

from __future__ import annotations

import pytest

from interpreted import InterpretedGroups, needs_triton
from tpspec import vocab_parallel


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    """Both groups of checks started at once, side by side."""
    groups = InterpretedGroups("key_kernels_cases.py", {"arithmetic": ("int64",), "selection": ("int64",)},
                               tmp_path_factory.mktemp("key_kernels"))
    yield groups
    groups.close()


@needs_triton
def test_interpreted_kernels_equal_torch_bit_for_bit(interpreted):
    interpreted.check("arithmetic")


@needs_triton
def test_interpreted_selection_equals_torch_at_tp1_and_tp2(interpreted):
    interpreted.check("selection")


def test_switch_decides_per_device(monkeypatch):
    """On CUDA while ``KEY_KERNELS_ON_CUDA`` is on and ``triton`` compiles; on CPU only under the
    interpreter with ``KEY_KERNELS_UNDER_INTERPRETER``; never without ``triton``."""
    assert not vocab_parallel.KEY_KERNELS_UNDER_INTERPRETER
    assert not vocab_parallel.use_key_kernels("cpu")

    class Kernels:
        INTERPRETED = False

    monkeypatch.setattr(vocab_parallel, "key_kernels", lambda: Kernels)
    monkeypatch.setattr(vocab_parallel, "KEY_KERNELS_ON_CUDA", True)
    assert vocab_parallel.use_key_kernels("cuda") and not vocab_parallel.use_key_kernels("cpu")
    monkeypatch.setattr(vocab_parallel, "KEY_KERNELS_ON_CUDA", False)
    assert not vocab_parallel.use_key_kernels("cuda")
    Kernels.INTERPRETED = True
    monkeypatch.setattr(vocab_parallel, "KEY_KERNELS_UNDER_INTERPRETER", True)
    assert vocab_parallel.use_key_kernels("cpu") and not vocab_parallel.use_key_kernels("cuda")
    monkeypatch.setattr(vocab_parallel, "key_kernels", lambda: None)
    assert not vocab_parallel.use_key_kernels("cpu") and not vocab_parallel.use_key_kernels("cuda")


@pytest.mark.gpu
@needs_triton
@pytest.mark.parametrize("group", ["arithmetic", "selection"])
def test_cuda_kernels_equal_torch_bit_for_bit(group):
    import key_kernels_cases as cases

    for check in cases.CHECKS[group]:
        check("cuda", None)


@needs_triton
def test_kernels_compile_for_hopper_without_fused_multiply_add():
    """Every kernel compiles to Hopper machine code without a GPU (Triton's own ptxas) with the
    options its launch passes, and its PTX has no fused multiply-add and no approximate division
    (the float32 arithmetic rounds where torch's does)."""
    from interpreted import compile_for_hopper
    from tpspec import keys_triton as KT
    from tpspec.sampling import kernels_triton as ST

    pointers = lambda names, kind: {n: kind for n in names}  # noqa: E731
    kernels = [
        (KT._score_keys_kernel, {**pointers(["x_ptr"], "*bf16"), "t_ptr": "*fp32",
                                 **pointers(["keys_ptr", "block_max_ptr"], "*i64"),
                                 **pointers(["width", "vocab_offset", "vocab_size", "stride_x", "stride_k", "num_blocks"],
                                            "i32"), "greedy_threshold": "fp32"},
         {"SCALE": True, "BLOCK": KT._PROGRAM_COLUMNS, "KEY_BLOCK_": KT.KEY_BLOCK}),
        (KT._row_sums_kernel, {"keys_ptr": "*i64", "best_ptr": "*fp32", **pointers(["high_ptr", "mass_ptr", "count_ptr"],
                                                                                  "*i64"),
                               **pointers(["width", "stride_k", "num_programs"], "i32")}, {"BLOCK": KT._SUM_COLUMNS}),
        (KT._block_best_kernel, {"x_ptr": "*bf16", "best_ptr": "*i64",
                                 **pointers(["width", "vocab_offset", "stride_x", "num_blocks"], "i32")},
         {"BLOCK": KT.ARGMAX_BLOCK}),
        (KT._best_column_kernel, {"best_ptr": "*i64", "out_ptr": "*i64", "num_blocks": "i32"}, {"BLOCKS_PAD": 64}),
        (ST._penalties_kernel, {"x_ptr": "*bf16", "counts_ptr": "*i32", "seen_ptr": "*u8", "slot_ptr": "*i64",
                                **pointers(["rep_ptr", "pres_ptr", "freq_ptr", "out_ptr"], "*fp32"),
                                **pointers(["width", "stride_x", "stride_table", "stride_o"], "i32")},
         {"BLOCK": ST._PENALTY_COLUMNS}),
        (ST._penalized_keys_kernel, {"x_ptr": "*bf16", "counts_ptr": "*i32", "seen_ptr": "*u8", "slot_ptr": "*i64",
                                     **pointers(["rep_ptr", "pres_ptr", "freq_ptr", "t_ptr"], "*fp32"),
                                     **pointers(["keys_ptr", "block_max_ptr"], "*i64"),
                                     **pointers(["width", "vocab_offset", "vocab_size", "num_slots", "stride_x",
                                                 "stride_table", "stride_k", "num_blocks"], "i32"),
                                     "greedy_threshold": "fp32"},
         {"BLOCK": ST._PENALTY_COLUMNS, "KEY_BLOCK": KT.KEY_BLOCK}),
        (ST._count_kernel, {"counts_ptr": "*i32", **pointers(["slot_ptr", "tokens_ptr", "lengths_ptr"], "*i64"),
                            **pointers(["num_tokens", "num_slots", "vocab_offset", "width", "stride_table",
                                        "stride_t"], "i32")}, {"HAS_LENGTHS": True, "BLOCK": 16}),
        (ST._row_draw_kernel, {**pointers(["ranked_ptr", "floor_ptr", "total_ptr"], "*i64"), "t_ptr": "*fp32",
                               "top_k_ptr": "*i64", **pointers(["top_p_ptr", "min_p_ptr"], "*fp32"),
                               **pointers(["seeds_ptr", "offsets_ptr", "plain_ptr", "tokens_ptr"], "*i64"),
                               "decided_ptr": "*i8", **pointers(["n", "vocab_size"], "i32"), "greedy_threshold": "fp32"},
         {"HAS_K": True, "HAS_P": True, "HAS_M": True, "HAS_PLAIN": True, "HAS_TOTAL": True, "BLOCK": 128}),
        (ST._candidate_draw_kernel, {**pointers(["ranked_ptr", "floor_ptr", "total_ptr", "k_ptr"], "*i64"),
                                     "flags_ptr": "*i32", **pointers(["p_bits_ptr", "m_thr_ptr", "seeds_ptr", "offsets_ptr",
                                                                      "drawn_ptr"], "*i64"),
                                     "decided_ptr": "*i8", "n": "i32"}, {"HAS_TOTAL": True, "BLOCK": 128}),
    ]
    for fn, signature, constants in kernels:
        asm = compile_for_hopper(fn, signature, constants, num_warps=4, enable_fp_fusion=False)
        ptx = asm["ptx"]
        assert "cubin" in asm
        assert "fma" not in ptx and "div.full" not in ptx and "div.approx" not in ptx, fn
