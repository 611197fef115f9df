"""PagePool accounting and extend_slots slot arithmetic (CPU only)."""

from __future__ import annotations

import random

import pytest

from modeserve.engine.scheduler.kv_allocator import PagePool, extend_slots, pages_needed

PAGE_SIZES = [1, 16]


@pytest.mark.parametrize("num_pages, page_size", [(1, 1), (0, 16), (4, 0), (4, -1)])
def test_bad_construction(num_pages: int, page_size: int) -> None:
    with pytest.raises(ValueError):
        PagePool(num_pages, page_size)


@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_sizes(ps: int) -> None:
    pool = PagePool(10, ps)
    assert pool.page_size == ps
    assert pool.num_pages == 10
    assert pool.num_total_pages == 9
    assert pool.num_free_pages == 9
    assert pool.num_used_pages == 0
    assert pool.capacity_tokens == 9 * ps


@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_alloc_free_accounting(ps: int) -> None:
    pool = PagePool(10, ps)
    a = pool.alloc(3)
    assert a == [1, 2, 3]
    b = pool.alloc(6)
    assert b is not None and len(b) == 6
    assert sorted(a + b) == list(range(1, 10))  # page 0 is never handed out
    assert pool.num_free_pages == 0
    assert pool.alloc(1) is None
    assert pool.alloc(0) == []
    pool.free(a)
    assert pool.num_free_pages == 3
    assert all(pool.is_free(p) for p in a)
    assert pool.alloc(4) is None  # all-or-nothing
    assert pool.num_free_pages == 3
    assert pool.alloc(3) == a  # freed pages come back in the order they were freed
    pool.free(a + b)
    assert pool.num_free_pages == 9


def test_alloc_negative() -> None:
    with pytest.raises(ValueError):
        PagePool(4, 1).alloc(-1)


@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_free_errors_are_atomic(ps: int) -> None:
    pool = PagePool(8, ps)
    pages = pool.alloc(4)
    assert pages is not None
    pool.free([pages[0]])
    with pytest.raises(ValueError, match="double free"):
        pool.free([pages[1], pages[0]])
    with pytest.raises(ValueError, match="double free"):
        pool.free([pages[1], pages[1]])
    with pytest.raises(ValueError, match="reserved"):
        pool.free([pages[1], 0])
    with pytest.raises(ValueError, match="out of range"):
        pool.free([pages[1], 8])
    with pytest.raises(ValueError, match="out of range"):
        pool.free([-1])
    assert pool.num_free_pages == 8 - 1 - 3  # nothing above was freed
    assert not pool.is_free(pages[1])
    pool.free(pages[1:])
    assert pool.num_free_pages == 7


@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_slots_for_and_pages_of(ps: int) -> None:
    pool = PagePool(8, ps)
    slots = pool.slots_for([3, 1])
    assert slots == list(range(3 * ps, 4 * ps)) + list(range(ps, 2 * ps))
    assert pool.pages_of(slots) == [3, 1]
    assert pool.pages_of([ps * 5, ps * 2, ps * 5]) == [5, 2]
    assert pool.pages_of([]) == []
    with pytest.raises(ValueError):
        pool.pages_of([8 * ps])
    with pytest.raises(ValueError):
        pool.slots_for([8])


def _check_layout(pool: PagePool, kv: list[int], own_start: int) -> None:
    """Own tokens sit consecutively in their pages, position p at offset p % page_size."""
    ps = pool.page_size
    own_pages = pool.pages_of(kv[own_start:])
    for p in range(own_start, len(kv)):
        assert kv[p] == own_pages[(p - own_start) // ps] * ps + p % ps


@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_extend_across_page_boundaries(ps: int) -> None:
    pool = PagePool(32, ps)
    kv: list[int] = []
    steps = [1, ps - 1, 1, 2 * ps + 3, max(1, ps - 3), 1, 1, 5 * ps]
    for n in steps:
        before = pool.num_free_pages
        new = extend_slots(pool, kv, len(kv), n)
        assert new is not None and len(new) == n
        assert before - pool.num_free_pages == pages_needed(ps, len(kv), n)
        kv += new
        _check_layout(pool, kv, 0)
    assert len(set(kv)) == len(kv)
    assert pool.num_used_pages == -(-len(kv) // ps)


@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_extend_after_borrowed_prefix(ps: int) -> None:
    """A page-aligned borrowed prefix is never extended in place: its last page is not the request's."""
    pool = PagePool(32, ps)
    cache_pages = pool.alloc(2)
    assert cache_pages is not None
    pool.alloc(1)  # the page right after the cache's pages is someone else's
    prefix = pool.slots_for(cache_pages)
    new = extend_slots(pool, prefix, len(prefix), 1)
    assert new is not None
    assert new[0] % ps == 0 and pool.pages_of(new)[0] not in cache_pages
    kv = prefix + new
    more = extend_slots(pool, kv, len(kv), ps)
    assert more is not None
    kv += more
    _check_layout(pool, kv, len(prefix))
    assert kv[: len(prefix)] == prefix


@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_extend_short_allocates_nothing(ps: int) -> None:
    pool = PagePool(3, ps)
    first = extend_slots(pool, [], 0, 1)
    assert first is not None
    assert extend_slots(pool, first, 1, 2 * ps + 1) is None
    assert pool.num_free_pages == 1
    if ps > 1:  # the rest of the current page needs no allocation at all
        rest = extend_slots(PagePool(2, ps), [ps], 1, ps - 1)
        assert rest == list(range(ps + 1, 2 * ps))
    assert extend_slots(pool, first, 1, 0) == []


def test_extend_bad_input() -> None:
    pool = PagePool(8, 16)
    with pytest.raises(ValueError, match="must equal"):
        extend_slots(pool, [16, 17], 3, 1)
    with pytest.raises(ValueError, match="offset"):
        extend_slots(pool, [16, 18], 2, 1)  # position 1 at offset 2
    with pytest.raises(ValueError):
        extend_slots(pool, [], 0, -1)


@pytest.mark.parametrize("ps", [1, 3, 16])
def test_random_extend_and_free(ps: int) -> None:
    rng = random.Random(1234 + ps)
    pool = PagePool(40, ps)
    reqs: list[list[int]] = []
    for _ in range(400):
        if reqs and rng.random() < 0.3:
            kv = reqs.pop(rng.randrange(len(reqs)))
            pool.free(pool.pages_of(kv))
        elif reqs and rng.random() < 0.6:
            kv = rng.choice(reqs)
            new = extend_slots(pool, kv, len(kv), rng.randint(0, 2 * ps + 1))
            if new is not None:
                kv += new
                _check_layout(pool, kv, 0)
        else:
            new = extend_slots(pool, [], 0, rng.randint(1, 3 * ps))
            if new is not None:
                reqs.append(new)
        held = [p for kv in reqs for p in pool.pages_of(kv)]
        assert len(held) == len(set(held))
        assert len(held) + pool.num_free_pages == pool.num_total_pages
    for kv in reqs:
        pool.free(pool.pages_of(kv))
    assert pool.num_free_pages == pool.num_total_pages
