"""KV pages on the host side: who holds which page and which pages hold a known prefix
(:class:`PageAllocator`), the keys that name a page's content (:func:`page_keys`), and how many
pages an engine gets (:func:`plan_num_pages`).

The allocator is replicated state: every rank of a TP group makes the same calls in the
same order on the same requests, so every rank hands out the same pages and finds the same
cached prefixes (under attention DP each rank runs its own allocator for its own requests).
Keys are SHA-256 digests, the same on every rank and in every process. Nothing here touches a
device.

Pages are taken as a request grows; nothing is reserved ahead. A page is *referenced* by the
requests whose block table holds it, and *cached* when it holds a key: the KV of a known run
of tokens (the whole prefix up to and including the page, through the chain of keys), which a
new request with that prefix may reuse. A page nobody references is free; free pages without
a key are taken first, then cached ones, least recently used first (their key is dropped:
evicted). A referenced page is never evicted.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Hashable, Sequence

from ..model.batch import pages_needed
from ..validation import check_int


def root_key(identity: str) -> bytes:
    """The key every chain starts from: a digest of ``identity`` (whatever changes the KV a
    token run gets: the models, dtype, deterministic mode...), so keys of different engines
    never match."""
    return hashlib.sha256(b"tpspec-kv-root\0" + identity.encode()).digest()


def page_keys(tokens: Sequence[int], page_size: int, root: bytes, *, lookahead: int = 0,
              start: int = 0, parent: bytes | None = None) -> list[bytes]:
    """Keys of the full pages ``start, start + 1, ...`` of ``tokens``: key ``j`` is the digest of
    key ``j - 1`` (``parent``; ``root`` for page 0) and the token ids of positions
    ``[j * page_size, (j + 1) * page_size + lookahead)``, so it names the whole run of tokens up
    to there. ``lookahead``: tokens past the page that its KV depends on too (an EAGLE-3 head's
    KV at position p reads token p + 1: 1). A page gets a key only when all of its tokens and
    its lookahead are in ``tokens``."""
    out: list[bytes] = []
    prev = root if start == 0 else parent
    if prev is None:
        raise ValueError("page_keys needs the parent key when start > 0")
    j = start
    while (j + 1) * page_size + lookahead <= len(tokens):
        run = tokens[j * page_size:(j + 1) * page_size + lookahead]
        prev = hashlib.sha256(prev + struct.pack(f"<{len(run)}q", *run)).digest()
        out.append(prev)
        j += 1
    return out


class PageAllocator:
    """Pages ``[0, num_pages)`` of ``page_size`` tokens, handed out per request (``key``).

    ``start(key, cached, num_tokens)`` gives a request a block table that begins with the
    ``cached`` pages (from :meth:`match`; referenced, never copied) and covers ``num_tokens``
    entries, or returns False when not enough pages are free (nothing changes);
    ``grow(key, num_tokens)`` takes pages so the table covers ``num_tokens`` entries (False,
    nothing taken, when they are not free); ``cache(key, keys)`` gives the table's leading pages
    their keys once their KV is complete; ``free(key)`` drops the request's references (its
    cached pages stay cached). ``enable_caching=False``: :meth:`match` finds nothing and
    :meth:`cache` does nothing. Raises ``RuntimeError`` for a caller that breaks the accounting
    (unknown or repeated keys).
    """

    def __init__(self, num_pages: int, page_size: int, *, enable_caching: bool = False) -> None:
        check_int("num_pages", num_pages, low=1)
        check_int("page_size", page_size, low=1)
        self.num_pages = num_pages
        self.page_size = page_size
        self.enable_caching = bool(enable_caching)
        self._empty = list(range(num_pages - 1, -1, -1))  # free pages without a key; pop() gives the lowest
        self._lru: OrderedDict[int, None] = OrderedDict()  # free pages with a key, least recently used first
        self._refs = [0] * num_pages
        self._key_of: dict[int, bytes] = {}  # page -> its key (cached pages)
        self._page_of: dict[bytes, int] = {}  # key -> the page holding it
        self._tables: dict[Hashable, list[int]] = {}
        self._num_keyed: dict[Hashable, int] = {}  # leading pages of a table whose key is settled

    # ------------------------------------------------------------------ counts
    @property
    def num_free(self) -> int:
        """Pages nobody references (cached ones included: they are evicted when taken)."""
        return len(self._empty) + len(self._lru)

    @property
    def num_cached(self) -> int:
        """Pages holding a key (referenced or not)."""
        return len(self._key_of)

    @property
    def num_cached_free(self) -> int:
        """Cached pages nobody references: what eviction may take."""
        return len(self._lru)

    def pages_for(self, num_tokens: int) -> int:
        return pages_needed(num_tokens, self.page_size)

    def check_fits(self, num_tokens: int, what: str = "a request") -> None:
        """``ValueError`` when ``num_tokens`` cache entries exceed the whole pool."""
        need = self.pages_for(num_tokens)
        if need > self.num_pages:
            raise ValueError(f"{what} needs up to {num_tokens} cached tokens ({need} pages of {self.page_size}), "
                             f"the KV cache holds {self.num_pages} pages ({self.num_pages * self.page_size} tokens)")

    def table(self, key: Hashable) -> list[int]:
        return self._tables[key]

    def refs(self, page: int) -> int:
        """How many requests' tables hold ``page``."""
        return self._refs[page]

    # ------------------------------------------------------------------ prefix cache
    def match(self, keys: Sequence[bytes]) -> list[int]:
        """The pages holding the longest leading run of ``keys`` (empty without caching)."""
        if not self.enable_caching:
            return []
        out = []
        for k in keys:
            page = self._page_of.get(k)
            if page is None:
                break
            out.append(page)
        return out

    def cache(self, key: Hashable, keys: Sequence[bytes]) -> None:
        """Give the leading pages of ``key``'s table the ``keys`` (page ``j`` gets ``keys[j]``):
        call it once their KV is final, or is written by a forward before any request that may
        reuse them reads it. A page whose key another page already
        holds stays without one (its twin serves hits)."""
        if not self.enable_caching:
            return
        table = self._tables[key]
        if len(keys) > len(table):
            raise RuntimeError(f"request {key!r} has {len(table)} pages, {len(keys)} keys given")
        for j in range(self._num_keyed[key], len(keys)):
            page = table[j]
            if page not in self._key_of and keys[j] not in self._page_of:
                self._key_of[page] = keys[j]
                self._page_of[keys[j]] = page
        self._num_keyed[key] = max(self._num_keyed[key], len(keys))

    # ------------------------------------------------------------------ requests
    def start(self, key: Hashable, cached: Sequence[int], num_tokens: int) -> bool:
        """Give ``key`` a table of the ``cached`` pages (a :meth:`match` result) plus fresh pages up
        to ``num_tokens`` entries; False (nothing changes) when the fresh pages are not free."""
        if key in self._tables:
            raise RuntimeError(f"request {key!r} already holds pages")
        idle_hits = sum(1 for p in cached if self._refs[p] == 0)
        fresh = max(0, self.pages_for(num_tokens) - len(cached))
        if fresh > self.num_free - idle_hits:
            return False
        for page in cached:
            if self._refs[page] == 0:
                del self._lru[page]
            self._refs[page] += 1
        table = list(cached)
        self._tables[key] = table
        self._num_keyed[key] = len(cached)
        self._take(table, fresh)
        return True

    def grow(self, key: Hashable, num_tokens: int) -> bool:
        """Take pages until ``key``'s table covers ``num_tokens`` entries; False (nothing taken)
        when not enough pages are free."""
        table = self._tables.get(key)
        if table is None:
            raise RuntimeError(f"request {key!r} holds no pages")
        more = self.pages_for(num_tokens) - len(table)
        if more > self.num_free:
            return False
        self._take(table, more)
        return True

    def free(self, key: Hashable) -> None:
        """Drop ``key``'s references (no-op for an unknown key). Its pages nobody else holds
        become free: cached ones as the most recently used, the table's last page first (so
        eviction takes a prefix's tail before its head)."""
        table = self._tables.pop(key, None)
        self._num_keyed.pop(key, None)
        for page in reversed(table or ()):
            self._refs[page] -= 1
            if self._refs[page] == 0:
                if page in self._key_of:
                    self._lru[page] = None
                else:
                    self._empty.append(page)

    def _take(self, table: list[int], count: int) -> None:
        for _ in range(count):
            if self._empty:
                page = self._empty.pop()
            else:  # evict the least recently used cached page
                page, _ = self._lru.popitem(last=False)
                del self._page_of[self._key_of.pop(page)]
            self._refs[page] = 1
            table.append(page)

    def check(self) -> None:
        """``RuntimeError`` unless the accounting holds: every page is free or referenced by the
        tables that hold it, never both, and the key maps agree."""
        refs = [0] * self.num_pages
        for table in self._tables.values():
            for page in table:
                refs[page] += 1
        free = set(self._empty) | set(self._lru)
        problems = []
        if len(free) != len(self._empty) + len(self._lru):
            problems.append("a free page is listed twice")
        if refs != self._refs:
            problems.append("reference counts differ from the tables")
        if any((refs[p] == 0) != (p in free) for p in range(self.num_pages)):
            problems.append("a page is neither free nor referenced, or both")
        if any(p in self._key_of for p in self._empty) or any(p not in self._key_of for p in self._lru):
            problems.append("a free page sits in the wrong list")
        if {p: k for k, p in self._page_of.items()} != self._key_of:
            problems.append("the key maps disagree")
        if problems:
            raise RuntimeError(f"page accounting broken: {'; '.join(problems)}")


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
