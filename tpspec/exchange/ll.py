"""``LLKeyExchange``: the cross-rank key max through CUDA IPC peer memory.

Each rank ``cudaMalloc``s one buffer (control blocks, the LL slots and the fused
kernel's block lines of every channel), shares it by CUDA IPC handle over the process
group once (any backend: gloo is enough), and opens its peers' handles. One kernel launch
per call reduces the rank's keys (the fused kernel's blocks hand theirs to one of them, the
collector, through the block lines), writes them into every rank's slots with 16-byte
``{key_lo, epoch, key_hi, epoch}`` stores, waits for every rank's lines (bounded by
``timeout_s``), reduces and writes the result. See ``csrc/ll_exchange/ll_exchange.cu``.

Results are bit-identical to :class:`~tpspec.exchange.allgather.AllGatherKeyExchange`;
calls with more than ``max_rows`` rows go through an all-gather over the same group
(same results, not graph-capturable with gloo).

A timed-out wait poisons the channel: the kernel records the epoch and the missing
ranks in host-mapped memory and every later call raises :class:`LLTimeoutError`
(``check()`` raises it too). Close the exchange and build a new one after that.
"""

from __future__ import annotations

import ctypes
import math
import os
import socket
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .. import distributed as D
from .. import keys as K
from ..validation import check_int, is_real
from . import cuda_module
from .allgather import AllGatherKeyExchange
from .base import UNSEEDED_STREAM_SEED, KeyExchange

DEFAULT_MAX_ROWS = 1024
MAX_MAX_ROWS = 4096  # the kernels keep one key per row in shared memory (32 KiB)
MAX_CHANNELS = 16
DEFAULT_TIMEOUT_S = 30.0
MIN_TIMEOUT_S = 1e-3  # below a scheduling hiccup every wait would give up
MAX_TIMEOUT_S = 1e6  # ~11.6 days; far inside the kernel's uint64 nanosecond count
TIMEOUT_ENV = "TPSPEC_LL_TIMEOUT_S"

CTRL_BYTES = 64  # ChannelCtrl in the source
SLOT_BYTES = 16  # one LL line
HOST_ERROR_BYTES = 16  # HostError in the source
_CUDA_HOST_ALLOC_PORTABLE_MAPPED = 0x1 | 0x2
_CUDA_IPC_LAZY_PEER_ACCESS = 0x1
_CUDA_MEMCPY_HOST_TO_DEVICE = 1


class LLTimeoutError(RuntimeError):
    """A rank's keys did not arrive within the timeout (a rank skipped a call, hung or died)."""

    def __init__(self, message: str, channel: int, epoch: int, missing_ranks: list[int]) -> None:
        super().__init__(message)
        self.channel = channel
        self.epoch = epoch
        self.missing_ranks = missing_ranks


def missing_ranks_from_mask(mask: int) -> list[int]:
    """Rank indices of the set bits of a 64-bit mask."""
    return [bit for bit in range(64) if (mask >> bit) & 1]


def format_timeout_error(rank: int, channel: int, epoch: int, missing_mask: int, timeout_s: float) -> str:
    """The message of :class:`LLTimeoutError`. The mask names this rank itself when blocks of
    its own fused kernel never handed over their keys (then it published nothing)."""
    if (missing_mask >> rank) & 1:
        return (
            f"LL key exchange timed out on rank {rank}: channel {channel}, epoch {epoch}: blocks of this "
            f"rank's own fused kernel did not finish within {timeout_s:g} s (the GPU is oversubscribed or "
            f"hung), so it published no keys and its peers time out on it. The exchange is unusable now: "
            f"close it and build a new one."
        )
    missing = missing_ranks_from_mask(missing_mask)
    who = "rank" if len(missing) == 1 else "ranks"
    listed = ", ".join(str(r) for r in missing) or "?"
    return (
        f"LL key exchange timed out on rank {rank}: channel {channel}, epoch {epoch}: no keys from {who} "
        f"{listed} within {timeout_s:g} s. A rank skipped a collective exchange call, hung or died "
        f"(every rank must make the same calls in the same order). The exchange is unusable now: close it "
        f"and build a new one."
    )


