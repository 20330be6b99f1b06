"""What the CI (no GPU) can check of the LL exchange: the kernel sources compile for sm_90
with the flags NVRTC gets, the shared constants match the torch reference, every plan is
valid for the kernels it names, and the host-side logic (layout, errors, factory fallback)
behaves."""

from __future__ import annotations

import shutil
import subprocess

import numpy as np
import pytest
import torch

from tpspec import keys as K
from tpspec.exchange import AllGatherKeyExchange, cuda_module, make_key_exchange
from tpspec.exchange import ll as L
from tpspec.exchange import ll_plan as P
from tpspec.exchange.base import KeyExchange
from tpspec.exchange.factory import ll_decision, local_ll_blocker
from tpspec.testing import run_ranks


def _f32_bits(value: float) -> int:
    return int(np.float32(value).view(np.uint32))


# ------------------------------------------------------------------ the CUDA source

@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
@pytest.mark.parametrize("name, kernels, absent", [
    (cuda_module.SOURCE_FILE, cuda_module.KERNEL_NAMES, cuda_module.FLOOR_KERNEL_NAMES),
    (cuda_module.FLOORS_FILE, cuda_module.FLOOR_KERNEL_NAMES, cuda_module.KERNEL_NAMES),
])
def test_kernel_sources_compile_for_sm90(tmp_path, name, kernels, absent):
    out = tmp_path / "ll.cubin"
    cmd = cuda_module.nvcc_command(out, arch="sm_90", kind="cubin", name=name)
    result = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path)
    assert result.returncode == 0, f"{' '.join(cmd)}\n{result.stdout}\n{result.stderr}"
    assert "warning" not in result.stderr.lower(), result.stderr
    blob = out.read_bytes()
    for kernel in kernels:
        assert kernel.encode() in blob, f"kernel {kernel} missing from the cubin of {name}"
    for kernel in absent:  # the benchmark references stay out of the exchange's module, and back
        assert kernel.encode() not in blob, f"kernel {kernel} should not be in {name}"


def test_nvrtc_text_inlines_every_local_header_once():
    for name in (cuda_module.SOURCE_FILE, cuda_module.FLOORS_FILE):
        text = cuda_module.kernel_source(name)
        assert "#include" not in text  # NVRTC gets one self-contained text
        lines = text.splitlines()
        for header in sorted(cuda_module.source_dir().glob("*.h")):
            guard = f"#define TPSPEC_{header.name.upper().replace('.', '_')}"
            assert lines.count(guard) <= 1, (name, header.name)
        assert lines.count("#define TPSPEC_LL_CONSTANTS_H") == 1
    assert "ll_argmax_logits_bf16" not in cuda_module.kernel_source(cuda_module.FLOORS_FILE)


def test_shared_constants_match_the_torch_reference():
    c = cuda_module.shared_constants()
    expected = {f"INV{k}_BITS": _f32_bits(v) for k, v in K._INV_ODD.items()}
    expected.update(
        LN2_HI_BITS=_f32_bits(K._LN2_HI),
        LN2_LO_BITS=_f32_bits(K._LN2_LO),
        SQRT2_BITS=K._SQRT2_BITS,
        TWO_POW_M33_BITS=_f32_bits(K._TWO_POW_M32 / 2),
        CANONICAL_NAN_BITS=K.CANONICAL_NAN_BITS,
        PHILOX_M0=K.PHILOX_M0,
        PHILOX_M1=K.PHILOX_M1,
        PHILOX_W0=K.PHILOX_W0,
        PHILOX_W1=K.PHILOX_W1,
        GUMBEL_TABLE_SIZE=2 * K.GUMBEL_BUCKETS_PER_HALF,
        GUMBEL_SUB_BITS=K.GUMBEL_BUCKET_SUB_BITS,
        GUMBEL_ABS_ERROR=K.GUMBEL_BOUND_ABS_ERROR,
        GUMBEL_REL_ERROR=K.GUMBEL_BOUND_REL_ERROR,
    )
    for name, value in expected.items():
        assert c.get(name) == value, f"{name}: ll_constants.h has {c.get(name)!r}, keys.py {value!r}"
    # The float constants are what the kernel reads (float32): the header's decimal must round-trip.
    for name in ("GUMBEL_ABS_ERROR", "GUMBEL_REL_ERROR"):
        assert float(np.float32(c[name])) == pytest.approx(c[name], rel=1e-7)
    kc = P.kernel_constants()
    assert kc.max_world == 64  # missing-rank masks are 64-bit words
    assert kc.threads % 32 == 0 and kc.line_bytes == 16


