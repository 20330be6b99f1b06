"""The collectives the model runs over its TP group.

Under attention DP every rank of a TP group brings its own number of tokens. The
ranks first swap their counts (:func:`exchange_counts`, one all-gather of a small
int64 tensor), and every later collective of the step pads to the largest count, so
no rank ever decides whether to join a collective from its own data alone.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist

from .. import distributed as D
from ..exchange.local import LocalKeyExchange  # noqa: F401  (re-exported for the model)


def all_reduce_sum(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Sum ``x`` over ``group`` in place (identity for a group of one)."""
    return D.all_reduce_(x, "sum", group)


def exchange_counts(values: list[int], group: Any, device: torch.device) -> list[list[int]]:
    """Every rank's ``values`` (same length on every rank), index = rank in ``group``."""
    size = D.group_size(group)
    if size == 1:
        return [list(values)]
    local = torch.tensor(values, dtype=torch.int64, device=device)
    out = torch.empty(size * len(values), dtype=torch.int64, device=device)
    D.all_gather_into(out, local, group)
    return out.view(size, len(values)).tolist()


class VarlenRows:
    """Stack rows of different counts per rank, and hand each rank its rows back.

    ``counts[r]`` rows live on rank ``r`` of ``group``; stacked order is rank-major.
    Both methods are collective and pad to ``max(counts)`` rows per rank.
    """

    def __init__(self, counts: list[int], group: Any, device: torch.device) -> None:
        self.counts = [int(c) for c in counts]
        self.group = group
        self.rank = D.group_rank(group)
        self.world = D.group_size(group)
        self.nccl = D.group_backend(group) == "nccl"
        if len(self.counts) != self.world:
            raise ValueError(f"VarlenRows needs one count per rank ({self.world}), got {self.counts}")
        self.pad = max(self.counts, default=0)
        self.total = sum(self.counts)
        self.start = sum(self.counts[: self.rank])
        self.local = self.counts[self.rank]
        # Rows of the padded [world * pad] layout that hold real data, in stacked order.
        self._real = torch.cat(
            [torch.arange(c, dtype=torch.int64) + r * self.pad for r, c in enumerate(self.counts)]
        ).to(device)

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """``[counts[rank], ...]`` on each rank -> ``[total, ...]`` (every rank's rows, rank-major)."""
        if x.shape[0] != self.local:
            raise ValueError(f"this rank holds {x.shape[0]} rows but announced {self.local}")
        if self.world == 1:
            return x
        padded = x.new_zeros((self.pad,) + tuple(x.shape[1:]))
        padded[: self.local] = x
        out = x.new_empty((self.world * self.pad,) + tuple(x.shape[1:]))
        D.all_gather_into(out, padded, self.group)
        return out.index_select(0, self._real)

    def reduce_scatter(self, x: torch.Tensor) -> torch.Tensor:
        """``[total, ...]`` partial sums on each rank -> this rank's ``[counts[rank], ...]`` rows, summed."""
        if x.shape[0] != self.total:
            raise ValueError(f"reduce_scatter expects {self.total} rows, got {x.shape[0]}")
        if self.world == 1:
            return x
        if not self.nccl:
            # gloo (CPU tests, or several ranks on one GPU): not every torch build reduce-scatters
            # CUDA tensors over gloo, so sum everything and keep this rank's rows.
            return self.take_local(D.all_reduce_(x.clone(), "sum", self.group))
        padded = x.new_zeros((self.world * self.pad,) + tuple(x.shape[1:]))
        padded.index_copy_(0, self._real, x)
        out = x.new_empty((self.pad,) + tuple(x.shape[1:]))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", category=FutureWarning)
            warnings.simplefilter("ignore", category=DeprecationWarning)
            dist.reduce_scatter_tensor(out, padded, group=self.group)
        return out[: self.local]

    def take_local(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's segment ``[start, start + counts[rank])`` of stacked rows (no communication)."""
        return x[self.start : self.start + self.local]