def resolve_timeout_s(timeout_s: float | None) -> float:
    """``timeout_s``, else ``$TPSPEC_LL_TIMEOUT_S``, else 30 s; must lie in
    ``[MIN_TIMEOUT_S, MAX_TIMEOUT_S]`` (the kernel counts it in uint64 nanoseconds)."""
    if timeout_s is None:
        env = os.environ.get(TIMEOUT_ENV)
        if env:
            try:
                timeout_s = float(env)
            except ValueError:
                raise ValueError(f"{TIMEOUT_ENV}={env!r} is not a number") from None
        else:
            timeout_s = DEFAULT_TIMEOUT_S
    if not is_real(timeout_s):
        raise ValueError(f"timeout_s must be a number, got {type(timeout_s).__name__}")
    if not math.isfinite(timeout_s) or not MIN_TIMEOUT_S <= timeout_s <= MAX_TIMEOUT_S:
        raise ValueError(f"timeout_s must lie in [{MIN_TIMEOUT_S}, {MAX_TIMEOUT_S:g}] seconds, got {timeout_s}")
    return float(timeout_s)


def validate_ll_arguments(max_rows: Any, num_channels: Any, world_size: int) -> None:
    """Raise ``ValueError`` for arguments the LL exchange cannot serve."""
    check_int("max_rows", max_rows, low=1, high=MAX_MAX_ROWS)
    check_int("num_channels", num_channels, low=1, high=MAX_CHANNELS)
    if not 1 <= world_size <= cuda_module.MAX_WORLD:
        raise ValueError(f"the LL exchange serves 1 to {cuda_module.MAX_WORLD} ranks, the group has {world_size}")