def test_parse_constants_reads_only_the_documented_form():
    text = ("#ifndef G\n#define G\n#define A 12  // a\n#define B 0xFFu\n#define F 1.5e-3f\n"
            "// #define C 3\n")
    assert cuda_module.parse_constants(text) == {"A": 12, "B": 255, "F": 1.5e-3}
    with pytest.raises(ValueError, match="NAME VALUE"):
        cuda_module.parse_constants("#define M(x) (x + 1)\n")
    with pytest.raises(ValueError, match="unknown form"):
        cuda_module.parse_constants("#define D sizeof(int)\n")


def test_source_never_uses_multicast_or_fast_math():
    for name in (cuda_module.SOURCE_FILE, cuda_module.FLOORS_FILE):
        source = cuda_module.kernel_source(name)
        for banned in ("cuMulticast", "multimem", "__expf", "__logf", "__fdividef"):
            assert banned not in source, banned
    assert "--fmad=false" in cuda_module.compile_options()
    assert "-std=c++17" in cuda_module.compile_options()


def test_source_dir_env_override(tmp_path, monkeypatch):
    monkeypatch.setenv(cuda_module.SOURCE_ENV, str(tmp_path))
    assert cuda_module.source_dir() == tmp_path
    with pytest.raises(RuntimeError, match=cuda_module.SOURCE_ENV):
        cuda_module.kernel_source()
    (tmp_path / cuda_module.SOURCE_FILE).write_text('#include "part.h"\n// kernels\n')
    with pytest.raises(RuntimeError, match="part.h"):
        cuda_module.kernel_source()
    (tmp_path / "part.h").write_text("// part\n")
    assert cuda_module.kernel_source() == "// part\n// kernels\n"
    with pytest.raises(ValueError, match="kind"):
        cuda_module.nvcc_command(tmp_path / "x", kind="fatbin")


# ---------------------------------------------------------------------- the launch plan

DTYPES = ("float32", "bfloat16", "float16")
SHAPE_ROWS = (1, 2, 3, 5, 8, 9, 16, 33, 64, 100, 128, 256, 1000, 4096)
SHAPE_WIDTHS = (0, 1, 7, 8, 255, 256, 257, 513, 1000, 4099, 16384, 20000, 32000, 65536, 128256, 262144)
SHAPE_SMS = (1, 16, 66, 78, 132, 264)


def _plans():
    for sms in SHAPE_SMS:
        for dtype in DTYPES:
            for mode in P.MODES:
                for rows in SHAPE_ROWS:
                    for width in SHAPE_WIDTHS:
                        yield (rows, width, dtype, mode, sms), P.plan(rows, width, dtype, mode, sms)


