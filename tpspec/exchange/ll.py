"""``LLKeyExchange``: the cross-rank key max through CUDA IPC peer memory.

Each rank ``cudaMalloc``s one buffer (control blocks, the LL slots and the fused
kernel's block lines of every channel), shares it by CUDA IPC handle over the process
group once (any backend: gloo is enough), and opens its peers' handles. One kernel launch
per call reduces the rank's keys (the fused kernel's blocks hand theirs to one of them, the
collector, through the block lines), writes them into every rank's slots with 16-byte
``{key_lo, epoch, key_hi, epoch}`` stores, waits for every rank's lines (bounded by
``timeout_s``), reduces and writes the result. See ``csrc/ll_exchange/ll_exchange.cu``;
:func:`~tpspec.exchange.ll_plan.plan` decides the kernel and grid of each fused call.

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
from .ll_plan import exchange_keys_kernel, gather_rows_kernel, kernel_constants, max_grid_blocks, plan
from .allgather import AllGatherKeyExchange
from .base import UNSEEDED_STREAM_SEED, Channel, KeyExchange

DEFAULT_MAX_ROWS = 1024
MAX_MAX_ROWS = 4096  # the kernels keep one key per row in shared memory (32 KiB)
MAX_CHANNELS = 16
DEFAULT_TIMEOUT_S = 30.0
MIN_TIMEOUT_S = 1e-3  # below a scheduling hiccup every wait would give up
MAX_TIMEOUT_S = 1e6  # ~11.6 days; far inside the kernel's uint64 nanosecond count
TIMEOUT_ENV = "TPSPEC_LL_TIMEOUT_S"

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
    # One rank always fits: the factory checks options before it knows whether the kernel
    # source (which holds the limit) is there.
    if world_size < 1 or (world_size > 1 and world_size > kernel_constants().max_world):
        raise ValueError(f"the LL exchange serves 1 to {kernel_constants().max_world} ranks, "
                         f"the group has {world_size}")


def sms_per_rank(num_sms: int, devices: list[str], rank: int) -> int:
    """SMs a rank plans its fused grids for: its GPU's ``num_sms`` shared among the ranks
    whose ``devices`` entry (one per rank of the group: its GPU's UUID) equals its own.

    With one GPU a rank (a deployment) every rank plans for the whole GPU. Ranks that share a
    GPU (the one-GPU benchmarks and tests) would otherwise each plan a whole-GPU grid, and
    their grids, launched together, would run as several waves; each plans for its share
    instead. Only the grid depends on it, never a key, so ranks may differ."""
    sharing = sum(1 for device in devices if device == devices[rank])
    return max(1, num_sms // max(1, sharing))


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
        end = kernel_constants().ctrl_bytes * self.num_channels
        return (end + 255) // 256 * 256

    @property
    def slot_channel_bytes(self) -> int:
        """Slots of one channel: [parity 2][source rank][row] lines of 16 bytes."""
        return 2 * self.world_size * self.max_rows * kernel_constants().line_bytes

    @property
    def block_lines_offset(self) -> int:
        return self.slots_offset + self.num_channels * self.slot_channel_bytes

    @property
    def block_lines_channel_bytes(self) -> int:
        """Block lines of one channel: one 16-byte line per block of a fused call."""
        return self.max_blocks * kernel_constants().line_bytes

    @property
    def total_bytes(self) -> int:
        return self.block_lines_offset + self.num_channels * self.block_lines_channel_bytes

    def ctrl(self, base: int, channel: int) -> int:
        return base + self.ctrl_offset + kernel_constants().ctrl_bytes * channel

    def slots(self, base: int, channel: int) -> int:
        return base + self.slots_offset + self.slot_channel_bytes * channel

    def block_lines(self, base: int, channel: int) -> int:
        return base + self.block_lines_offset + self.block_lines_channel_bytes * channel


# The value-dtype code of the exchange-keys kernels' ``max_dtype`` argument.
_VALUE_DTYPE_CODE = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def _p(value: int) -> np.uint64:
    return np.uint64(value)


class LLKeyExchange(KeyExchange):
    """Peer-memory exchange for the ranks of ``group`` on one node (collective constructor).

    ``max_rows``: rows a call may have on the LL path (more go through an all-gather);
    ``num_channels``: independent slot sets (``Channel.DRAFT``, ``Channel.TARGET``, ...); ``timeout_s``:
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
        self._exchange_kernel = exchange_keys_kernel(self.world_size)  # max_keys / argmax_tokens
        self._gather_kernel = gather_rows_kernel(self.world_size)  # gather_rows / sum_rows

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
            words = kernel_constants().ctrl_bytes // 4
            ctrl = np.zeros(words * self.NUM_CHANNELS, dtype=np.uint32)
            ctrl[::words] = 1  # first epoch of every channel; slots hold 0 = never written
            rt.memcpy(self.layout.ctrl(self._base, 0), ctrl.ctypes.data, ctrl.nbytes, _CUDA_MEMCPY_HOST_TO_DEVICE)
            error_bytes = kernel_constants().host_error_bytes * self.NUM_CHANNELS
            self._host_error = rt.hostAlloc(error_bytes, _CUDA_HOST_ALLOC_PORTABLE_MAPPED)
            ctypes.memset(self._host_error, 0, error_bytes)
            rt.deviceSynchronize()
            handle[0] = rt.ipcGetMemHandle(self._base)

    # ----------------------------------------------------------------- errors
    def _error_record(self, channel: int) -> tuple[int, int, int]:
        address = self._host_error + kernel_constants().host_error_bytes * channel
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
            _p(self._host_error + kernel_constants().host_error_bytes * channel),
            np.int32(self.rank),
            np.int32(self.world_size),
            np.int32(self.MAX_ROWS),
            np.uint64(int(self.timeout_s * 1e9)),
        )

    def _launch(self, kernel: Any, blocks: int, shared_bytes: int, args: tuple) -> None:
        """Launch ``kernel`` (a name of ``cuda_module.KERNEL_NAMES`` or a loaded cupy kernel)."""
        if isinstance(kernel, str):
            kernel = self._kernels[kernel]
        # Read the current stream at every launch: under torch.cuda.graph it is the capture stream.
        stream_ptr = torch.cuda.current_stream(self.device).cuda_stream
        stream = self._streams.get(stream_ptr)
        if stream is None:
            stream = self._cupy.cuda.ExternalStream(stream_ptr, self.device.index)
            self._streams[stream_ptr] = stream
        # The kernels live in this device's context: launch there even when the caller's
        # current device is another one (a no-op in the usual one-device-per-process case).
        with torch.cuda.device(self.device.index):
            kernel((blocks,), (kernel_constants().threads,), args, shared_mem=shared_bytes,
                                stream=stream)

    # ------------------------------------------------------------------ calls
    def max_keys(self, keys: torch.Tensor, *, channel: int = Channel.DRAFT) -> torch.Tensor:
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

    def gather_rows(self, values: torch.Tensor, *, channel: int = Channel.DRAFT) -> torch.Tensor:
        """See :meth:`KeyExchange.gather_rows`: one launch when ``rows * C <= max_rows``
        (every element rides one slot line), else the all-gather."""
        self.check_int64_rows("values", values, 2)
        self.check_channel(channel)
        rows, width = values.shape
        out = torch.empty(rows, self.world_size * width, dtype=torch.int64, device=self.device)
        return self._gather_or_sum(values.reshape(-1), width, 0, out, channel, self._fallback.gather_rows, values)

    def sum_rows(self, values: torch.Tensor, *, channel: int = Channel.DRAFT) -> torch.Tensor:
        """See :meth:`KeyExchange.sum_rows`: one launch when ``rows <= max_rows``, else the all-gather."""
        self.check_int64_rows("values", values, 1)
        self.check_channel(channel)
        out = torch.empty_like(values, device=self.device)
        return self._gather_or_sum(values, 1, 1, out, channel, self._fallback.sum_rows, values)

    def _gather_or_sum(self, flat: torch.Tensor, width: int, sum_mode: int, out: torch.Tensor, channel: int,
                       fallback: Any, values: torch.Tensor) -> torch.Tensor:
        self._raise_if_failed()
        count = flat.numel()
        if count > self.MAX_ROWS:
            return fallback(values, channel=channel)
        if count == 0:
            return out
        flat = flat.contiguous()
        args = (_p(flat.data_ptr()), np.int32(count), np.int32(width), np.int32(sum_mode), _p(out.data_ptr()),
                *self._exchange_args(channel))
        self._launch(self._gather_kernel, 1, 0, args)
        return out

    def argmax_tokens(
        self, local_max: torch.Tensor, local_argmax: torch.Tensor, vocab_offset: int, *, channel: int = Channel.DRAFT
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
        args = (np.int32(1), _p(0), _p(local_max.data_ptr()), np.int32(_VALUE_DTYPE_CODE[local_max.dtype]),
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
        rows: K.SamplingRows | None = None,
        channel: int = Channel.DRAFT,
    ) -> torch.Tensor:
        """See :meth:`KeyExchange.argmax_logits`; one kernel launch when rows <= ``max_rows``."""
        return self._fused(logits, vocab_offset, vocab_size, rows, channel, want_tokens=True)

    def max_logits_keys(
        self,
        logits: torch.Tensor,
        vocab_offset: int,
        *,
        vocab_size: int | None = None,
        rows: K.SamplingRows | None = None,
        channel: int = Channel.DRAFT,
    ) -> torch.Tensor:
        """Like :meth:`argmax_logits` but returns the winning keys (``[R]`` int64, equal on every
        rank): ``max over ranks of keys.local_row_keys(...)``, bit for bit. Unpack with
        ``keys.unpack_keys`` for the winning score and column. Same step-counter rules."""
        return self._fused(logits, vocab_offset, vocab_size, rows, channel, want_tokens=False)

    def _fused(
        self,
        logits: torch.Tensor,
        vocab_offset: int,
        vocab_size: int | None,
        sampling: K.SamplingRows | None,
        channel: int,
        *,
        want_tokens: bool,
    ) -> torch.Tensor:
        self.validate_logits_call(logits, vocab_offset, vocab_size, sampling, channel)
        temperature = None if sampling is None else sampling.temperature
        seeds = None if sampling is None else sampling.seeds
        offsets = None if sampling is None else sampling.offsets
        greedy_threshold = K.GREEDY_TEMPERATURE_THRESHOLD if sampling is None else sampling.greedy_threshold
        self._raise_if_failed()
        rows, width = logits.shape
        unseeded = temperature is not None and seeds is None
        if rows > self.MAX_ROWS:  # the all-gather path (max_keys hands these rows over), same results
            best = self._max_local_keys(logits, vocab_offset, vocab_size, sampling, channel)
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
        launch = plan(rows, real_width, logits.dtype, "greedy" if temperature is None else "sampled", self.plan_sms)
        if launch.blocks > self.layout.max_blocks:  # max_grid_blocks promises otherwise
            raise RuntimeError(f"fused call of {launch.blocks} blocks exceeds the {self.layout.max_blocks} block lines")
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
            np.uint32(vocab_offset), np.int32(launch.chunk), np.int32(launch.chunks), np.int32(aligned), temp_ptr,
            np.float32(greedy_threshold), seeds_ptr, offsets_ptr, _p(self.step_counter.data_ptr()),
            _p(UNSEEDED_STREAM_SEED), np.int32(unseeded), _p(out.data_ptr()), np.int32(want_tokens),
            _p(self._gumbel_table.data_ptr()), *self._exchange_args(channel),
        )
        self._launch(launch.kernel, launch.blocks, launch.shared_bytes, args)
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
