"""The host-side page allocator: free list, reference counts, growth, freeing, block tables,
prefix cache (block-chain hashes, LRU eviction) and copy on write."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from decoding.paging import BlockTables, OutOfPagesError, PageAllocator, block_hashes, pages_for


def test_pages_for_rounds_up():
    assert [pages_for(n, 4) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]


def test_allocate_release_reuses_pages():
    alloc = PageAllocator(num_pages=6, page_size=4)
    a = alloc.allocate(2)
    b = alloc.allocate(3)
    assert a == [0, 1] and b == [2, 3, 4]
    assert alloc.num_free == 1
    alloc.release(a)
    assert alloc.num_free == 3
    assert alloc.allocate(3) == [0, 1, 5]
    assert all(alloc.refcount(p) == 1 for p in range(6))


def test_out_of_pages_takes_nothing():
    alloc = PageAllocator(num_pages=4, page_size=8)
    alloc.allocate(3)
    with pytest.raises(OutOfPagesError, match="asked for 2 pages .* only 1 of 4 are free"):
        alloc.allocate(2)
    assert alloc.num_free == 1


def test_shared_page_freed_by_last_holder():
    alloc = PageAllocator(num_pages=3, page_size=2)
    (p,) = alloc.allocate(1)
    alloc.share([p])
    assert alloc.refcount(p) == 2
    alloc.release([p])
    assert alloc.num_free == 2 and alloc.refcount(p) == 1
    alloc.release([p])
    assert alloc.num_free == 3
    with pytest.raises(ValueError, match="already free"):
        alloc.release([p])
    with pytest.raises(ValueError, match="is free"):
        alloc.share([p])


def test_block_tables_grow_and_free():
    alloc = PageAllocator(num_pages=10, page_size=4)
    tables = BlockTables(alloc, batch=3, max_pages=4)
    tables.reserve([5, 1, 0])  # 2 + 1 + 0 pages
    np.testing.assert_array_equal(
        tables.table(), [[0, 1, -1, -1], [2, -1, -1, -1], [-1, -1, -1, -1]]
    )
    assert tables.table().dtype == np.int32
    tables.reserve([8, 9, 3])  # row 0 fits already; row 1 grows by 2; row 2 takes 1
    assert [len(r) for r in tables.rows] == [2, 3, 1]
    assert tables.capacity(1) == 12
    assert alloc.num_free == 4
    tables.free(0)
    assert alloc.num_free == 6
    assert tables.table()[0].tolist() == [-1] * 4
    tables.free_all()
    assert alloc.num_free == 10


def test_reserve_is_all_or_nothing_with_clear_error():
    alloc = PageAllocator(num_pages=4, page_size=16)
    tables = BlockTables(alloc, batch=2, max_pages=8)
    with pytest.raises(OutOfPagesError, match="6 pages of 16 positions are needed .* only 4"):
        tables.reserve([40, 33])  # 3 + 3 pages
    assert alloc.num_free == 4 and tables.rows == [[], []]
    with pytest.raises(ValueError, match="max_pages=8"):
        tables.reserve([16 * 8 + 1, 1])


def test_share_prefix_between_rows():
    alloc = PageAllocator(num_pages=8, page_size=4)
    tables = BlockTables(alloc, batch=2, max_pages=4)
    tables.reserve([12, 0])
    tables.share_prefix(0, 1, 2)
    assert tables.rows[1] == tables.rows[0][:2]
    tables.reserve([12, 16])  # row 1 grows past the shared prefix with its own pages
    assert tables.rows[1][2:] == [3, 4]
    tables.free(0)
    assert alloc.num_free == 8 - 2 - 2  # the shared prefix is still held by row 1
    tables.free(1)
    assert alloc.num_free == 8


@pytest.mark.parametrize(
    "kwargs", [{"num_pages": 0, "page_size": 4}, {"num_pages": 4, "page_size": 0}]
)
def test_bad_pool_raises(kwargs):
    with pytest.raises(ValueError, match=next(k for k, v in kwargs.items() if v == 0)):
        PageAllocator(**kwargs)


def test_block_hashes_chain_full_blocks_only():
    a = block_hashes([1, 2, 3, 4, 5, 6, 7], 3)
    assert len(a) == 2  # the partial block [7] has no hash
    assert block_hashes([1, 2, 3, 4, 5, 6], 3) == a
    b = block_hashes([9, 2, 3, 4, 5, 6], 3)  # same second block, other first block
    assert a[0] != b[0] and a[1] != b[1]  # the chain: page 1 depends on page 0's tokens
    assert block_hashes([4, 5, 6], 3, parent=a[0]) == a[1:]


def test_prefix_cache_lookup_share_and_lru_eviction():
    alloc = PageAllocator(num_pages=4, page_size=2)
    pages = alloc.allocate(3)
    hashes = block_hashes([1, 2, 3, 4, 5, 6], 2)
    for page, h in zip(pages, hashes, strict=True):
        alloc.register(page, h)
    assert alloc.lookup(hashes) == pages
    assert alloc.lookup([hashes[0], b"other", hashes[2]]) == pages[:1]  # longest prefix only
    alloc.release(pages[2:])
    alloc.release(pages[:2])  # release order = LRU order: page 2 first, then 0, 1
    assert (alloc.num_free, alloc.num_cached, alloc.num_available) == (1, 3, 4)
    alloc.share(pages[:1])  # a prefix hit revives a cached page
    assert alloc.refcount(pages[0]) == 1 and alloc.num_cached == 2
    assert alloc.allocate(2) == [3, pages[2]]  # free page first, then the least recent cached
    assert alloc.evictions == 1 and alloc.lookup(hashes) == pages[:2]
    assert not alloc.is_cached(pages[2])
    with pytest.raises(OutOfPagesError):
        alloc.allocate(2)  # page 1 is evictable, page 0 is held
    with pytest.raises(ValueError, match="not held"):
        alloc.register(pages[1], b"x")


def test_register_keeps_first_page_for_a_chain():
    alloc = PageAllocator(num_pages=3, page_size=2)
    a, b = alloc.allocate(2)
    alloc.register(a, b"h")
    alloc.register(b, b"h")  # the same content computed twice: the first copy stays cached
    assert alloc.lookup([b"h"]) == [a] and not alloc.is_cached(b)
    alloc.release([a, b])
    assert alloc.num_free == 2 and alloc.num_cached == 1


def test_make_writable_copies_shared_and_cached_pages():
    alloc = PageAllocator(num_pages=8, page_size=4)
    tables = BlockTables(alloc, batch=2, max_pages=4)
    tables.reserve([8, 0])
    alloc.register(tables.rows[0][0], b"page0")
    tables.adopt(1, tables.rows[0])  # row 1 shares both pages of row 0
    assert tables.pages_to_write(1, 6, 10) == 2  # copy page 1, grow by page 2
    copies = tables.make_writable(1, 6, 10)
    assert copies == [(1, 2)] and tables.rows[1] == [0, 2, 3]
    assert [alloc.refcount(p) for p in (0, 1, 2, 3)] == [2, 1, 1, 1]
    assert tables.make_writable(1, 8, 12) == []  # own pages: written in place
    copies = tables.make_writable(0, 3, 4)  # page 0 is cached (and shared): row 0 copies too
    assert copies == [(0, 4)] and alloc.refcount(0) == 1 and alloc.is_cached(0)
    tables.free_all()
    assert alloc.num_available == 8 and alloc.num_cached == 1


def test_make_writable_is_all_or_nothing():
    alloc = PageAllocator(num_pages=3, page_size=4)
    tables = BlockTables(alloc, batch=2, max_pages=4)
    tables.reserve([8, 0])
    tables.adopt(1, tables.rows[0])
    with pytest.raises(OutOfPagesError, match="needs 2 more pages"):
        tables.make_writable(1, 4, 12)
    assert tables.rows[1] == [0, 1] and alloc.num_free == 1
    with pytest.raises(ValueError, match="max_pages=4"):
        tables.make_writable(0, 0, 17)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from("grow share write free"), st.integers(0, 2), st.integers(1, 20)),
        max_size=40,
    )
)
def test_random_operations_keep_the_books(ops):
    """Whatever rows do, each page's count equals the rows holding it, every page is exactly one
    of free / cached / held, and freeing every row leaves no page held."""
    alloc = PageAllocator(num_pages=10, page_size=4)
    tables = BlockTables(alloc, batch=3, max_pages=6)
    for op, row, n in ops:
        other = (row + 1) % 3
        try:
            if op == "grow":
                tables.make_writable(row, tables.capacity(row), tables.capacity(row) + n)
            elif op == "share" and not tables.rows[row]:
                tables.adopt(row, tables.rows[other][: n % 4])
            elif op == "write" and tables.rows[row]:
                tables.make_writable(row, n % tables.capacity(row), tables.capacity(row))
            elif op == "free":
                for i, page in enumerate(tables.rows[row]):
                    alloc.register(page, bytes([row, i]))  # as if every page were full
                tables.free(row)
        except (OutOfPagesError, ValueError):
            pass
        held = np.zeros(10, int)
        for pages in tables.rows:
            np.add.at(held, pages, 1)
        assert [alloc.refcount(p) for p in range(10)] == held.tolist()
        assert alloc.num_free + alloc.num_cached + int((held > 0).sum()) == 10
    tables.free_all()
    assert alloc.num_available == 10
