"""The host-side page allocator: free list, reference counts, growth, freeing, block tables."""

from __future__ import annotations

import numpy as np
import pytest

from decoding.paging import BlockTables, OutOfPagesError, PageAllocator, pages_for


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