def test_every_shape_gets_a_valid_plan():
    c = P.kernel_constants()
    for (rows, width, dtype, mode, sms), p in _plans():
        case = (rows, width, dtype, mode, sms, p)
        elem = P.DTYPE_BYTES[dtype]
        assert p.kernel in cuda_module.KERNEL_NAMES, case
        prefix = "ll_argmax_logits_" + {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}[dtype]
        assert p.kernel in (prefix, prefix + "_one_tile", prefix + "_columns"), case
        assert p.threads == c.threads and p.rows == rows and p.blocks == rows * p.chunks
        # The chunks cover the row, none of them empty, in whole warps of 16-byte loads.
        assert p.chunks >= 1 and p.chunk * p.chunks >= width, case
        assert (p.chunks - 1) * p.chunk < max(width, 1), case
        assert p.chunk % (32 * 16 // elem) == 0, case
        # One wave of the budget (a row gets at least a block), and no budget beyond the block lines.
        assert p.blocks <= max(rows, p.block_budget), case
        assert p.blocks <= P.max_grid_blocks(rows, sms), case
        # Shared memory: a key per row, plus a key per block in the collector; no opt-in needed
        # up to max_rows = MAX_MAX_ROWS.
        assert p.shared_bytes == 8 * rows * (1 + p.chunks if p.chunks > 1 else 1), case
        if rows <= L.MAX_MAX_ROWS:
            assert p.shared_bytes <= P.DEFAULT_DYNAMIC_SHARED_LIMIT, case
        if p.gather == "row_warps":
            assert rows <= c.threads // 32
            assert p.chunks <= (c.columns_gather_max_chunks if p.sampled_route == "columns"
                                else c.row_gather_max_chunks), case
        else:
            assert p.gather == "block_lines"
        tile = P.sampled_tile_columns(elem)
        if mode == "greedy":
            assert p.sampled_route is None and p.per_thread == 0 and not p.kernel.endswith(("_columns", "_one_tile"))
            assert p.block_budget <= P.GREEDY_BLOCKS_PER_SM * sms
            # A block reads at most a pack a thread, or whole groups of greedy_span's loads.
            assert p.chunk * elem <= 16 * c.threads or p.chunk * elem % P.greedy_group_bytes() == 0, case
        elif p.sampled_route == "columns":
            assert p.kernel.endswith("_columns") and p.chunk == p.per_thread * c.threads and p.per_thread in (1, 2)
            assert p.blocks <= sms and p.chunks <= c.columns_gather_max_chunks, case
        elif p.sampled_route in ("pruned_quads", "one_tile"):
            assert p.kernel.endswith("_one_tile") and 2 * c.threads < p.chunk <= tile, case
            quads = 4 * c.threads * p.per_thread
            if p.sampled_route == "pruned_quads":
                assert 1 <= p.per_thread <= c.pruned_quads_max and quads - 4 * c.threads < p.chunk <= quads, case
            else:
                assert p.chunk > 4 * c.threads * c.pruned_quads_max and p.per_thread == 0, case
        else:
            assert p.sampled_route == "tiles" and p.chunk > tile and p.per_thread == 0, case
            assert not p.kernel.endswith(("_columns", "_one_tile")), case
        if mode == "sampled" and p.sampled_route != "columns":
            # Two blocks an SM, or four where only four make every chunk fit one tile.
            assert p.block_budget in (P.SAMPLED_BLOCKS_PER_SM_FIRST * sms, P.SAMPLED_BLOCKS_PER_SM * sms), case
            if p.block_budget == P.SAMPLED_BLOCKS_PER_SM * sms:
                assert p.chunk <= tile, case


def test_small_sampled_calls_take_a_column_a_thread_where_one_block_an_sm_holds_them():
    c = P.kernel_constants()
    for (rows, width, dtype, mode, sms), p in _plans():
        if mode != "sampled":
            continue
        chunks = -(-max(width, 1) // c.threads)
        if rows * chunks <= sms and chunks <= c.columns_gather_max_chunks:
            assert (p.sampled_route, p.per_thread, p.chunk) == ("columns", 1, c.threads), (rows, width, sms, p)


def test_every_fused_kernel_of_the_source_is_some_plan_s_choice():
    # A kernel no plan picks is dead code to compile at every start: the source must not hold one.
    picked = {p.kernel for _, p in _plans()}
    fused = {name for name in cuda_module.KERNEL_NAMES if name.startswith("ll_argmax_logits")}
    assert picked == fused
    routes = {p.sampled_route for _, p in _plans()}
    assert routes == {None, "columns", "pruned_quads", "one_tile", "tiles"}
    assert {p.per_thread for _, p in _plans() if p.sampled_route == "pruned_quads"} == {1, 2}
    assert {p.gather for _, p in _plans()} == {"row_warps", "block_lines"}


def test_plan_rejects_bad_input():
    for kwargs, field in ((dict(rows=0), "rows"), (dict(rows=True), "rows"), (dict(width=-1), "width"),
                          (dict(dtype="int8"), "dtype"), (dict(mode="fast"), "mode"), (dict(sms=0), "sms"),
                          (dict(sms=1.5), "sms")):
        args = dict(rows=4, width=1000, dtype="bfloat16", mode="greedy", sms=132) | kwargs
        with pytest.raises(ValueError, match=field):
            P.plan(**args)
    # torch dtypes name the same plans as their names.
    assert P.plan(4, 1000, torch.bfloat16, "sampled", 132) == P.plan(4, 1000, "bfloat16", "sampled", 132)


def test_the_gpu_wave_test_cases_still_need_more_than_one_wave():
    # test_ll_gpu's wave test asserts this at run time on the GPU; a change of plan that broke it
    # should fail here, in CI, first.
    from test_ll_gpu import WAVE_CASES

    share = L.sms_per_rank(132, ["h200"] * 2, 0)
    for rows, width, sampled in WAVE_CASES:
        p = P.plan(rows, width, "bfloat16", "sampled" if sampled else "greedy", share)
        assert p.blocks > 132, (rows, width, sampled, p)


def test_ranks_sharing_a_gpu_plan_for_their_share_of_its_sms():
    # One GPU a rank: the whole GPU each.
    assert [L.sms_per_rank(132, ["a", "b", "c", "d"], r) for r in range(4)] == [132] * 4
    # Eight ranks on one GPU (the one-GPU benchmarks): 16 SMs each, so their grids fit together.
    assert {L.sms_per_rank(132, ["a"] * 8, r) for r in range(8)} == {16}
    # Uneven placement: each rank divides by the ranks on its own GPU.
    devices = ["a", "a", "a", "b"]
    assert [L.sms_per_rank(132, devices, r) for r in range(4)] == [44, 44, 44, 132]
    assert L.sms_per_rank(4, ["a"] * 8, 0) == 1  # never 0
    # Eight ranks' planned grids on one GPU fit it in one wave, greedy and sampled.
    share = L.sms_per_rank(132, ["a"] * 8, 0)
    for rows, cols, mode in ((1, 16384, "sampled"), (8, 16384, "sampled"), (64, 16384, "greedy"),
                             (256, 16384, "sampled")):
        p = P.plan(rows, cols, "bfloat16", mode, share)
        assert 8 * p.blocks <= max(8 * rows, (4 if mode == "sampled" else 2) * 132)


def test_exchange_keys_kernel_polls_as_many_peer_lines_as_the_world_needs():
    batches = [int(P.exchange_keys_kernel(world).rsplit("_", 1)[1]) for world in range(1, P.kernel_constants().max_world + 1)]
    for world in range(1, P.kernel_constants().max_world + 1):
        assert P.exchange_keys_kernel(world) in cuda_module.KERNEL_NAMES
    assert batches[:2] == [1, 1]  # one peer: poll one line
    assert batches == sorted(batches)  # more peers never poll fewer lines at once
    assert {n for n in cuda_module.KERNEL_NAMES if n.startswith("ll_exchange_keys")} == {
        P.exchange_keys_kernel(w) for w in range(1, P.kernel_constants().max_world + 1)}


def test_buffer_layout_is_aligned_and_disjoint():
    ctrl_bytes = P.kernel_constants().ctrl_bytes
    for world, rows, channels, sms in ((1, 1, 1, 132), (2, 1024, 2, 132), (8, 333, 3, 1), (64, 4096, 16, 200)):
        blocks = P.max_grid_blocks(rows, sms)
        lay = L.BufferLayout(world, rows, channels, blocks)
        assert lay.slots_offset % 256 == 0 and lay.slots_offset >= ctrl_bytes * channels
        assert lay.block_lines_offset == lay.slots_offset + channels * 2 * world * rows * 16
        assert lay.block_lines_offset % 16 == 0
        assert lay.total_bytes == lay.block_lines_offset + channels * blocks * 16
        assert lay.slots(1000, channels - 1) + lay.slot_channel_bytes == 1000 + lay.block_lines_offset
        assert lay.block_lines(1000, channels - 1) + blocks * 16 == 1000 + lay.total_bytes
        # Peers address the slots of each other's buffers with their own layout: the slot
        # offsets must not depend on the GPU (its SM count sizes only the block lines).
        other = L.BufferLayout(world, rows, channels, P.max_grid_blocks(rows, 2 * sms))
        assert other.slots(0, channels - 1) == lay.slots(0, channels - 1)


def test_every_planned_grid_fits_the_block_lines():
    for sms in (1, 16, 132, 200):
        for max_rows in (1, 64, 1024, 4096):
            lines = P.max_grid_blocks(max_rows, sms)
            for rows in sorted({1, 2, 3, max_rows // 2 or 1, max_rows}):
                for cols in (1, 1000, 16384, 65536, 262144):
                    for mode in P.MODES:
                        for dtype in ("bfloat16", "float32"):
                            p = P.plan(rows, cols, dtype, mode, sms)
                            assert p.blocks <= lines, (sms, max_rows, rows, cols, mode)
                            assert p.shared_bytes <= P.DEFAULT_DYNAMIC_SHARED_LIMIT


def test_timeout_error_message_names_channel_epoch_and_ranks():
    msg = L.format_timeout_error(rank=0, channel=1, epoch=7, missing_mask=0b1010, timeout_s=2.5)
    assert "channel 1" in msg and "epoch 7" in msg and "ranks 1, 3" in msg and "2.5 s" in msg
    assert "rank 3 " not in L.format_timeout_error(0, 0, 1, 0b10, 1.0)
    assert "rank 1 within" in L.format_timeout_error(0, 0, 1, 0b10, 1.0)
    assert L.missing_ranks_from_mask(1 << 63 | 1) == [0, 63]
    own = L.format_timeout_error(rank=2, channel=0, epoch=9, missing_mask=0b100, timeout_s=30.0)
    assert "own fused kernel" in own and "epoch 9" in own and "rank 2" in own
    err = L.LLTimeoutError("m", 1, 7, [1, 3])
    assert isinstance(err, RuntimeError) and err.missing_ranks == [1, 3] and err.epoch == 7


def test_ll_argument_validation(monkeypatch):
    with pytest.raises(ValueError, match="max_rows"):
        L.validate_ll_arguments(0, 2, 2)
    with pytest.raises(ValueError, match="max_rows"):
        L.validate_ll_arguments(L.MAX_MAX_ROWS + 1, 2, 2)
    with pytest.raises(ValueError, match="max_rows"):
        L.validate_ll_arguments(True, 2, 2)
    with pytest.raises(ValueError, match="num_channels"):
        L.validate_ll_arguments(8, 0, 2)
    with pytest.raises(ValueError, match="ranks"):
        L.validate_ll_arguments(8, 2, 65)
    L.validate_ll_arguments(4096, 16, 64)
    for bad in (0, -1.0, float("inf"), float("nan"), "3", 1e-4, 1e7):
        with pytest.raises(ValueError, match="timeout"):
            L.resolve_timeout_s(bad)
    assert L.resolve_timeout_s(L.MIN_TIMEOUT_S) == L.MIN_TIMEOUT_S
    assert L.resolve_timeout_s(L.MAX_TIMEOUT_S) == L.MAX_TIMEOUT_S
    assert int(L.MAX_TIMEOUT_S * 1e9) < 2**63  # the kernel's wait budget fits its uint64 argument
    monkeypatch.setenv(L.TIMEOUT_ENV, "2.5")
    assert L.resolve_timeout_s(None) == 2.5
    assert L.resolve_timeout_s(1) == 1.0
    monkeypatch.setenv(L.TIMEOUT_ENV, "soon")
    with pytest.raises(ValueError, match=L.TIMEOUT_ENV):
        L.resolve_timeout_s(None)
    monkeypatch.delenv(L.TIMEOUT_ENV)
    assert L.resolve_timeout_s(None) == L.DEFAULT_TIMEOUT_S


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_ll_constructor_without_cuda_says_why():
    with pytest.raises(RuntimeError, match="CUDA"):
        L.LLKeyExchange(None)
    with pytest.raises(ValueError, match="max_rows"):
        L.LLKeyExchange(None, max_rows=0)


def test_ll_decision_is_deterministic_and_explains():
    assert ll_decision([("a", None), ("a", None)]) is None
    why = ll_decision([("a", None), ("b", None)])
    assert "2 nodes" in why and "a, b" in why
    why = ll_decision([("a", None), ("a", "cupy is not installed")])
    assert why == "rank 1: cupy is not installed"
    assert "not a CUDA device" in local_ll_blocker(torch.device("cpu"))


def test_factory_single_process_on_cpu():
    ex = make_key_exchange(None)
    assert isinstance(ex, AllGatherKeyExchange)
    with pytest.raises(RuntimeError, match="LL exchange is not available"):
        make_key_exchange(None, prefer="ll")
    with pytest.raises(ValueError, match="prefer"):
        make_key_exchange(None, prefer="fast")
    with pytest.raises(ValueError, match="unknown option"):
        make_key_exchange(None, max_row=4)
    # LL options are checked whatever the choice, and the fallback keeps the channel count.
    with pytest.raises(ValueError, match="max_rows"):
        make_key_exchange(None, max_rows=0)
    with pytest.raises(ValueError, match="timeout_s"):
        make_key_exchange(None, prefer="allgather", timeout_s=-1)
    wide = make_key_exchange(None, num_channels=4)
    assert isinstance(wide, AllGatherKeyExchange) and wide.NUM_CHANNELS == 4
    assert wide.max_keys(torch.zeros(2, dtype=torch.int64), channel=3).tolist() == [0, 0]


def _closed_ll_shell() -> L.LLKeyExchange:
    """A closed LLKeyExchange with no GPU state, for the host logic that runs before any launch."""
    ll = object.__new__(L.LLKeyExchange)
    KeyExchange.__init__(ll, None, 0, 1, torch.device("cpu"))
    ll.MAX_ROWS, ll.timeout_s, ll._closed = 4, 1.0, True
    ll._fallback = AllGatherKeyExchange()
    return ll


def test_a_closed_ll_exchange_refuses_calls_above_max_rows_too():
    # Rows above max_rows go to the all-gather fallback, but only after the closed and
    # timed-out checks: a dead exchange must not serve some calls and refuse others.
    ll = _closed_ll_shell()
    for rows in (2, 8):
        with pytest.raises(RuntimeError, match="closed"):
            ll.max_keys(torch.zeros(rows, dtype=torch.int64))
        with pytest.raises(RuntimeError, match="closed"):
            ll.argmax_tokens(torch.zeros(rows), torch.zeros(rows, dtype=torch.int64), 0)
        with pytest.raises(RuntimeError, match="closed"):
            ll.argmax_logits(torch.zeros(rows, 3), 0)


def _factory_worker(rank, world_size):
    from tpspec import distributed as D

    group = D.tp_group()
    auto = make_key_exchange(group, max_rows=16, timeout_s=1.0)
    try:
        make_key_exchange(group, prefer="ll")
        ll_error = None
    except RuntimeError as exc:
        ll_error = str(exc)
    # The factory's choice must still exchange correctly (a collective after the failed 'll').
    keys = K.pack_keys(torch.tensor([float(rank), -float(rank)]), torch.tensor([rank, rank]))
    best = auto.max_keys(keys)
    tokens = auto.argmax_logits(torch.tensor([[0.0, float(rank)]]), 2 * rank, vocab_size=2 * world_size)
    return type(auto).__name__, ll_error, K.unpack_indices(best).tolist(), tokens.tolist()


def test_factory_falls_back_to_allgather_on_gloo_cpu():
    results = run_ranks(_factory_worker, 2)
    for name, ll_error, best, tokens in results:
        assert name == "AllGatherKeyExchange"
        assert "rank 0:" in ll_error and "rank 1:" in ll_error
        assert best == [1, 0] and tokens == [3]


def test_mps_daemon_reports_when_binary_missing(monkeypatch, tmp_path):
    from tpspec import testing as B

    monkeypatch.setattr(B.shutil, "which", lambda name: None)
    monkeypatch.setenv(B.MPS_PIPE_ENV, str(tmp_path / "pipe"))
    monkeypatch.setenv(B.MPS_LOG_ENV, str(tmp_path / "log"))
    daemon = B.MPSDaemon()
    assert "not on PATH" in daemon.start()
    daemon.stop()  # nothing was started: a no-op


def _fake_mps_control(tmp_path, exit_code):
    """A stand-in for nvidia-cuda-mps-control (a unit test of MPSDaemon's logic only): it
    records its stdin and exits with ``exit_code``, as the real client does when it reaches
    the daemon (0) or not (non-zero)."""
    binary = tmp_path / "nvidia-cuda-mps-control"
    binary.write_text(f"#!/bin/sh\ncat >> {tmp_path / 'asked'}\nexit {exit_code}\n")
    binary.chmod(0o755)
    return str(binary)


@pytest.mark.parametrize("exit_code, running", [(0, True), (1, False)])
def test_mps_daemon_asks_the_daemon_instead_of_trusting_a_stale_pipe(monkeypatch, tmp_path, exit_code, running):
    from tpspec import testing as B

    binary = _fake_mps_control(tmp_path, exit_code)
    monkeypatch.setattr(B.shutil, "which", lambda name: binary if name == "nvidia-cuda-mps-control" else None)
    monkeypatch.delenv(B.MPS_PIPE_ENV, raising=False)
    monkeypatch.delenv(B.MPS_LOG_ENV, raising=False)
    daemon = B.MPSDaemon(pipe_dir=str(tmp_path / "pipe"), log_dir=str(tmp_path / "log"))
    assert not daemon.running()  # no pipe: nothing is asked
    assert not (tmp_path / "asked").exists()
    (tmp_path / "pipe").mkdir()
    (tmp_path / "pipe" / "control").write_text("")  # a pipe file, live or left behind
    assert daemon.running() is running
    assert (tmp_path / "asked").read_text() == "get_server_list\n"
    monkeypatch.setattr(B.shutil, "which", lambda name: None)
    assert daemon.running()  # no client to ask: the pipe decides, as before
