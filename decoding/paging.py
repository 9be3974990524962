"""Host-side page allocator and block tables for the paged KV cache.

The cache's layer arrays are ``[num_pages, P, Hkv, D]``; row ``b``'s logical page ``i`` (cache
positions ``i * P .. i * P + P - 1``) lives in physical page ``block_table[b, i]``. This module
only manages page numbers on the host (numpy / Python ints); the jitted decode loop reads the
block table as an int32 array, so it never has to come back to the host for a page.

``PageAllocator`` keeps a free list and a reference count per page, so a page can be shared by
several rows (prefix sharing) and returns to the free list when its last holder releases it.
``BlockTables`` grows each row's page list as the row grows and frees it when the row finishes.
"""

from __future__ import annotations

import numpy as np


class OutOfPagesError(ValueError):
    """The page pool cannot hold what was asked for."""


def pages_for(num_tokens: int, page_size: int) -> int:
    """Number of pages of ``page_size`` positions needed to hold ``num_tokens`` positions."""
    return -(-int(num_tokens) // int(page_size))


def _check_positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    return int(value)


class PageAllocator:
    """A pool of ``num_pages`` physical pages of ``page_size`` positions each.

    Pages are handed out lowest number first; ``release`` puts a page back on the free list when
    its reference count drops to zero.
    """

    def __init__(self, num_pages: int, page_size: int):
        self.num_pages = _check_positive_int("num_pages", num_pages)
        self.page_size = _check_positive_int("page_size", page_size)
        self._refcount = np.zeros(self.num_pages, np.int32)
        self._free = list(range(self.num_pages - 1, -1, -1))  # pop() yields the lowest page

    @property
    def num_free(self) -> int:
        return len(self._free)

    def refcount(self, page: int) -> int:
        return int(self._refcount[page])

    def allocate(self, n: int) -> list[int]:
        """Takes ``n`` free pages (reference count 1 each); raises before taking any if short."""
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of pages, got {n}")
        if n > len(self._free):
            raise OutOfPagesError(
                f"asked for {n} pages of {self.page_size} positions but only {len(self._free)} "
                f"of {self.num_pages} are free; use a larger pool (num_pages) or fewer tokens"
            )
        pages = [self._free.pop() for _ in range(n)]
        self._refcount[pages] = 1
        return pages

    def share(self, pages) -> None:
        """Adds a holder to pages already in use (a second row reading the same prefix)."""
        for page in pages:
            if self._refcount[page] < 1:
                raise ValueError(f"page {page} is free; only pages in use can be shared")
            self._refcount[page] += 1

    def release(self, pages) -> None:
        """Drops one holder per page; pages nobody holds go back to the free list."""
        for page in pages:
            if self._refcount[page] < 1:
                raise ValueError(f"page {page} is already free")
            self._refcount[page] -= 1
            if self._refcount[page] == 0:
                self._free.append(page)
        self._free.sort(reverse=True)


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
        if needed > self.allocator.num_free:
            raise OutOfPagesError(
                f"{needed} pages of {self.page_size} positions are needed for rows holding "
                f"{num_tokens} positions, but only {self.allocator.num_free} of "
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

    def free(self, row: int) -> None:
        """Releases row ``row``'s pages (the row finished)."""
        self.allocator.release(self.rows[row])
        self.rows[row] = []

    def free_all(self) -> None:
        for b in range(self.batch):
            self.free(b)

    def table(self) -> np.ndarray:
        """The block table [B, max_pages] int32, ``-1`` past each row's pages."""
        out = np.full((self.batch, self.max_pages), -1, np.int32)
        for b, pages in enumerate(self.rows):
            out[b, : len(pages)] = pages
        return out
