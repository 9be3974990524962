"""Host-side page allocator, prefix cache and block tables for the paged KV cache.

The cache's layer arrays are ``[num_pages, P, Hkv, D]``; row ``b``'s logical page ``i`` (cache
positions ``i * P .. i * P + P - 1``) lives in physical page ``block_table[b, i]``. This module
only manages page numbers on the host (numpy / Python ints); the jitted decode loop reads the
block table as an int32 array, so it never has to come back to the host for a page.

``PageAllocator`` keeps a free list and a reference count per page, so a page can be shared by
several rows (prefix sharing) and returns to the pool when its last holder releases it. It also
is the prefix cache (as vLLM's): a full page can be registered under the hash of its token-block
chain (:func:`block_hashes`); a later request whose prompt starts with the same blocks finds the
pages with :meth:`PageAllocator.lookup` and shares them instead of computing them again. A
registered page nobody holds stays cached (not free) and is evicted, least recently used first,
only when ``allocate`` runs out of free pages.

``BlockTables`` grows each row's page list as the row grows, frees it when the row finishes, and
copies on write: :meth:`BlockTables.make_writable` replaces a shared or cached page that a row is
about to write by a private copy, so a shared page is never written.
"""

from __future__ import annotations

import collections
import hashlib

import numpy as np


class OutOfPagesError(ValueError):
    """The page pool cannot hold what was asked for."""


