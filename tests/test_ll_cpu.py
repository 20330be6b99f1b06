"""What the CI (no GPU) can check of the LL exchange: the kernel source compiles for sm_90
with the flags NVRTC gets, its constants match the torch reference, and the host-side
logic (layout, chunking, errors, factory fallback) behaves."""

from __future__ import annotations

import re
import shutil
import subprocess

import numpy as np
import pytest
import torch

from tpspec import keys as K
from tpspec.exchange import AllGatherKeyExchange, cuda_module, make_key_exchange
from tpspec.exchange import ll as L
from tpspec.exchange.base import KeyExchange
from tpspec.exchange.factory import ll_decision, local_ll_blocker
from tpspec.testing import run_ranks


def _f32_bits(value: float) -> int:
    return int(np.float32(value).view(np.uint32))


# ------------------------------------------------------------------ the CUDA source

@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
def test_kernel_source_compiles_for_sm90(tmp_path):
    out = tmp_path / "ll_exchange.cubin"
    cmd = cuda_module.nvcc_command(out, arch="sm_90", kind="cubin")
    result = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path)
    assert result.returncode == 0, f"{' '.join(cmd)}\n{result.stdout}\n{result.stderr}"
    assert "warning" not in result.stderr.lower(), result.stderr
    blob = out.read_bytes()
    for name in cuda_module.KERNEL_NAMES:
        assert name.encode() in blob, f"kernel {name} missing from the cubin"


def test_source_constants_match_the_torch_reference():
    source = cuda_module.kernel_source()
    defines = {m.group(1): int(m.group(2), 16) for m in re.finditer(r"#define (\w+) 0x([0-9a-fA-F]+)u?", source)}
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
    )
    for name, value in expected.items():
        assert defines.get(name) == value, f"{name}: source has {defines.get(name)!r}, keys.py {value:#x}"
    assert f"#define LL_THREADS {cuda_module.THREADS_PER_BLOCK}" in source
    assert f"#define GUMBEL_TABLE_SIZE {2 * K.GUMBEL_BUCKETS_PER_HALF}" in source
    assert f"#define GUMBEL_SUB_BITS {K.GUMBEL_BUCKET_SUB_BITS}" in source
    for name, value in (("GUMBEL_ABS_ERROR", K.GUMBEL_BOUND_ABS_ERROR), ("GUMBEL_REL_ERROR", K.GUMBEL_BOUND_REL_ERROR)):
        assert float(re.search(rf"#define {name} ([0-9.e+-]+)f", source).group(1)) == value, name
    assert f"#define LL_MAX_WORLD {cuda_module.MAX_WORLD}" in source


def test_source_never_uses_multicast_or_fast_math():
    source = cuda_module.kernel_source()
    for banned in ("cuMulticast", "multimem", "__expf", "__logf", "__fdividef", "#include"):
        assert banned not in source, banned
    assert "--fmad=false" in cuda_module.compile_options()
    assert "-std=c++17" in cuda_module.compile_options()


def test_source_dir_env_override(tmp_path, monkeypatch):
    monkeypatch.setenv(cuda_module.SOURCE_ENV, str(tmp_path))
    assert cuda_module.source_dir() == tmp_path
    with pytest.raises(RuntimeError, match=cuda_module.SOURCE_ENV):
        cuda_module.kernel_source()
    (tmp_path / cuda_module.SOURCE_FILE).write_text("// empty")
    assert cuda_module.kernel_source() == "// empty"
    with pytest.raises(ValueError, match="kind"):
        cuda_module.nvcc_command(tmp_path / "x", kind="fatbin")


# ---------------------------------------------------------------- host-side logic

