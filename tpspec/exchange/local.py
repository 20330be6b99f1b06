"""The exchange of a head that is not vocabulary-sharded: one rank, no collective."""

from __future__ import annotations

import torch

from ..keys import SamplingRows, unpack_indices
from .base import Channel, KeyExchange


class LocalKeyExchange(KeyExchange):
    """A key exchange over one rank: ``max_keys`` returns the keys themselves.

    For heads that are not vocabulary-sharded (TP = 1, or the replicated LM head under
    attention DP), where a group-wide exchange would wrongly wait for other ranks.
    """

    def __init__(self, device: str | torch.device = "cpu") -> None:
        super().__init__(None, 0, 1, torch.device(device))

    def argmax_logits(self, logits: torch.Tensor, vocab_offset: int, *, vocab_size: int | None = None,
                      rows: SamplingRows | None = None, channel: int = Channel.DRAFT) -> torch.Tensor:
        """:meth:`KeyExchange.argmax_logits`. Without ``rows`` (every row greedy) one ``torch.argmax``
        over the real columns: the keys' maximum is defined to pick what it picks (the largest
        value, the first NaN, ties to the lowest column, ``-0.0 == +0.0``; ``keys.pack_keys``), so
        the ``[R, C]`` keys need not be built."""
        self.validate_logits_call(logits, vocab_offset, vocab_size, rows, channel)
        width = logits.shape[1]
        real = width if vocab_size is None else min(width, vocab_size - vocab_offset)
        if rows is None and real > 0 and logits.shape[0] > 0:
            return logits[:, :real].argmax(dim=1) + vocab_offset
        return unpack_indices(self._max_local_keys(logits, vocab_offset, vocab_size, rows, channel))

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
