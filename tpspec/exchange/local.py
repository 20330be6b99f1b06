"""The exchange of a head that is not vocabulary-sharded: one rank, no collective."""

from __future__ import annotations

import torch

from .base import Channel, KeyExchange


class LocalKeyExchange(KeyExchange):
    """A key exchange over one rank: ``max_keys`` returns the keys themselves.

    For heads that are not vocabulary-sharded (TP = 1, or the replicated LM head under
    attention DP), where a group-wide exchange would wrongly wait for other ranks.
    """

    def __init__(self, device: str | torch.device = "cpu") -> None:
        super().__init__(None, 0, 1, torch.device(device))

    def max_keys(self, keys: torch.Tensor, *, channel: int = Channel.DRAFT) -> torch.Tensor:
        self._check_rows_vector("keys", keys, None)
        if keys.dtype != torch.int64:
            raise ValueError(f"keys must be int64, got {keys.dtype}")
        self.check_channel(channel)
        return keys.clone()

    def gather_rows(self, values: torch.Tensor, *, channel: int = Channel.DRAFT) -> torch.Tensor:
        self.check_int64_rows("values", values, 2)
        self.check_channel(channel)
        return values.clone()

    def sum_rows(self, values: torch.Tensor, *, channel: int = Channel.DRAFT) -> torch.Tensor:
        self.check_int64_rows("values", values, 1)
        self.check_channel(channel)
        return values.clone()