@pytest.mark.parametrize("sampled", [False, True])
@pytest.mark.parametrize("elem", [4, 2])
def test_plan_chunks_covers_rows_with_aligned_chunks(sampled, elem):
    for rows in (1, 3, 8, 64, 256, 1024):
        for cols in (0, 1, 7, 1000, 16384, 32000, 65536, 128256):
            chunk, chunks = L.plan_chunks(rows, cols, elem, 132, sampled)
            assert chunk % (32 * 16 // elem) == 0
            assert chunks >= 1 and chunk * chunks >= cols
            assert (chunks - 1) * chunk < max(cols, 1)  # no empty trailing chunk
            # One wave: a second, mostly idle wave of blocks measured slower on the H200.
            wave = (4 if sampled else 2) * 132
            assert rows * chunks <= max(wave, rows)
    # Small batches spread a row over many blocks.
    assert L.plan_chunks(1, 65536, 2, 132, False)[1] >= 32
    assert L.plan_chunks(256, 65536, 2, 132, False) == (65536, 1)


def test_sampled_calls_plan_two_blocks_an_sm_unless_four_make_chunks_fit_one_tile():
    tile = L.sampled_tile_columns(2)  # 4096 bf16 columns
    # Two an SM (264 blocks on 132 SMs) wherever that keeps the kernel, or neither count fits a tile.
    assert L.plan_chunks(8, 65536, 2, 132, True) == (2048, 32)  # 4 an SM would be 1024 x 64
    assert L.plan_chunks(32, 16384, 2, 132, True) == (2048, 8)
    assert L.plan_chunks(64, 16384, 2, 132, True) == (tile, 4)
    assert L.plan_chunks(256, 16384, 2, 132, True) == (16384, 1)  # 4 an SM: 8192, two tiles too
    assert L.plan_chunks(256, 65536, 2, 132, True) == (65536, 1)
    # Four an SM where only they fit one tile (the _one_tile kernels beat the plain one there).
    assert L.plan_chunks(128, 16384, 2, 132, True) == (tile, 4)
    assert L.plan_chunks(32, 65536, 2, 132, True) == (tile, 16)
    for rows in (1, 3, 8, 16, 32, 64, 100, 128, 256):
        for cols in (1000, 16384, 32768, 65536):
            for elem in (2, 4):
                chunk, chunks = L.plan_chunks(rows, cols, elem, 132, True)
                two = L._split_rows(rows, cols, elem, 2 * 132, 132, True)
                assert (chunk, chunks) == two or (two[0] > L.sampled_tile_columns(elem)
                                                  and chunk <= L.sampled_tile_columns(elem))


def test_the_gpu_wave_test_cases_still_need_more_than_one_wave():
    # test_ll_gpu's wave test asserts this at run time on the GPU; a change of plan that broke it
    # (session 19: 8 x 64K sampled fell to 128 blocks) should fail here, in CI, first.
    from test_ll_gpu import WAVE_CASES

    share = L.sms_per_rank(132, ["h200"] * 2, 0)
    for rows, width, sampled in WAVE_CASES:
        chunk, chunks = L.plan_chunks(rows, width, 2, share, sampled)
        assert rows * chunks > 132, (rows, width, sampled, chunk, chunks)


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
    for rows, cols, sampled in ((1, 16384, True), (8, 16384, True), (64, 16384, False), (256, 16384, True)):
        chunks = L.plan_chunks(rows, cols, 2, share, sampled)[1]
        assert 8 * rows * chunks <= max(8 * rows, (4 if sampled else 2) * 132)


def test_greedy_plans_give_each_block_whole_groups_and_no_more_blocks_than_needed():
    # GREEDY_GROUP_BYTES is what greedy_span loads together: 256 threads x 4 packs of 16 bytes.
    source = cuda_module.kernel_source()
    assert "const int UNROLL = 4;  // packs a group" in source
    assert L.GREEDY_GROUP_BYTES == cuda_module.THREADS_PER_BLOCK * 4 * 16
    for elem in (4, 2):
        for rows in (1, 2, 3, 8, 16, 64, 100, 256):
            for cols in (1000, 16384, 32000, 65536, 128256):
                chunk, chunks = L.plan_chunks(rows, cols, elem, 132, False)
                # A block reads at most a pack a thread, or whole groups (the row's last chunk aside).
                assert chunk * elem <= L.PACK_BYTES_PER_BLOCK or chunk * elem % L.GREEDY_GROUP_BYTES == 0
                assert rows * chunks <= max(rows, L.greedy_blocks(rows * cols * elem, 132))
    # Block counts: a block a group while that fits an SM each (at least half the SMs), then one
    # an SM up to two groups a block, then two an SM.
    assert L.greedy_blocks(32 * 1024, 132) == 66
    assert L.greedy_blocks(132 * L.GREEDY_GROUP_BYTES, 132) == 132
    assert L.greedy_blocks(4 * 1024 * 1024, 132) == 132
    assert L.greedy_blocks(8 * 1024 * 1024, 132) == 264
    # The plans timed on the H200 (session 14), bf16.
    assert L.plan_chunks(1, 16384, 2, 132, False) == (1024, 16)
    assert L.plan_chunks(8, 16384, 2, 132, False) == (2048, 8)
    assert L.plan_chunks(16, 16384, 2, 132, False) == (8192, 2)
    assert L.plan_chunks(4, 65536, 2, 132, False) == (8192, 8)
    assert L.plan_chunks(8, 65536, 2, 132, False) == (8192, 8)
    assert L.plan_chunks(64, 16384, 2, 132, False) == (8192, 2)
    assert L.plan_chunks(128, 16384, 2, 132, False) == (16384, 1)
    assert L.plan_chunks(64, 65536, 2, 132, False) == (16384, 4)


def test_plan_chunks_splits_small_sampled_calls_a_column_a_thread_at_one_block_an_sm():
    # At most one block an SM and a row's blocks within the _columns kernels' quick gather: a column a thread.
    assert L.plan_chunks(1, 16384, 2, 132, True) == (L.COLUMN_CHUNK, 64)
    assert L.plan_chunks(2, 16384, 4, 132, True) == (L.COLUMN_CHUNK, 64)
    assert L.plan_chunks(5, 8, 2, 132, True) == (L.COLUMN_CHUNK, 1)
    assert L.plan_chunks(1, 32768, 2, 132, True) == (L.COLUMN_CHUNK, 128)
    assert L.plan_chunks(1, 16384 + 256, 2, 132, True) == (L.COLUMN_CHUNK, 65)
    # Failing that, two columns a thread under the same limits (timed on the H200, session 15).
    assert L.COLUMNS_MAX_CHUNK == 2 * L.COLUMN_CHUNK
    assert L.plan_chunks(3, 16384, 2, 132, True) == (L.COLUMNS_MAX_CHUNK, 32)
    assert L.plan_chunks(4, 16384, 2, 132, True) == (L.COLUMNS_MAX_CHUNK, 32)
    assert L.plan_chunks(2, 32768, 2, 132, True) == (L.COLUMNS_MAX_CHUNK, 64)
    assert L.plan_chunks(1, 65536, 2, 132, True) == (L.COLUMNS_MAX_CHUNK, 128)
    assert L.plan_chunks(1, 16384, 2, 32, True) == (L.COLUMNS_MAX_CHUNK, 32)  # a GPU with fewer SMs
    # Beyond that the usual split: more blocks than SMs (8 x 16K: 0.8 us slower at a column a
    # thread, session 13; 0.17 us at two, session 15), or more chunks a row than the gather takes.
    assert L.plan_chunks(5, 16384, 2, 132, True) == (1024, 16)
    assert L.plan_chunks(8, 16384, 2, 132, True) == (1024, 16)
    assert L.plan_chunks(3, 32768, 2, 132, True) == (1024, 32)
    assert L.plan_chunks(2, 65536, 2, 132, True) == (1024, 64)
    assert L.plan_chunks(1, 131072, 2, 132, True) == (1024, 128)
    assert L.plan_chunks(1, 16384, 2, 16, True) == (1024, 16)
    for rows in range(1, 40):
        for cols in (8, 1000, 4099, 16384, 20000, 32768, 65536, 131072):
            for sms in (16, 78, 132):
                chunk, chunks = L.plan_chunks(rows, cols, 2, sms, True)
                if chunk <= L.COLUMNS_MAX_CHUNK:  # the _columns kernels' two limits hold
                    assert rows * chunks <= sms and chunks <= L.COLUMNS_GATHER_MAX_CHUNKS
    # Greedy calls never take it.
    assert L.plan_chunks(1, 16384, 2, 132, False) == (1024, 16)
    assert L.plan_chunks(4, 16384, 2, 132, False)[0] > L.COLUMNS_MAX_CHUNK


def test_fused_kernel_name_takes_the_one_tile_twin_only_when_every_chunk_fits_a_tile():
    source = cuda_module.kernel_source()
    assert f"#define SAMPLED_PACKS {L.SAMPLED_PACKS}" in source
    for dtype, elem in ((torch.bfloat16, 2), (torch.float16, 2), (torch.float32, 4)):
        tile = L.sampled_tile_columns(elem)
        assert tile == 256 * (16 // elem) * 2
        plain = L.fused_kernel_name(dtype, tile, sampled=False)
        assert plain in cuda_module.KERNEL_NAMES and not plain.endswith("_one_tile")
        assert L.fused_kernel_name(dtype, tile, sampled=True) == plain + "_one_tile"
        assert L.fused_kernel_name(dtype, tile + 32 * 16 // elem, sampled=True) == plain  # two tiles
        assert plain + "_one_tile" in cuda_module.KERNEL_NAMES
    # The pruned quads live only in the twins: every chunk they take must pick a twin.
    quads_max = int(re.search(r"^#define PRUNED_QUADS_MAX (\d+)", source, re.M).group(1))
    assert 4 * quads_max * cuda_module.THREADS_PER_BLOCK <= min(L.sampled_tile_columns(e) for e in (2, 4))
    # The bench's bf16 shapes on the H200 (132 SMs): small batches fit a tile per block.
    names = {(rows, cols): L.fused_kernel_name(torch.bfloat16, L.plan_chunks(rows, cols, 2, 132, True)[0], True)
             for rows in (1, 8, 64, 256) for cols in (16384, 65536)}
    assert {k for k, v in names.items() if v.endswith("_one_tile")} == {(8, 16384), (8, 65536), (64, 16384)}
    assert {k for k, v in names.items() if v.endswith("_columns")} == {(1, 16384), (1, 65536)}


def test_fused_kernel_name_takes_the_columns_twin_for_chunks_of_one_or_two_columns_a_thread():
    source = cuda_module.kernel_source()
    assert L.COLUMN_CHUNK == cuda_module.THREADS_PER_BLOCK
    assert f"#define ROW_GATHER_MAX_CHUNKS {L.ROW_GATHER_MAX_CHUNKS} " in source
    assert f"#define COLUMNS_GATHER_MAX_CHUNKS {L.COLUMNS_GATHER_MAX_CHUNKS} " in source
    # The _columns kernels gather 4 lines a lane (32 x 4 = 128 chunks), the others 2 (64).
    assert "gather_row_maxima<COLUMNS ? 4 : 2>" in source
    assert L.COLUMNS_GATHER_MAX_CHUNKS == 32 * 4 and L.ROW_GATHER_MAX_CHUNKS == 32 * 2
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        plain = L.fused_kernel_name(dtype, 1024, sampled=False)
        for chunk in (8, 128, L.COLUMN_CHUNK, L.COLUMNS_MAX_CHUNK):
            assert L.fused_kernel_name(dtype, chunk, sampled=True) == plain + "_columns"
            assert L.fused_kernel_name(dtype, chunk, sampled=False) == plain
        assert L.fused_kernel_name(dtype, L.COLUMNS_MAX_CHUNK + 128, sampled=True) == plain + "_one_tile"
        assert plain + "_columns" in cuda_module.KERNEL_NAMES
        assert re.search(rf"^LL_ARGMAX_LOGITS_KERNEL\({plain}_columns, \d, false, true\)", source, re.M)


def test_exchange_keys_kernel_polls_as_many_peer_lines_as_the_world_needs():
    source = cuda_module.kernel_source()
    batches = {name: int(b) for name, b in re.findall(r"^LL_EXCHANGE_KEYS_KERNEL\((\w+), (\d+)\)", source, re.M)}
    assert set(batches) == {n for n in cuda_module.KERNEL_NAMES if n.startswith("ll_exchange_keys")}
    picked = {world: batches[L.exchange_keys_kernel_name(world)] for world in range(1, cuda_module.MAX_WORLD + 1)}
    assert [picked[w] for w in range(1, 10)] == [1, 1, 4, 4, 4, 8, 8, 8, 8]
    assert all(picked[w] == 8 for w in range(9, cuda_module.MAX_WORLD + 1))


def test_buffer_layout_is_aligned_and_disjoint():
    for world, rows, channels, sms in ((1, 1, 1, 132), (2, 1024, 2, 132), (8, 333, 3, 1), (64, 4096, 16, 200)):
        blocks = L.max_grid_blocks(rows, sms)
        lay = L.BufferLayout(world, rows, channels, blocks)
        assert lay.slots_offset % 256 == 0 and lay.slots_offset >= L.CTRL_BYTES * channels
        assert lay.block_lines_offset == lay.slots_offset + channels * 2 * world * rows * 16
        assert lay.block_lines_offset % 16 == 0
        assert lay.total_bytes == lay.block_lines_offset + channels * blocks * 16
        assert lay.slots(1000, channels - 1) + lay.slot_channel_bytes == 1000 + lay.block_lines_offset
        assert lay.block_lines(1000, channels - 1) + blocks * 16 == 1000 + lay.total_bytes
        # Peers address the slots of each other's buffers with their own layout: the slot
        # offsets must not depend on the GPU (its SM count sizes only the block lines).
        other = L.BufferLayout(world, rows, channels, L.max_grid_blocks(rows, 2 * sms))
        assert other.slots(0, channels - 1) == lay.slots(0, channels - 1)


def test_every_planned_grid_fits_the_block_lines():
    for sms in (1, 16, 132, 200):
        for max_rows in (1, 64, 1024, 4096):
            lines = L.max_grid_blocks(max_rows, sms)
            for rows in sorted({1, 2, 3, max_rows // 2 or 1, max_rows}):
                for cols in (1, 1000, 16384, 65536, 262144):
                    for sampled in (False, True):
                        for elem in (2, 4):
                            chunk, chunks = L.plan_chunks(rows, cols, elem, sms, sampled)
                            assert rows * chunks <= lines, (sms, max_rows, rows, cols, sampled)
                            # The launch asks for no more shared memory than any GPU grants by default.
                            shared = L.fused_shared_bytes(rows, chunks)
                            assert 8 * rows <= shared <= L.DEFAULT_DYNAMIC_SHARED_LIMIT
                            if chunks > 1:
                                assert shared == 8 * (rows + rows * chunks)
    assert L.max_grid_blocks(1, 132) == 4 * 132 and L.max_grid_blocks(4096, 132) == 4096
    assert L.fused_shared_bytes(L.MAX_MAX_ROWS, 1) == 8 * L.MAX_MAX_ROWS


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
