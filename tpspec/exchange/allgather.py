"""Key exchange through one all-gather of the ``[R]`` int64 keys (any torch.distributed backend)."""

from __future__ import annotations

from typing import Any

import torch

from .. import distributed as D
from .base import Channel, KeyExchange


class AllGatherKeyExchange(KeyExchange):
    """``max_keys`` = one ``all_gather_into_tensor`` of ``[R]`` int64 keys, then a max over ranks.

    Works with NCCL and gloo, and with no process group at all (a single rank: the
    local keys are the answer). ``group=None`` means the default group.
    ``device``: where keys live (default: the current CUDA device for NCCL, else CPU).
    ``num_channels``: the channels calls may name (they share one ordered collective
    stream here; the count only keeps bad channels rejected as on the LL exchange).
    """

    def __init__(
        self, group: Any = None, *, device: str | torch.device | None = None, num_channels: int = 2
    ) -> None:
        backend = D.group_backend(group)
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        super().__init__(group, D.group_rank(group), D.group_size(group), torch.device(device),
                         num_channels=num_channels)

    def max_keys(self, keys: torch.Tensor, *, channel: int = Channel.DRAFT) -> torch.Tensor:
        self._check_rows_vector("keys", keys, None)
        if keys.dtype != torch.int64:
            raise ValueError(f"keys must be int64, got {keys.dtype}")
        self.check_channel(channel)
        if self.world_size == 1:
            return keys.clone()
        gathered = torch.empty(self.world_size * keys.shape[0], dtype=torch.int64, device=keys.device)
        D.all_gather_into(gathered, keys, self.group)
        return gathered.view(self.world_size, -1).max(dim=0).values

    def gather_rows(self, values: torch.Tensor, *, channel: int = Channel.DRAFT) -> torch.Tensor:
        self.check_int64_rows("values", values, 2)
        self.check_channel(channel)
        if self.world_size == 1:
            return values.clone()
        rows, width = values.shape
        gathered = torch.empty(self.world_size * rows * width, dtype=torch.int64, device=values.device)
        D.all_gather_into(gathered, values.contiguous().reshape(-1), self.group)
        return gathered.view(self.world_size, rows, width).permute(1, 0, 2).reshape(rows, self.world_size * width)

    def sum_rows(self, values: torch.Tensor, *, channel: int = Channel.DRAFT) -> torch.Tensor:
        self.check_int64_rows("values", values, 1)
        self.check_channel(channel)
        total = values.clone()
        if self.world_size > 1:
            D.all_reduce_(total, "sum", self.group)
        return total