def pages_for(num_tokens: int, page_size: int) -> int:
    """Number of pages of ``page_size`` positions needed to hold ``num_tokens`` positions."""
    return -(-int(num_tokens) // int(page_size))


def block_hashes(tokens, page_size: int, parent: bytes = b"", lookahead: int = 0) -> list[bytes]:
    """Chained hashes of the full ``page_size`` blocks of ``tokens`` (a trailing partial block has
    none): ``h_i = sha256(h_{i-1} || tokens[i*P:(i+1)*P + lookahead])`` with ``h_{-1} = parent``;
    with ``lookahead``, a block has a hash only where that many tokens follow it.

    Page ``i``'s keys and values depend on every token before it, so its hash covers the whole
    chain, not only its own block. SHA-256 rather than Python's ``hash`` so that crafted prompts
    cannot collide with another request's prefix.
    """
    out, h = [], parent
    full = (len(tokens) - lookahead) // page_size * page_size
    for i in range(0, full, page_size):
        block = np.asarray(tokens[i : i + page_size + lookahead], np.int64).tobytes()
        h = hashlib.sha256(h + block).digest()
        out.append(h)
    return out


def _check_positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    return int(value)


class PageAllocator:
    """A pool of ``num_pages`` physical pages of ``page_size`` positions each, with a prefix cache.

    A page is free (on the free list), held (reference count >= 1), or cached (registered under
    a block hash with reference count 0: reusable by ``lookup`` + ``share``, evictable by
    ``allocate``). Pages are handed out lowest number first.
    """

    def __init__(self, num_pages: int, page_size: int):
        self.num_pages = _check_positive_int("num_pages", num_pages)
        self.page_size = _check_positive_int("page_size", page_size)
        self._refcount = np.zeros(self.num_pages, np.int32)
        self._free = list(range(self.num_pages - 1, -1, -1))  # pop() yields the lowest page
        self._page_of: dict[bytes, int] = {}  # block hash -> page
        self._hash_of: dict[int, bytes] = {}  # page -> block hash
        self._evictable: collections.OrderedDict[int, None] = collections.OrderedDict()  # LRU
        self.evictions = 0

    @property
    def num_free(self) -> int:
        """Pages on the free list (cached pages not counted)."""
        return len(self._free)

    @property
    def num_cached(self) -> int:
        """Registered pages nobody holds: reusable by a prefix hit, evictable when needed."""
        return len(self._evictable)

    @property
    def num_available(self) -> int:
        """Pages ``allocate`` can hand out: free plus evictable."""
        return len(self._free) + len(self._evictable)

    def refcount(self, page: int) -> int:
        return int(self._refcount[page])

    def is_cached(self, page: int) -> bool:
        """The page is registered in the prefix cache (held or not)."""
        return page in self._hash_of

    def allocate(self, n: int) -> list[int]:
        """Takes ``n`` pages (reference count 1 each): free ones first, then evicts cached pages
        least recently released first. Raises before taking any if short."""
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of pages, got {n}")
        if n > self.num_available:
            raise OutOfPagesError(
                f"asked for {n} pages of {self.page_size} positions but only "
                f"{self.num_available} of {self.num_pages} are free; use a larger pool "
                "(num_pages) or fewer tokens"
            )
        pages = []
        for _ in range(n):
            if self._free:
                pages.append(self._free.pop())
            else:
                page, _ = self._evictable.popitem(last=False)
                del self._page_of[self._hash_of.pop(page)]
                self.evictions += 1
                pages.append(page)
        self._refcount[pages] = 1
        return pages

    def share(self, pages) -> None:
        """Adds a holder to pages in use or cached (a row reading the same prefix)."""
        for page in pages:
            if self._refcount[page] < 1 and page not in self._evictable:
                raise ValueError(f"page {page} is free; only pages in use can be shared")
            self._evictable.pop(page, None)
            self._refcount[page] += 1

    def release(self, pages) -> None:
        """Drops one holder per page; a page nobody holds goes back to the free list, or stays
        cached (most recently used) if registered."""
        for page in pages:
            if self._refcount[page] < 1:
                raise ValueError(f"page {page} is already free")
            self._refcount[page] -= 1
            if self._refcount[page] == 0:
                if page in self._hash_of:
                    self._evictable[page] = None
                else:
                    self._free.append(page)
        self._free.sort(reverse=True)

    def register(self, page: int, block_hash: bytes) -> None:
        """Caches held page ``page`` as holding the block chain ``block_hash``; a no-op when that
        chain is already cached (in another page) or the page is already registered."""
        if self._refcount[page] < 1:
            raise ValueError(f"page {page} is not held; only pages in use can be registered")
        if block_hash in self._page_of or page in self._hash_of:
            return
        self._page_of[block_hash] = page
        self._hash_of[page] = block_hash

    def lookup(self, hashes) -> list[int]:
        """Pages caching the longest prefix of the block chain ``hashes`` (no holder added)."""
        pages = []
        for h in hashes:
            page = self._page_of.get(h)
            if page is None:
                break
            pages.append(page)
        return pages


class BlockTables:
    """Per-row page lists over one allocator, exported as a ``[B, max_pages]`` int32 table.

    Entries past a row's pages are ``-1`` (never read by the cache, which only looks at
    positions below the row's length).
    """

    def __init__(self, allocator: PageAllocator, batch: int, max_pages: int):
        self.allocator = allocator
        self.batch = _check_positive_int("batch", batch)
        self.max_pages = _check_positive_int("max_pages", max_pages)
        self.rows: list[list[int]] = [[] for _ in range(self.batch)]

    @property
    def page_size(self) -> int:
        return self.allocator.page_size

    def capacity(self, row: int) -> int:
        """Cache positions row ``row`` can hold with the pages it has."""
        return len(self.rows[row]) * self.page_size

    def pages_needed(self, num_tokens) -> int:
        """Pages still to allocate so that row ``b`` holds ``num_tokens[b]`` positions."""
        return sum(
            max(pages_for(n, self.page_size) - len(pages), 0)
            for n, pages in zip(num_tokens, self.rows, strict=True)
        )

    def reserve(self, num_tokens) -> None:
        """Grows every row ``b`` to hold ``num_tokens[b]`` positions, all rows or none.

        Raises ``OutOfPagesError`` (before allocating anything) when the pool is too small, and
        ``ValueError`` when a row would need more than ``max_pages`` pages.
        """
        num_tokens = [int(n) for n in num_tokens]
        if len(num_tokens) != self.batch:
            raise ValueError(f"num_tokens must have {self.batch} entries, got {len(num_tokens)}")
        for b, n in enumerate(num_tokens):
            if pages_for(n, self.page_size) > self.max_pages:
                raise ValueError(
                    f"row {b} needs {n} positions = {pages_for(n, self.page_size)} pages of "
                    f"{self.page_size}, more than max_pages={self.max_pages}"
                )
        needed = self.pages_needed(num_tokens)
        if needed > self.allocator.num_available:
            raise OutOfPagesError(
                f"{needed} pages of {self.page_size} positions are needed for rows holding "
                f"{num_tokens} positions, but only {self.allocator.num_available} of "
                f"{self.allocator.num_pages} are free; raise num_pages or shorten the requests"
            )
        for n, pages in zip(num_tokens, self.rows, strict=True):
            pages.extend(self.allocator.allocate(max(pages_for(n, self.page_size) - len(pages), 0)))

    def share_prefix(self, src: int, dst: int, num_pages: int) -> None:
        """Row ``dst`` (empty) starts with the first ``num_pages`` pages of row ``src``."""
        if self.rows[dst]:
            raise ValueError(f"row {dst} already holds pages; share into an empty row")
        pages = self.rows[src][:num_pages]
        self.allocator.share(pages)
        self.rows[dst] = list(pages)

    def adopt(self, row: int, pages) -> None:
        """Row ``row`` (empty) starts with ``pages`` (e.g. prefix-cache hits), one holder added."""
        if self.rows[row]:
            raise ValueError(f"row {row} already holds pages; adopt into an empty row")
        if len(pages) > self.max_pages:
            raise ValueError(f"{len(pages)} pages exceed max_pages={self.max_pages}")
        self.allocator.share(pages)
        self.rows[row] = list(pages)

    def _shared(self, page: int) -> bool:
        return self.allocator.refcount(page) > 1 or self.allocator.is_cached(page)

    def pages_to_write(self, row: int, start: int, stop: int) -> int:
        """Pages ``make_writable(row, start, stop)`` would allocate: growth plus copies."""
        P, pages = self.page_size, self.rows[row]
        have = min(len(pages), pages_for(stop, P))
        copies = sum(self._shared(pages[i]) for i in range(start // P, have))
        return max(pages_for(stop, P) - len(pages), 0) + copies

    def make_writable(self, row: int, start: int, stop: int) -> list[tuple[int, int]]:
        """Readies positions ``[start, stop)`` of row ``row`` for writing, all or nothing.

        Grows the row to hold ``stop`` positions and replaces every page in the range that is
        shared (another holder) or cached (its content is promised to future prefix hits) by a
        fresh page, copy on write. Returns the ``(src, dst)`` page copies the caller must apply
        to the cache arrays before writing. Raises ``OutOfPagesError`` before changing anything
        when the pool is short.
        """
        need = self.pages_to_write(row, start, stop)
        if pages_for(stop, self.page_size) > self.max_pages:
            raise ValueError(
                f"row {row} needs {stop} positions, more than max_pages={self.max_pages} pages"
            )
        if need > self.allocator.num_available:
            raise OutOfPagesError(
                f"row {row} needs {need} more pages to write positions [{start}, {stop}) but "
                f"only {self.allocator.num_available} of {self.allocator.num_pages} are free"
            )
        pages, P, copies = self.rows[row], self.page_size, []
        for i in range(start // P, min(len(pages), pages_for(stop, P))):
            if self._shared(pages[i]):
                (fresh,) = self.allocator.allocate(1)
                copies.append((pages[i], fresh))
                self.allocator.release([pages[i]])
                pages[i] = fresh
        pages.extend(self.allocator.allocate(max(pages_for(stop, P) - len(pages), 0)))
        return copies

    def free(self, row: int) -> None:
        """Releases row ``row``'s pages (the row finished)."""
        self.allocator.release(self.rows[row])
        self.rows[row] = []

    def free_all(self) -> None:
        for b in range(self.batch):
            self.free(b)

    def table(self, fill: int = -1) -> np.ndarray:
        """The block table [B, max_pages] int32, ``fill`` past each row's pages."""
        out = np.full((self.batch, self.max_pages), fill, np.int32)
        for b, pages in enumerate(self.rows):
            out[b, : len(pages)] = pages
        return out