def sms_per_rank(num_sms: int, devices: list[str], rank: int) -> int:
    """SMs a rank plans its fused grids for: its GPU's ``num_sms`` shared among the ranks
    whose ``devices`` entry (one per rank of the group: its GPU's UUID) equals its own.

    With one GPU a rank (a deployment) every rank plans for the whole GPU. Ranks that share a
    GPU (the one-GPU benchmarks and tests) would otherwise each plan a whole-GPU grid, and
    their grids, launched together, would run as several waves; each plans for its share
    instead. Only the grid depends on it, never a key, so ranks may differ."""
    sharing = sum(1 for device in devices if device == devices[rank])
    return max(1, num_sms // max(1, sharing))


def max_grid_blocks(max_rows: int, num_sms: int) -> int:
    """The most blocks a fused call of up to ``max_rows`` rows launches (see :func:`plan_chunks`)."""
    return max(max_rows, SAMPLED_BLOCKS_PER_SM * max(1, num_sms))


@dataclass(frozen=True)
class BufferLayout:
    """Byte offsets inside one rank's exchange buffer (the IPC-shared allocation).

    ``[ctrl: 64 B per channel][slots: per channel][block lines: per channel]``. Peers address
    only the slots, whose offsets depend on ``world_size``, ``max_rows`` and ``num_channels``
    alone (equal on every rank); the block lines, sized by this GPU's ``max_blocks``, come last.
    """

    world_size: int
    max_rows: int
    num_channels: int
    max_blocks: int

    @property
    def ctrl_offset(self) -> int:
        return 0

    @property
    def slots_offset(self) -> int:
        end = CTRL_BYTES * self.num_channels
        return (end + 255) // 256 * 256

    @property
    def slot_channel_bytes(self) -> int:
        """Slots of one channel: [parity 2][source rank][row] lines of 16 bytes."""
        return 2 * self.world_size * self.max_rows * SLOT_BYTES

    @property
    def block_lines_offset(self) -> int:
        return self.slots_offset + self.num_channels * self.slot_channel_bytes

    @property
    def block_lines_channel_bytes(self) -> int:
        """Block lines of one channel: one 16-byte line per block of a fused call."""
        return self.max_blocks * SLOT_BYTES

    @property
    def total_bytes(self) -> int:
        return self.block_lines_offset + self.num_channels * self.block_lines_channel_bytes

    def ctrl(self, base: int, channel: int) -> int:
        return base + self.ctrl_offset + CTRL_BYTES * channel

    def slots(self, base: int, channel: int) -> int:
        return base + self.slots_offset + self.slot_channel_bytes * channel

    def block_lines(self, base: int, channel: int) -> int:
        return base + self.block_lines_offset + self.block_lines_channel_bytes * channel


GREEDY_BLOCKS_PER_SM = 2
SAMPLED_BLOCKS_PER_SM = 4  # the most a sampled call plans (see plan_chunks)
SAMPLED_BLOCKS_PER_SM_FIRST = 2  # what it plans unless 4 make its chunks fit one tile
MIN_CHUNK = 1024
COLUMN_CHUNK = cuda_module.THREADS_PER_BLOCK  # a column a thread: the _columns kernels
COLUMNS_MAX_CHUNK = 2 * COLUMN_CHUNK  # the _columns kernels' largest planned chunk: two columns a thread
ROW_GATHER_MAX_CHUNKS = 64  # ROW_GATHER_MAX_CHUNKS in the source: the collector's quick gather (small batches)
COLUMNS_GATHER_MAX_CHUNKS = 128  # COLUMNS_GATHER_MAX_CHUNKS in the source: the same in the _columns kernels
PACK_BYTES_PER_BLOCK = 16 * cuda_module.THREADS_PER_BLOCK  # a 16-byte pack a thread
GREEDY_GROUP_BYTES = 4 * PACK_BYTES_PER_BLOCK  # greedy_span in the source: UNROLL = 4 packs a thread, loaded together


def plan_chunks(rows: int, cols: int, elem_bytes: int, num_sms: int, sampled: bool) -> tuple[int, int]:
    """Split each row of the fused kernel over blocks: ``(chunk columns, chunks per row)``.

    At most one wave of blocks: ``greedy_blocks`` for greedy calls (at most 2 an SM);
    sampled ones ``SAMPLED_BLOCKS_PER_SM_FIRST`` (2) an SM, or ``SAMPLED_BLOCKS_PER_SM`` (4)
    when those make every chunk fit one tile (``sampled_tile_columns``: the ``_one_tile``
    kernels) and 2 do not. Fewer, larger sampled blocks won wherever the kernel stays the
    same (H200, session 19, Gumbel us: 8 x 64K 6.0 -> 5.0, 32 x 16K 6.3 -> 5.4, 64 x 16K 7.5
    -> 6.9, 256 x 16K 14.6 -> 13.8); where 2 an SM would trade the ``_one_tile`` kernel for
    the plain one it lost (128 x 16K 9.6 -> 9.9, 32 x 64K 9.8 -> 10.0). Blocks per row are
    rounded down so a second, mostly idle wave never starts (for speed: the kernel's
    collector is its last block, so a grid need not fit the GPU at once). So ``rows *
    chunks`` never exceeds ``max_grid_blocks(rows, num_sms)``. On the H200 rounding down
    beat rounding up (greedy 256 x 64K bf16: 14.6 -> 12.1 us; Gumbel 256 x 64K: 43.5 -> 40.7
    us). Small batches still spread each row over many blocks (at least 1024 columns each).
    A greedy chunk of more than a pack a thread is whole groups of ``greedy_span``'s loads
    (``GREEDY_GROUP_BYTES``); the packs short of a group are loaded one after another.
    Sampled calls small enough to take a block of ``COLUMN_CHUNK`` columns per SM or fewer
    (and at most ``COLUMNS_GATHER_MAX_CHUNKS`` a row) get exactly that: the ``_columns``
    kernels then score a column a thread, one score on each thread's chain of dependent
    steps (H200, session 14: Gumbel 1 x 16K 3.6 -> 3.0 us, 2 x 16K 3.8-4.0 -> 3.3; with four
    blocks an SM, 8 x 16K, the same split was 0.8 us slower in session 13). Failing that,
    chunks of ``COLUMNS_MAX_CHUNK`` (two columns a thread) under the same two limits. See
    ``columns_kernel_chunk`` for what each step gained. Chunks are multiples of a warp's
    16-byte loads, so vector loads stay aligned and quads stay Philox blocks.
    """
    sms = max(1, num_sms)
    if not sampled:
        return _split_rows(rows, cols, elem_bytes, greedy_blocks(rows * max(cols, 1) * elem_bytes, sms), sms, False)
    plan = _split_rows(rows, cols, elem_bytes, SAMPLED_BLOCKS_PER_SM_FIRST * sms, sms, True)
    tile = sampled_tile_columns(elem_bytes)
    if plan[0] > tile:
        more = _split_rows(rows, cols, elem_bytes, SAMPLED_BLOCKS_PER_SM * sms, sms, True)
        if more[0] <= tile:
            return more
    return plan


def _split_rows(rows: int, cols: int, elem_bytes: int, blocks: int, sms: int, sampled: bool) -> tuple[int, int]:
    """``plan_chunks``'s split for a budget of ``blocks`` blocks."""
    vec = 16 // elem_bytes
    per_row = max(1, blocks // max(1, rows))
    columns_chunk = columns_kernel_chunk(rows, cols, sms) if sampled else 0
    chunk = columns_chunk or max(-(-max(cols, 1) // per_row), MIN_CHUNK)
    quantum = 32 * vec
    if not sampled and chunk * elem_bytes > PACK_BYTES_PER_BLOCK:
        # Whole groups: a thread's last packs short of a group are loaded one after another.
        quantum = GREEDY_GROUP_BYTES // elem_bytes
    chunk = -(-chunk // quantum) * quantum
    chunks = max(1, -(-cols // chunk))
    return chunk, chunks


def columns_kernel_chunk(rows: int, cols: int, num_sms: int) -> int:
    """The chunk of a sampled call for the ``_columns`` kernels (a column a thread, else two),
    or 0 when neither fits at most a block an SM and ``COLUMNS_GATHER_MAX_CHUNKS`` a row.

    The limits, H200 Gumbel (us): past one block an SM, 8 x 16K at two columns a thread
    took 4.32 against 4.15 with the usual quad a thread (session 15), and at a column a
    thread 0.8 slower (session 13). Two columns a thread: 3 x 16K 3.83-3.92 -> 3.57-3.79,
    4 x 16K 3.92-4.00 -> 3.67-3.82, 2 x 32K 3.98-4.02 -> 3.71-3.86 (session 15). The
    _columns kernels' quick gather of up to 128 chunks a row (a plain gather of a row's 128
    lines made 1 x 64K 3.59 -> 3.92): 1 x 32K 3.41 -> 3.15 (a column a thread instead of
    two), 1 x 64K 3.78 -> 3.60, at a cost of 3.02 -> 3.07 at 1 x 16K (session 15)."""
    for chunk in (COLUMN_CHUNK, COLUMNS_MAX_CHUNK):
        chunks = -(-max(cols, 1) // chunk)
        if chunks <= COLUMNS_GATHER_MAX_CHUNKS and rows * chunks <= num_sms:
            return chunk
    return 0


def greedy_blocks(nbytes: int, num_sms: int) -> int:
    """Blocks for a greedy call reading ``nbytes`` of logits on ``num_sms`` SMs.

    A greedy block loads a group (``GREEDY_GROUP_BYTES``) in one go, so a block per group is
    enough while that fits one block an SM (at least half the SMs, so small calls still
    read from many SMs); one block an SM until blocks would read more than two groups each;
    then two an SM, whose extra warps keep HBM busy. Every block beyond that only adds its
    own start and hand-off. H200, session 14 (greedy, TP=1, us): 8 x 64K 3.55-3.77 ->
    3.25-3.28, 16 x 16K 3.62-3.80 -> 3.15-3.31, 64 x 16K 4.37-4.44 -> 3.88-3.98, 128 x 16K
    4.76-4.85 -> 4.49-4.58; calls of 8 MiB and more keep two blocks an SM (one: 64 x 64K
    5.7 -> 6.2).
    """
    groups = -(-nbytes // GREEDY_GROUP_BYTES)
    if groups <= num_sms:
        return max(num_sms // 2, groups)
    if nbytes <= 2 * GREEDY_GROUP_BYTES * num_sms:
        return num_sms
    return GREEDY_BLOCKS_PER_SM * num_sms


DEFAULT_DYNAMIC_SHARED_LIMIT = 48 * 1024  # what a launch may ask for without opting in


def fused_shared_bytes(rows: int, chunks: int) -> int:
    """Dynamic shared memory of a fused launch: a key per row, and in the collector a key
    per block when rows span several blocks (see argmax_logits_impl in the source)."""
    return 8 * rows * (1 + chunks if chunks > 1 else 1)


_DTYPE_KERNELS = {
    torch.float32: ("ll_argmax_logits_f32", 0),
    torch.bfloat16: ("ll_argmax_logits_bf16", 1),
    torch.float16: ("ll_argmax_logits_f16", 2),
}


def exchange_keys_kernel_name(world: int) -> str:
    """The ``max_keys`` / ``argmax_tokens`` kernel for a world size: each polls as many peer
    lines at once as the world needs (1 for 1-2 ranks, 4 for 3-5, 8 beyond), and each world
    runs only its own wait loop (one kernel holding all three measured slower at TP=8)."""
    return "ll_exchange_keys_1" if world <= 2 else ("ll_exchange_keys_4" if world <= 5 else "ll_exchange_keys_8")


SAMPLED_PACKS = 2  # SAMPLED_PACKS in the source: 16-byte packs a thread takes per tile of a sampled row


def sampled_tile_columns(elem_bytes: int) -> int:
    """Columns one tile of a sampled row covers: every thread of a block, SAMPLED_PACKS packs each."""
    return cuda_module.THREADS_PER_BLOCK * (16 // elem_bytes) * SAMPLED_PACKS


def fused_kernel_name(dtype: torch.dtype, chunk: int, sampled: bool) -> str:
    """The fused kernel of a call: its dtype's; for a call with sampled rows, its ``_columns``
    twin when chunks hold at most two columns a thread (``COLUMNS_MAX_CHUNK``), else its
    ``_one_tile`` twin when every chunk fits one tile. The ``_one_tile`` twin's sampled
    blocks take the block's bound before listing columns (a barrier between passes; H200:
    1 x 64K Gumbel 6.0 -> 5.5 us), or, when chunks are at most 2048 columns (one or two
    quads a thread: ``PRUNED_QUADS_MAX`` in the source), prune within each warp with no barrier and no
    list (session 19: 64 x 16K 9.4 -> 7.3 us, 8 x 64K 6.5 -> 6.0 at the same grid). The
    barrier inside the tile loop cost registers, so blocks of several tiles keep the plain
    kernel. The ``_columns`` twin scores a column at a time on each thread; it is a kernel of
    its own so that the others' code stays as measured (a one-line change inside
    ``_one_tile`` cost 8 x 64K 0.15 us). All give the same keys."""
    name = _DTYPE_KERNELS[dtype][0]
    if sampled and chunk <= COLUMNS_MAX_CHUNK:
        return name + "_columns"
    return name + "_one_tile" if sampled and chunk <= sampled_tile_columns(dtype.itemsize) else name


def _p(value: int) -> np.uint64:
    return np.uint64(value)


class LLKeyExchange(KeyExchange):
    """Peer-memory exchange for the ranks of ``group`` on one node (collective constructor).

    ``max_rows``: rows a call may have on the LL path (more go through an all-gather);
    ``num_channels``: independent slot sets (0 = draft, 1 = target, ...); ``timeout_s``:
    how long a kernel waits for a peer before it gives up (default 30 s or
    ``$TPSPEC_LL_TIMEOUT_S``); ``device``: the CUDA device (default: the current one).

    Every call launches on ``torch.cuda.current_stream()`` and is CUDA-graph capturable
    (rows <= ``max_rows``). Calls on one channel must be stream-ordered; different
    channels may overlap. Raises ``RuntimeError`` on every rank when any rank cannot
    set up (no cupy, compile error, IPC failure, ranks on several nodes).

    ``plan_sms``: the SMs this rank plans its fused grids for (:func:`sms_per_rank`: the
    GPU's, shared among the group's ranks on the same GPU).
    """

    def __init__(
        self,
        group: Any = None,
        *,
        max_rows: int = DEFAULT_MAX_ROWS,
        num_channels: int = 2,
        timeout_s: float | None = None,
        device: str | torch.device | None = None,
    ) -> None:
        world_size = D.group_size(group)
        validate_ll_arguments(max_rows, num_channels, world_size)
        self.timeout_s = resolve_timeout_s(timeout_s)
        if not torch.cuda.is_available():
            raise RuntimeError("the LL exchange needs a CUDA device")
        device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
        if device.type != "cuda":
            raise ValueError(f"the LL exchange works on a CUDA device, got {device}")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        super().__init__(group, D.group_rank(group), world_size, device, num_channels=num_channels)
        self.MAX_ROWS = max_rows
        self._num_sms = int(torch.cuda.get_device_properties(device).multi_processor_count)
        self.plan_sms = self._num_sms  # _setup divides it among ranks on this GPU; block lines fit the whole GPU
        self.layout = BufferLayout(world_size, max_rows, num_channels, max_grid_blocks(max_rows, self._num_sms))
        self._closed = False
        self._base = 0
        self._host_error = 0
        self._opened: list[int] = []
        self._streams: dict[int, Any] = {}
        self._cupy: Any = None
        try:
            self._setup()
        except BaseException:
            self._release(barrier=False)
            self._closed = True
            raise
        self._fallback = AllGatherKeyExchange(group, device=device, num_channels=num_channels)

    # ------------------------------------------------------------------ set-up
    def _gather_ok(self, error: str | None, payload: Any = None) -> list[Any]:
        """All-gather ``(error, payload)``; raise on every rank if any rank failed."""
        gathered = D.all_gather_object((error, payload), self.group)
        failures = [(r, e) for r, (e, _) in enumerate(gathered) if e is not None]
        if failures:
            detail = "; ".join(f"rank {r}: {e}" for r, e in failures)
            raise RuntimeError(f"LL exchange set-up failed ({detail})")
        return [p for _, p in gathered]

    def _setup(self) -> None:
        index = self.device.index
        # Rank 0 compiles first so the others load cupy's on-disk cache.
        error = None
        if self.rank == 0:
            error = self._try(lambda: cuda_module.load_module(index))
        self._gather_ok(error)
        if self.rank != 0:
            error = self._try(lambda: cuda_module.load_module(index))
        # Every step that can fail runs inside _try and is reported through _gather_ok, so a
        # failure on one rank raises on all of them instead of leaving peers in a collective.
        handle: list[Any] = [None]
        if error is None:
            error = self._try(lambda: self._allocate(handle))
        # The GPU's UUID (a MIG instance has its own) tells which ranks share this GPU.
        gpu = str(torch.cuda.get_device_properties(self.device).uuid)
        payloads = self._gather_ok(error, (socket.gethostname(), handle[0], gpu))
        hosts = sorted({host for host, _, _ in payloads})
        if len(hosts) > 1:
            raise RuntimeError(f"LL exchange needs every rank on one node, the group spans {hosts}")
        self.plan_sms = sms_per_rank(self._num_sms, [uuid for _, _, uuid in payloads], self.rank)
        error = self._try(lambda: self._open_peers(payloads))
        self._gather_ok(error)

    def _open_peers(self, payloads: list[Any]) -> None:
        """Open the peers' buffers, build the slot table and load the kernels."""
        bases = [0] * self.world_size
        bases[self.rank] = self._base  # a process cannot open its own handle
        rt = self._cupy.cuda.runtime
        with self._cupy.cuda.Device(self.device.index):
            for r, (_, handle, _) in enumerate(payloads):  # (host, IPC handle, GPU UUID)
                if r == self.rank:
                    continue
                ptr = rt.ipcOpenMemHandle(handle, _CUDA_IPC_LAZY_PEER_ACCESS)
                self._opened.append(ptr)
                bases[r] = ptr
            table = [self.layout.slots(bases[r], ch) for ch in range(self.NUM_CHANNELS) for r in range(self.world_size)]
            self._peer_slots = torch.tensor(table, dtype=torch.int64, device=self.device)
            self._gumbel_table = K.gumbel_bound_table(self.device)  # the sampled rows' pruning bounds
            self._module = cuda_module.load_module(self.device.index)
            self._kernels = {name: self._module.get_function(name) for name in cuda_module.KERNEL_NAMES}
        self._exchange_kernel = exchange_keys_kernel_name(self.world_size)  # max_keys / argmax_tokens

    @staticmethod
    def _try(fn: Any) -> str | None:
        try:
            fn()
            return None
        except Exception as exc:  # noqa: BLE001 - reported to every rank
            return f"{type(exc).__name__}: {exc}"

    def _allocate(self, handle: list[Any]) -> None:
        """Allocate and zero this rank's buffer and error words; ``handle[0]`` = its IPC handle."""
        import cupy

        self._cupy = cupy
        rt = cupy.cuda.runtime
        with cupy.cuda.Device(self.device.index):
            self._base = rt.malloc(self.layout.total_bytes)
            rt.memset(self._base, 0, self.layout.total_bytes)
            ctrl = np.zeros(CTRL_BYTES // 4 * self.NUM_CHANNELS, dtype=np.uint32)
            ctrl[:: CTRL_BYTES // 4] = 1  # first epoch of every channel; slots hold 0 = never written
            rt.memcpy(self.layout.ctrl(self._base, 0), ctrl.ctypes.data, ctrl.nbytes, _CUDA_MEMCPY_HOST_TO_DEVICE)
            self._host_error = rt.hostAlloc(HOST_ERROR_BYTES * self.NUM_CHANNELS, _CUDA_HOST_ALLOC_PORTABLE_MAPPED)
            ctypes.memset(self._host_error, 0, HOST_ERROR_BYTES * self.NUM_CHANNELS)
            rt.deviceSynchronize()
            handle[0] = rt.ipcGetMemHandle(self._base)

    # ----------------------------------------------------------------- errors
    def _error_record(self, channel: int) -> tuple[int, int, int]:
        address = self._host_error + HOST_ERROR_BYTES * channel
        flag = ctypes.c_uint32.from_address(address).value
        epoch = ctypes.c_uint32.from_address(address + 4).value
        missing = ctypes.c_uint64.from_address(address + 8).value
        return flag, epoch, missing

    def _raise_if_failed(self) -> None:
        if self._closed:
            raise RuntimeError("this LL key exchange is closed")
        for channel in range(self.NUM_CHANNELS):
            flag, epoch, missing = self._error_record(channel)
            if flag:
                raise LLTimeoutError(
                    format_timeout_error(self.rank, channel, epoch, missing, self.timeout_s),
                    channel,
                    epoch,
                    missing_ranks_from_mask(missing),
                )

    def check(self, *, sync: bool = True) -> None:
        """Raise :class:`LLTimeoutError` if a wait on any channel timed out. With ``sync``
        (default) first waits for the work queued on the current stream."""
        if sync and not self._closed:
            torch.cuda.current_stream(self.device).synchronize()
        self._raise_if_failed()

    # ----------------------------------------------------------------- launch
    def _exchange_args(self, channel: int) -> tuple:
        return (
            _p(self.layout.ctrl(self._base, channel)),
            _p(self.layout.block_lines(self._base, channel)),
            np.int32(self.layout.max_blocks),
            _p(self._peer_slots.data_ptr() + 8 * self.world_size * channel),
            _p(self._host_error + HOST_ERROR_BYTES * channel),
            np.int32(self.rank),
            np.int32(self.world_size),
            np.int32(self.MAX_ROWS),
            np.uint64(int(self.timeout_s * 1e9)),
        )

    def _launch(self, name: str, blocks: int, shared_bytes: int, args: tuple) -> None:
        # Read the current stream at every launch: under torch.cuda.graph it is the capture stream.
        stream_ptr = torch.cuda.current_stream(self.device).cuda_stream
        stream = self._streams.get(stream_ptr)
        if stream is None:
            stream = self._cupy.cuda.ExternalStream(stream_ptr, self.device.index)
            self._streams[stream_ptr] = stream
        # The kernels live in this device's context: launch there even when the caller's
        # current device is another one (a no-op in the usual one-device-per-process case).
        with torch.cuda.device(self.device.index):
            self._kernels[name]((blocks,), (cuda_module.THREADS_PER_BLOCK,), args, shared_mem=shared_bytes,
                                stream=stream)

    # ------------------------------------------------------------------ calls
    def max_keys(self, keys: torch.Tensor, *, channel: int = 0) -> torch.Tensor:
        self._check_rows_vector("keys", keys, None)
        if keys.dtype != torch.int64:
            raise ValueError(f"keys must be int64, got {keys.dtype}")
        self.check_channel(channel)
        self._raise_if_failed()  # before the fallback too: a closed or poisoned exchange serves no call
        rows = keys.shape[0]
        if rows > self.MAX_ROWS:
            return self._fallback.max_keys(keys, channel=channel)
        if rows == 0:
            return keys.clone()
        keys = keys.contiguous()
        out = torch.empty(rows, dtype=torch.int64, device=self.device)
        null = _p(0)
        args = (np.int32(0), _p(keys.data_ptr()), null, np.int32(0), null, np.int32(0), np.int64(0),
                np.int32(rows), _p(out.data_ptr()), np.int32(0), *self._exchange_args(channel))
        self._launch(self._exchange_kernel, 1, 8 * rows, args)
        return out

    def argmax_tokens(
        self, local_max: torch.Tensor, local_argmax: torch.Tensor, vocab_offset: int, *, channel: int = 0
    ) -> torch.Tensor:
        self._check_rows_vector("local_max", local_max, None)
        self._check_rows_vector("local_argmax", local_argmax, local_max.shape[0])
        if local_argmax.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"local_argmax must be int32 or int64, got {local_argmax.dtype}")
        self._check_offset(vocab_offset)
        if local_max.dtype not in K.SUPPORTED_VALUE_DTYPES:
            raise ValueError(f"values must be float32, bfloat16 or float16, got {local_max.dtype}")
        self.check_channel(channel)
        self._raise_if_failed()
        rows = local_max.shape[0]
        if rows > self.MAX_ROWS:
            return super().argmax_tokens(local_max, local_argmax, vocab_offset, channel=channel)
        if rows == 0:
            return torch.empty(0, dtype=torch.int64, device=self.device)
        local_max = local_max.contiguous()
        local_argmax = local_argmax.contiguous()
        out = torch.empty(rows, dtype=torch.int64, device=self.device)
        args = (np.int32(1), _p(0), _p(local_max.data_ptr()), np.int32(_DTYPE_KERNELS[local_max.dtype][1]),
                _p(local_argmax.data_ptr()), np.int32(local_argmax.dtype == torch.int64), np.int64(vocab_offset),
                np.int32(rows), _p(out.data_ptr()), np.int32(1), *self._exchange_args(channel))
        self._launch(self._exchange_kernel, 1, 8 * rows, args)
        return out

    def argmax_logits(
        self,
        logits: torch.Tensor,
        vocab_offset: int,
        *,
        vocab_size: int | None = None,
        temperature: torch.Tensor | None = None,
        seeds: torch.Tensor | None = None,
        offsets: torch.Tensor | None = None,
        greedy_threshold: float = K.GREEDY_TEMPERATURE_THRESHOLD,
        channel: int = 0,
    ) -> torch.Tensor:
        """See :meth:`KeyExchange.argmax_logits`; one kernel launch when rows <= ``max_rows``."""
        return self._fused(logits, vocab_offset, vocab_size, temperature, seeds, offsets, greedy_threshold,
                           channel, want_tokens=True)

    def max_logits_keys(
        self,
        logits: torch.Tensor,
        vocab_offset: int,
        *,
        vocab_size: int | None = None,
        temperature: torch.Tensor | None = None,
        seeds: torch.Tensor | None = None,
        offsets: torch.Tensor | None = None,
        greedy_threshold: float = K.GREEDY_TEMPERATURE_THRESHOLD,
        channel: int = 0,
    ) -> torch.Tensor:
        """Like :meth:`argmax_logits` but returns the winning keys (``[R]`` int64, equal on every
        rank): ``max over ranks of keys.local_row_keys(...)``, bit for bit. Unpack with
        ``keys.unpack_keys`` for the winning score and column. Same step-counter rules."""
        return self._fused(logits, vocab_offset, vocab_size, temperature, seeds, offsets, greedy_threshold,
                           channel, want_tokens=False)

    def _fused(
        self,
        logits: torch.Tensor,
        vocab_offset: int,
        vocab_size: int | None,
        temperature: torch.Tensor | None,
        seeds: torch.Tensor | None,
        offsets: torch.Tensor | None,
        greedy_threshold: float,
        channel: int,
        *,
        want_tokens: bool,
    ) -> torch.Tensor:
        self.validate_logits_call(logits, vocab_offset, vocab_size, temperature, seeds, offsets, channel)
        self._raise_if_failed()
        rows, width = logits.shape
        unseeded = temperature is not None and seeds is None
        if rows > self.MAX_ROWS:  # the all-gather path (max_keys hands these rows over), same results
            best = self._max_local_keys(logits, vocab_offset, vocab_size, temperature, seeds, offsets,
                                        greedy_threshold, channel)
            return K.unpack_indices(best) if want_tokens else best
        if rows == 0:
            if unseeded:
                self.step_counter.add_(1)  # the all-gather path advances it for every such call
            return torch.empty(0, dtype=torch.int64, device=self.device)
        if width > 0 and logits.stride(1) != 1:
            logits = logits.contiguous()
        real_width = width if vocab_size is None else max(0, min(width, vocab_size - vocab_offset))
        elem = logits.element_size()
        aligned = logits.data_ptr() % 16 == 0 and (logits.stride(0) * elem) % 16 == 0
        chunk, chunks = plan_chunks(rows, real_width, elem, self.plan_sms, temperature is not None)
        name = fused_kernel_name(logits.dtype, chunk, temperature is not None)
        if rows * chunks > self.layout.max_blocks:  # plan_chunks promises otherwise
            raise RuntimeError(f"fused call of {rows * chunks} blocks exceeds the {self.layout.max_blocks} block lines")
        null = _p(0)
        temp_ptr = null
        if temperature is not None:
            temperature = temperature.to(torch.float32).contiguous()
            temp_ptr = _p(temperature.data_ptr())
        seeds_ptr = offsets_ptr = null
        if seeds is not None:
            seeds, offsets = seeds.contiguous(), offsets.contiguous()
            seeds_ptr, offsets_ptr = _p(seeds.data_ptr()), _p(offsets.data_ptr())
        out = torch.empty(rows, dtype=torch.int64, device=self.device)
        args = (
            _p(logits.data_ptr()), np.int64(logits.stride(0)), np.int32(rows), np.int32(real_width),
            np.uint32(vocab_offset), np.int32(chunk), np.int32(chunks), np.int32(aligned), temp_ptr,
            np.float32(greedy_threshold), seeds_ptr, offsets_ptr, _p(self.step_counter.data_ptr()),
            _p(UNSEEDED_STREAM_SEED), np.int32(unseeded), _p(out.data_ptr()), np.int32(want_tokens),
            _p(self._gumbel_table.data_ptr()), *self._exchange_args(channel),
        )
        self._launch(name, rows * chunks, fused_shared_bytes(rows, chunks), args)
        return out

    # ---------------------------------------------------------------- shutdown
    def close(self) -> None:
        """Free the buffers (collective: peers must close too). Idempotent.

        Waits for this device's work, closes the peers' handles, waits (best effort) for
        every rank to have closed theirs, then frees this rank's buffer.
        """
        if self._closed:
            return
        self._closed = True
        self._release(barrier=True)

    def _release(self, barrier: bool) -> None:
        cupy = self._cupy
        if cupy is None:
            return
        rt = cupy.cuda.runtime
        with cupy.cuda.Device(self.device.index):
            try:
                rt.deviceSynchronize()
            except Exception:  # noqa: BLE001 - still free what we can
                pass
            for ptr in self._opened:
                try:
                    rt.ipcCloseMemHandle(ptr)
                except Exception:  # noqa: BLE001
                    pass
            self._opened = []
            if barrier and self.world_size > 1:
                try:  # owners free only after every peer closed its mapping
                    D.all_gather_object(None, self.group)
                except Exception:  # noqa: BLE001 - a dead peer must not keep us from freeing
                    pass
            if self._base:
                rt.free(self._base)
                self._base = 0
            if self._host_error:
                rt.freeHost(self._host_error)
                self._host_error = 0
