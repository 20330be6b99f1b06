"""The ``KeyExchange`` contract: cross-rank max of 64-bit keys, and what is built on it.

Every implementation returns, on every rank of its group, the tokens one rank would
pick from the full logits (greedy) or from the full logits plus the same Gumbel noise
(sampled rows). Implementations differ only in how the ``[R]`` keys travel.

Shared here: argument validation (so every backend rejects the same bad input with
the same message) and the device-side step counter that seeds rows without their own
stream.
"""

from __future__ import annotations

import dataclasses
import enum
from abc import ABC, abstractmethod
from typing import Any

import torch

from .. import keys as K
from ..validation import check_int, is_int

class Channel(enum.IntEnum):
    """Which exchange slots a call uses: draft picks and the target's picks may be in flight
    together (a draft model's forward overlapping the target's selection), so they never
    share slots. An ``int``: exchanges built with more channels accept 2, 3, ... too."""

    DRAFT = 0
    TARGET = 1


UNSEEDED_STREAM_SEED = 0x7470737065630000  # "tpspec\0\0": seed of rows with no stream of their own
"""Rows sampled without ``seeds``: seed = this, offset = ``step << 32 | row``."""


def _concrete_device(device: torch.device) -> torch.device:
    """``cuda`` -> ``cuda:<current>``, ``cpu:0`` -> ``cpu``: so equal places compare equal."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    if device.type == "cpu":
        return torch.device("cpu")
    return device


class KeyExchange(ABC):
    """Cross-rank selection over a process group. Collective: every rank of the group
    must make the same calls, in the same order, with the same row counts.

    ``channel`` keeps exchanges that may be in flight together apart (:class:`Channel`);
    implementations without slots accept and ignore it.
    """

    MAX_ROWS: int = 2**31 - 1
    NUM_CHANNELS: int = 2

    def __init__(
        self, group: Any, rank: int, world_size: int, device: torch.device, *, num_channels: int = 2
    ) -> None:
        check_int("num_channels", num_channels, low=1)
        self.NUM_CHANNELS = num_channels
        self.group = group
        self.rank = rank
        self.world_size = world_size
        self.device = _concrete_device(torch.device(device))
        # Step counter of unseeded sampled rows: a device tensor so CUDA graphs can
        # advance it without host work; every rank starts at 0 and advances identically.
        self.step_counter = torch.zeros(1, dtype=torch.int64, device=device)

    # -- the collective primitive --------------------------------------------------
    @abstractmethod
    def max_keys(self, keys: torch.Tensor, *, channel: int = Channel.DRAFT) -> torch.Tensor:
        """Element-wise max over ranks of ``keys`` (``[R]`` int64). Every rank gets ``[R]`` int64."""

    @abstractmethod
    def gather_rows(self, values: torch.Tensor, *, channel: int = Channel.DRAFT) -> torch.Tensor:
        """Per-row gather of int64 arrays: ``values`` ``[R, C]`` int64 on every rank (same R and
        C everywhere) -> ``[R, world_size * C]`` int64, columns ``[r * C, (r + 1) * C)`` from
        rank ``r``. Every rank gets the same tensor. The sharded filters send their candidate
        keys through it."""

    @abstractmethod
    def sum_rows(self, values: torch.Tensor, *, channel: int = Channel.DRAFT) -> torch.Tensor:
        """Exact int64 sum over ranks: ``values`` ``[R]`` int64 -> ``[R]`` int64, the same on
        every rank whatever the rank order (integer addition; the caller keeps the sum below
        ``2**63``). The sharded filters sum their column masses through it."""

    # -- built on it ---------------------------------------------------------------
    def argmax_tokens(
        self, local_max: torch.Tensor, local_argmax: torch.Tensor, vocab_offset: int, *, channel: int = Channel.DRAFT
    ) -> torch.Tensor:
        """Global argmax from each rank's per-row max and its local column.

        ``local_max``: ``[R]`` float32/bf16/fp16; ``local_argmax``: ``[R]`` int (column
        inside the rank's slice). Returns ``[R]`` int64 global columns, equal on every rank.
        The columns are data, so they are not range-checked (that would cost a device
        sync): ``vocab_offset + local_argmax`` must lie in ``[0, 2**32 - 1)``.
        """
        self._check_rows_vector("local_max", local_max, None)
        self._check_rows_vector("local_argmax", local_argmax, local_max.shape[0])
        if local_argmax.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"local_argmax must be int32 or int64, got {local_argmax.dtype}")
        self._check_offset(vocab_offset)
        self.check_channel(channel)
        keys = K.pack_keys(local_max, local_argmax.to(torch.int64) + vocab_offset)
        return K.unpack_indices(self.max_keys(keys, channel=channel))

    def argmax_logits(
        self,
        logits: torch.Tensor,
        vocab_offset: int,
        *,
        vocab_size: int | None = None,
        rows: K.SamplingRows | None = None,
        channel: int = Channel.DRAFT,
    ) -> torch.Tensor:
        """Tokens from a rank's ``[R, C]`` logits slice (global columns ``vocab_offset + c``).

        Greedy rows (no ``rows``, or ``rows.temperature < rows.greedy_threshold``) take the
        global argmax; other rows a Gumbel-max draw from softmax(logits / T) with noise
        keyed by ``(seeds, offsets, global column)`` — or, without ``rows.seeds``, by this
        exchange's step counter (advanced once per such call, on the device). Filters and
        penalties of ``rows`` are not applied here (``tpspec.sampling.select`` does). Columns at
        or past ``vocab_size`` are never chosen; a rank whose slice lies wholly past it (or
        has no columns) offers no candidate. Returns ``[R]`` int64, equal on every rank;
        if no rank offers a candidate (every slice empty) the token is ``2**32 - 1``.
        """
        self.validate_logits_call(logits, vocab_offset, vocab_size, rows, channel)
        return K.unpack_indices(self._max_local_keys(logits, vocab_offset, vocab_size, rows, channel))

    def _max_local_keys(
        self, logits: torch.Tensor, vocab_offset: int, vocab_size: int | None, rows: K.SamplingRows | None,
        channel: int,
    ) -> torch.Tensor:
        """The winning keys of a validated ``argmax_logits`` call: ``keys.local_row_keys`` on
        this rank (unseeded rows take this exchange's step counter), then :meth:`max_keys`."""
        if rows is not None and rows.seeds is None:
            seeds, offsets = self.unseeded_streams(logits.shape[0])
            rows = dataclasses.replace(rows, seeds=seeds, offsets=offsets)
        local = K.local_row_keys(logits, vocab_offset, vocab_size=vocab_size, rows=rows)
        return self.max_keys(local, channel=channel)

    def check(self, *, sync: bool = True) -> None:
        """Raise if an earlier call failed after it returned (the LL exchange's kernels
        record a peer timeout on the device, e.g. inside a CUDA-graph replay). Here every
        failure already raised in its call: a no-op."""

    def close(self) -> None:
        """Release resources (idempotent)."""

    def __enter__(self) -> "KeyExchange":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- shared validation ---------------------------------------------------------
    def unseeded_streams(self, num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Seeds/offsets for rows without a stream, from the step counter; advances it.

        Row ``r`` of step ``s`` gets offset ``s << 32 | r``. Graph-capturable.
        """
        rows = torch.arange(num_rows, dtype=torch.int64, device=self.device)
        offsets = (self.step_counter << 32) + rows
        seeds = torch.full((num_rows,), UNSEEDED_STREAM_SEED, dtype=torch.int64, device=self.device)
        self.step_counter.add_(1)
        return seeds, offsets

    def _check_rows_vector(self, name: str, t: Any, rows: int | None) -> None:
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 1:
            raise ValueError(f"{name} must be 1-D [rows], got shape {tuple(t.shape)}")
        if rows is not None and t.shape[0] != rows:
            raise ValueError(f"{name} has {t.shape[0]} rows but the logits have {rows}")
        if _concrete_device(t.device) != self.device:
            raise ValueError(f"{name} is on {t.device}, the exchange works on {self.device}")

    def check_int64_rows(self, name: str, values: Any, dims: int) -> None:
        """Raise ``ValueError`` unless ``values`` is a ``dims``-D int64 tensor on this exchange's device."""
        if not isinstance(values, torch.Tensor) or values.dim() != dims or values.dtype != torch.int64:
            raise ValueError(f"{name} must be a {dims}-D int64 tensor, got "
                             f"{getattr(values, 'dtype', type(values).__name__)} {tuple(getattr(values, 'shape', ()))}")
        if _concrete_device(values.device) != self.device:
            raise ValueError(f"{name} is on {values.device}, the exchange works on {self.device}")

    def _check_offset(self, vocab_offset: Any) -> None:
        # No check against vocab_size: a rank whose slice is all padding (offset >= vocab
        # size) is valid and offers no candidate; rejecting it on that rank alone would
        # leave its peers waiting in the collective.
        if not is_int(vocab_offset):
            raise ValueError(f"vocab_offset must be an int, got {type(vocab_offset).__name__}")
        if vocab_offset < 0 or vocab_offset >= 2**32:
            raise ValueError(f"vocab_offset={vocab_offset} is out of range [0, 2**32)")

    def check_channel(self, channel: Any) -> None:
        """Raise ``ValueError`` unless ``channel`` is an int in ``[0, NUM_CHANNELS)``; every
        backend rejects the same channels, used or not."""
        if not is_int(channel) or not 0 <= channel < self.NUM_CHANNELS:
            raise ValueError(f"channel={channel!r} is out of range [0, {self.NUM_CHANNELS})")

    def validate_logits_call(
        self,
        logits: Any,
        vocab_offset: Any,
        vocab_size: int | None,
        rows: K.SamplingRows | None,
        channel: int,
    ) -> None:
        """Check an ``argmax_logits`` call (no side effects). Raises ``ValueError`` naming the problem."""
        if not isinstance(logits, torch.Tensor):
            raise ValueError(f"logits must be a torch.Tensor, got {type(logits).__name__}")
        if logits.dim() != 2:
            raise ValueError(f"logits must be 2-D [rows, vocab_slice], got shape {tuple(logits.shape)}")
        if logits.dtype not in K.SUPPORTED_VALUE_DTYPES:
            raise ValueError(f"logits must be float32, bfloat16 or float16, got {logits.dtype}")
        if _concrete_device(logits.device) != self.device:
            raise ValueError(f"logits are on {logits.device}, the exchange works on {self.device}")
        if vocab_size is not None:
            check_int("vocab_size", vocab_size, low=1)
        self._check_offset(vocab_offset)
        if vocab_offset + logits.shape[1] > 2**32:
            raise ValueError("global columns must stay below 2**32")
        self.check_channel(channel)
        if rows is None:
            return
        if not isinstance(rows, K.SamplingRows):
            raise ValueError(f"rows must be a SamplingRows or None, got {type(rows).__name__}")
        num_rows = logits.shape[0]
        if (rows.seeds is None) != (rows.offsets is None):
            raise ValueError("pass seeds and offsets together, or neither")
        self._check_rows_vector("temperature", rows.temperature, num_rows)
        if not rows.temperature.is_floating_point():
            raise ValueError(f"temperature must be a floating tensor, got {rows.temperature.dtype}")
        if rows.seeds is not None:
            for name, t in (("seeds", rows.seeds), ("offsets", rows.offsets)):
                self._check_rows_vector(name, t, num_rows)
                if t.dtype != torch.int64:
                    raise ValueError(f"{name} must be int64, got {t.dtype}")
        for name in ("top_k", "top_p", "min_p"):
            if getattr(rows, name) is not None:
                self._check_rows_vector(name, getattr(rows, name), num_rows)
