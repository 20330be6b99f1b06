"""The paged KV cache of one model on one rank: per layer, ``k`` and ``v`` page tensors of
shape ``[num_pages, page_size, kv_heads, head_dim]`` (FlashInfer's ``NHD`` layout).

Pages are only storage here: which request owns which page (the block tables) is decided
by the runtime's page allocator. Every model of an engine (the target, a draft model, a
draft head) allocates the SAME number of pages of the same size, so one block table
addresses a request's entries in all of them.
"""

from __future__ import annotations

from typing import Any

import torch


class KVPages:
    """One layer's pages: ``k``, ``v`` of shape ``[num_pages, page_size, kv_heads, head_dim]``."""

    def __init__(self, num_pages: int, page_size: int, kv_heads: int, head_dim: int,
                 *, dtype: torch.dtype, device: Any) -> None:
        shape = (num_pages, page_size, kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    def write(self, write_index: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store ``k``/``v`` ``[N, kv_heads, head_dim]`` at flat rows ``write_index`` ``[N]``
        (``page * page_size + offset``)."""
        self.k.view(-1, *self.k.shape[2:]).index_copy_(0, write_index, k)
        self.v.view(-1, *self.v.shape[2:]).index_copy_(0, write_index, v)

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size()


def page_bytes(num_layers: int, page_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes one page takes over all layers of a model (keys and values)."""
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * page_size * kv_heads * head_dim * elem
