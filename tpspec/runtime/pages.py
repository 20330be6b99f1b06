"""KV pages on the host side: who owns which page (:class:`PageAllocator`), and how many
pages an engine gets (:func:`plan_num_pages`).

The allocator is replicated state: every rank of a TP group makes the same calls in the
same order on the same requests, so every rank hands out the same pages (under attention
DP each rank runs its own allocator for its own requests). Nothing here touches a device.

Admission reserves a request's worst case — ``min(prompt + max_new_tokens, max_seq_len)
- 1 + K`` cache entries (the last generation step writes its K drafts past the last
committed token) — and pages are taken as the request grows, out of that reservation.
So a running request always finds its pages: nothing is ever preempted. Speculative
rewind only moves lengths; a request's pages go back when it finishes.
"""

from __future__ import annotations

from collections.abc import Hashable

from ..model.batch import pages_needed
from ..validation import check_int


class PageAllocator:
    """Pages ``[0, num_pages)`` of ``page_size`` tokens, handed out per request.

    ``reserve(key, max_tokens)`` admits a request when its worst case fits beside what others
    reserved (False otherwise: the caller keeps it waiting); ``grow(key, num_tokens)`` takes
    pages so the request's block table covers ``num_tokens`` entries; ``free(key)`` returns
    them all. Raises ``ValueError`` for sizes that can never fit and ``RuntimeError`` for a
    caller that breaks the accounting (growing past a reservation, unknown keys).
    """

    def __init__(self, num_pages: int, page_size: int) -> None:
        check_int("num_pages", num_pages, low=1)
        check_int("page_size", page_size, low=1)
        self.num_pages = num_pages
        self.page_size = page_size
        self._free = list(range(num_pages - 1, -1, -1))  # pop() hands out the lowest page first
        self._tables: dict[Hashable, list[int]] = {}
        self._reserved: dict[Hashable, int] = {}

    @property
    def num_free(self) -> int:
        """Pages nobody holds."""
        return len(self._free)

    @property
    def num_unreserved(self) -> int:
        """Pages neither held nor promised to an admitted request."""
        promised = sum(r - len(self._tables[k]) for k, r in self._reserved.items())
        return len(self._free) - promised

    def pages_for(self, num_tokens: int) -> int:
        return pages_needed(num_tokens, self.page_size)

    def check_fits(self, max_tokens: int, what: str = "a request") -> None:
        """``ValueError`` when ``max_tokens`` cache entries exceed the whole pool."""
        need = self.pages_for(max_tokens)
        if need > self.num_pages:
            raise ValueError(f"{what} needs up to {max_tokens} cached tokens ({need} pages of {self.page_size}), "
                             f"the KV cache holds {self.num_pages} pages ({self.num_pages * self.page_size} tokens)")

    def reserve(self, key: Hashable, max_tokens: int) -> bool:
        """Admit ``key`` with a worst case of ``max_tokens`` entries if its pages are free."""
        if key in self._reserved:
            raise RuntimeError(f"request {key!r} already holds a reservation")
        self.check_fits(max_tokens, f"request {key!r}")
        need = self.pages_for(max_tokens)
        if need > self.num_unreserved:
            return False
        self._reserved[key] = need
        self._tables[key] = []
        return True

    def grow(self, key: Hashable, num_tokens: int) -> list[int]:
        """Take pages until ``key``'s block table covers ``num_tokens`` entries; returns the table."""
        table = self._tables.get(key)
        if table is None:
            raise RuntimeError(f"request {key!r} has no reservation")
        need = self.pages_for(num_tokens)
        if need > self._reserved[key]:
            raise RuntimeError(f"request {key!r} needs {need} pages, it reserved {self._reserved[key]}")
        while len(table) < need:
            table.append(self._free.pop())
        return table

    def table(self, key: Hashable) -> list[int]:
        return self._tables[key]

    def free(self, key: Hashable) -> None:
        """Return ``key``'s pages and reservation (no-op for an unknown key)."""
        table = self._tables.pop(key, None)
        self._reserved.pop(key, None)
        if table:
            self._free.extend(reversed(table))


def plan_num_pages(*, page_bytes: int, kv_cache_bytes: int | None = None, free_bytes: int | None = None) -> int:
    """Pages of ``page_bytes`` (all paged models of an engine together, one rank) that fit
    ``kv_cache_bytes`` when given, else ``free_bytes`` (what memory sizing left for the cache).
    ``ValueError`` when not even one page fits."""
    budget = kv_cache_bytes if kv_cache_bytes is not None else free_bytes
    if budget is None:
        raise ValueError("plan_num_pages needs kv_cache_bytes or free_bytes")
    pages = int(budget // page_bytes)
    if pages < 1:
        source = "kv_cache_bytes" if kv_cache_bytes is not None else "the memory left after weights and activations"
        raise ValueError(f"{source} ({int(budget)} bytes) holds no KV page of {page_bytes} bytes")
    return pages
