"""RadixCache: matching, splitting, ownership on insert, locking, LRU eviction, page accounting."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

from modeserve.engine.scheduler.kv_allocator import PagePool, extend_slots, pages_needed
from modeserve.engine.scheduler.radix_cache import RadixCache, RadixNode

PAGE_SIZES = [1, 16]


def toks(ps: int, *labels: int) -> list[int]:
    """One page of tokens per label; different labels give different first tokens."""
    return [label * 100 + i for label in labels for i in range(ps)]


def own(pool: PagePool, n: int) -> list[int]:
    slots = extend_slots(pool, [], 0, n)
    assert slots is not None
    return slots


def make(ps: int, num_pages: int = 64) -> tuple[PagePool, RadixCache]:
    pool = PagePool(num_pages, ps)
    return pool, RadixCache(pool)


def insert_new(pool: PagePool, cache: RadixCache, tokens: list[int]) -> list[int]:
    """Fresh slots for ``tokens``, inserted into a cache that holds none of their pages yet: the slots."""
    kv = own(pool, len(tokens))
    assert cache.insert(tokens, kv) == 0
    return kv


@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_empty_cache(ps: int) -> None:
    _, cache = make(ps)
    m = cache.match_prefix(toks(ps, 1, 2))
    assert m.kv_locs == [] and m.node is cache.root
    assert cache.match_prefix([]).node is cache.root
    assert cache.num_queries == 2 and cache.num_hit_tokens == 0
    assert cache.num_cached_pages == 0 and cache.evict(5) == 0


@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_match_after_insert(ps: int) -> None:
    pool, cache = make(ps)
    t = toks(ps, 1, 2, 3)
    kv = insert_new(pool, cache, t)
    assert cache.num_cached_pages == 3 and cache.num_evictable_pages == 3
    m = cache.match_prefix(t + toks(ps, 4))
    assert m.kv_locs == kv
    assert cache.match_prefix(toks(ps, 1, 2)).kv_locs == kv[: 2 * ps]
    assert cache.match_prefix(toks(ps, 2)).kv_locs == []
    assert cache.num_queries == 3 and cache.num_hit_tokens == 5 * ps


@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_partial_page_truncation(ps: int) -> None:
    pool, cache = make(ps)
    t = toks(ps, 1, 2, 3)[: 3 * ps - 1] if ps > 1 else toks(ps, 1, 2)
    kv = insert_new(pool, cache, t)
    assert cache.num_cached_pages == 2
    pool.free(pool.pages_of(kv[2 * ps :]))  # the partial last page stays the caller's
    assert cache.match_prefix(t).kv_locs == kv[: 2 * ps]
    assert cache.match_prefix(t[: 2 * ps - 1]).kv_locs == kv[:ps]
    if ps > 1:
        assert cache.match_prefix(t[: ps - 1]).kv_locs == []
        assert cache.insert(t[: ps - 1], kv[: ps - 1]) == 0  # nothing aligned: no-op
    assert cache.evict(100) == 2
    assert pool.num_free_pages == pool.num_total_pages


@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_split_on_divergence(ps: int) -> None:
    pool, cache = make(ps)
    a, b = toks(ps, 1, 2, 3), toks(ps, 1, 2, 4)
    kv_a, kv_b = own(pool, len(a)), own(pool, len(b))
    cache.insert(a, kv_a)
    assert cache.insert(b, kv_b) == 2 * ps
    pool.free(pool.pages_of(kv_b[: 2 * ps]))  # duplicates of what the tree already holds
    assert cache.num_cached_pages == 4
    assert cache.match_prefix(a).kv_locs == kv_a
    assert cache.match_prefix(b).kv_locs == kv_a[: 2 * ps] + kv_b[2 * ps :]
    mid = cache.match_prefix(toks(ps, 1, 2, 5)).node
    assert len(mid.key) == 2 * ps and len(mid.children) == 2 and mid.parent is cache.root
    # a match that ends inside a node splits it so the returned node ends exactly at the match
    top = cache.match_prefix(toks(ps, 1, 9)).node
    assert top.key == toks(ps, 1) and top.value == kv_a[:ps] and mid.parent is top
    assert cache.num_cached_pages == 4


@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_insert_returns_duplicate_count(ps: int) -> None:
    pool, cache = make(ps)
    t = toks(ps, 1, 2, 3)
    kv = insert_new(pool, cache, t)
    dup = own(pool, len(t))
    assert cache.insert(t, dup) == 3 * ps
    pool.free(pool.pages_of(dup))
    # a request that borrowed the prefix through match_prefix and extended it
    m = cache.match_prefix(t)
    cache.lock(m.node)
    longer = t + toks(ps, 4, 5)
    ext = extend_slots(pool, m.kv_locs, len(m.kv_locs), 2 * ps)
    assert ext is not None
    assert cache.insert(longer, m.kv_locs + ext) == 3 * ps  # the tree's own slots: nothing to free
    cache.unlock(m.node)
    assert cache.match_prefix(longer).kv_locs == kv + ext
    assert cache.num_cached_pages == 5
    assert pool.num_free_pages == pool.num_total_pages - 5


@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_insert_rejects_bad_slots(ps: int) -> None:
    pool, cache = make(ps)
    t = toks(ps, 1, 2)
    kv = own(pool, len(t))
    with pytest.raises(ValueError, match="len"):
        cache.insert(t, kv[:-1])
    cache.insert(t, kv)
    with pytest.raises(ValueError, match="already held"):
        cache.insert(toks(ps, 7), kv[:ps])
    free_page = pool.alloc(1)
    assert free_page is not None
    pool.free(free_page)
    with pytest.raises(ValueError, match="not allocated"):
        cache.insert(toks(ps, 7), pool.slots_for(free_page))
    with pytest.raises(ValueError, match="not allocated"):
        cache.insert(toks(ps, 7), pool.slots_for([0]))
    if ps > 1:
        shifted = own(pool, 2 * ps)[1 : ps + 1]
        with pytest.raises(ValueError, match="whole page"):
            cache.insert(toks(ps, 7), shifted)
    assert cache.num_cached_pages == 2


@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_lock_prevents_eviction(ps: int) -> None:
    pool, cache = make(ps)
    a, b = toks(ps, 1, 2, 3), toks(ps, 4, 5)
    kv_a, kv_b = own(pool, len(a)), own(pool, len(b))
    cache.insert(a, kv_a)
    cache.insert(b, kv_b)
    node = cache.match_prefix(a[: 2 * ps]).node  # splits a: locks only its first two pages
    cache.lock(node)
    cache.lock(node)
    assert node.lock_ref == 2 and node.parent is cache.root
    assert cache.num_evictable_pages == 3
    assert cache.evict(100) == 3
    assert cache.match_prefix(a).kv_locs == kv_a[: 2 * ps]
    assert cache.match_prefix(b).kv_locs == []
    cache.unlock(node)
    assert cache.evict(100) == 0
    cache.unlock(node)
    assert cache.num_evictable_pages == 2
    with pytest.raises(ValueError, match="below zero"):
        cache.unlock(node)
    assert cache.evict(100) == 2
    assert pool.num_free_pages == pool.num_total_pages
    with pytest.raises(ValueError, match="evicted"):
        cache.lock(node)
    cache.lock(cache.root)  # no-op
    cache.unlock(cache.root)


def test_foreign_node_rejected() -> None:
    pool, cache = make(1)
    other = RadixCache(pool)
    kv = own(pool, 2)
    other.insert([1, 2], kv)
    node = other.match_prefix([1, 2]).node
    with pytest.raises(ValueError, match="does not belong"):
        cache.lock(node)
    with pytest.raises(ValueError, match="does not belong"):
        cache.unlock(RadixNode([], [], None, 99))


@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_lru_eviction_order(ps: int) -> None:
    pool, cache = make(ps)
    seqs = [toks(ps, 1, 2), toks(ps, 3, 4), toks(ps, 5, 6)]
    kvs = [own(pool, len(s)) for s in seqs]
    for s, kv in zip(seqs, kvs):
        cache.insert(s, kv)
    cache.match_prefix(seqs[0])  # 0 is now the most recently used; 1 is the oldest
    assert cache.evict(2) == 2
    assert [len(cache.match_prefix(s).kv_locs) for s in seqs] == [2 * ps, 0, 2 * ps]
    # the matches above touched 0 then 2; 0 is the least recent now. Evicting 1 page trims its tail.
    assert cache.evict(1) == 1
    assert cache.match_prefix(seqs[0]).kv_locs == kvs[0][:ps]
    assert cache.evict(2) == 2  # 2 is now the oldest leaf
    assert cache.match_prefix(seqs[2]).kv_locs == []
    assert cache.match_prefix(seqs[0]).kv_locs == kvs[0][:ps]
    assert cache.num_cached_pages == 1


@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_parent_becomes_leaf(ps: int) -> None:
    pool, cache = make(ps)
    a, b, c = toks(ps, 1, 2), toks(ps, 1, 3), toks(ps, 7)
    for s in (a, b, c):
        kv = own(pool, len(s))
        done = cache.insert(s, kv)
        pool.free(pool.pages_of(kv[:done]))
    cache.match_prefix(c)  # c is the most recent; a's and b's leaves go first, then their parent
    assert cache.evict(3) == 3
    assert cache.match_prefix(c).kv_locs != [] and cache.num_cached_pages == 1


@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_evict_everything_round_trips(ps: int) -> None:
    pool, cache = make(ps, num_pages=200)
    rng = random.Random(7)
    initial = pool.num_free_pages
    for _ in range(30):
        t = [rng.randrange(4) for _ in range(rng.randint(0, 6 * ps))]
        kv = own(pool, len(t)) if t else []
        done = cache.insert(t, kv)
        pool.free(pool.pages_of(kv[:done]))
        pool.free(pool.pages_of(kv[len(t) // ps * ps :]))
    cached = cache.num_cached_pages
    assert cached == len(cache.cached_pages()) == pool.num_used_pages
    assert cache.evict(cached + 10) == cached
    assert pool.num_free_pages == initial and cache.num_cached_pages == 0


@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_reset(ps: int) -> None:
    pool, cache = make(ps)
    t = toks(ps, 1, 2)
    cache.insert(t, own(pool, len(t)))
    m = cache.match_prefix(t)
    cache.lock(m.node)
    with pytest.raises(ValueError, match="locked"):
        cache.reset()
    cache.unlock(m.node)
    cache.reset()
    assert pool.num_free_pages == pool.num_total_pages
    assert cache.num_cached_pages == 0 and cache.num_queries == 0
    assert cache.match_prefix(t).kv_locs == []


def test_evict_negative() -> None:
    with pytest.raises(ValueError):
        make(1)[1].evict(-1)


# ---------------------------------------------------------------- randomized model check


@dataclass
class Req:
    tokens: list[int]
    kv: list[int]
    matched: int  # kv[:matched] are the tree's (locked through node); the rest is the request's
    node: RadixNode


class Harness:
    """Drives pool + cache like a scheduler would and checks them against a dict model."""

    def __init__(self, ps: int, seed: int) -> None:
        self.ps, self.rng = ps, random.Random(seed)
        self.pool = PagePool(16 if ps > 1 else 40, ps)
        self.cache = RadixCache(self.pool)
        self.model: dict[tuple[int, ...], int] = {}  # every cached aligned prefix -> its last page
        self.active: list[Req] = []
        scale = 4 * ps if ps > 1 else 12
        self.scale = scale
        self.bases = [[self.rng.randrange(3) for _ in range(self.rng.randint(0, scale))] for _ in range(4)]

    def gen(self) -> list[int]:
        base = self.rng.choice(self.bases)
        tail = [self.rng.randrange(3) for _ in range(self.rng.randint(0, self.scale))]
        return base[: self.rng.randint(0, len(base))] + tail

    def expected(self, tokens: list[int]) -> list[int]:
        ps, k, pages = self.ps, self.ps, []
        while k <= len(tokens) and tuple(tokens[:k]) in self.model:
            pages.append(self.model[tuple(tokens[:k])])
            k += ps
        return self.pool.slots_for(pages)

    def match(self, tokens: list[int]) -> list[int]:
        m = self.cache.match_prefix(tokens)
        assert m.kv_locs == self.expected(tokens)
        return m.kv_locs

    def evict(self, n: int) -> None:
        before = self.cache.num_evictable_pages
        assert self.cache.evict(n) == min(n, before)
        self.model = {k: p for k, p in self.model.items() if not self.pool.is_free(p)}
        assert all(len(k) == self.ps or k[: -self.ps] in self.model for k in self.model)

    def start(self) -> None:
        t = self.gen()
        m = self.cache.match_prefix(t)
        assert m.kv_locs == self.expected(t)
        self.cache.lock(m.node)
        req = Req(t, list(m.kv_locs), len(m.kv_locs), m.node)
        while len(req.kv) < len(t):
            n = min(len(t) - len(req.kv), self.rng.randint(1, 2 * self.ps))
            new = extend_slots(self.pool, req.kv, len(req.kv), n)
            if new is None:
                self.evict(pages_needed(self.ps, len(req.kv), n) - self.pool.num_free_pages)
                new = extend_slots(self.pool, req.kv, len(req.kv), n)
            if new is None:  # out of memory even after eviction: abort the request
                self.pool.free(self.pool.pages_of(req.kv[req.matched :]))
                self.cache.unlock(req.node)
                return
            req.kv += new
        self.active.append(req)

    def insert(self, req: Req) -> int:
        """Insert req's tokens and settle ownership exactly as insert()'s contract says."""
        ps, t = self.ps, req.tokens
        end = len(t) // ps * ps
        present = len(self.expected(t))
        done = self.cache.insert(t, req.kv)
        assert done == present >= req.matched
        self.pool.free(self.pool.pages_of(req.kv[req.matched : done]))
        for k in range(done + ps, end + 1, ps):
            self.model[tuple(t[:k])] = req.kv[k - ps] // ps
        return end

    def finish(self) -> None:
        req = self.active.pop(self.rng.randrange(len(self.active)))
        end = self.insert(req)
        self.pool.free(self.pool.pages_of(req.kv[end:]))
        self.cache.unlock(req.node)

    def checkpoint(self) -> None:
        """Chunked-prefill style: cache what is done, keep running on the tree's slots."""
        req = self.rng.choice(self.active)
        end = self.insert(req)
        m = self.cache.match_prefix(req.tokens)
        assert len(m.kv_locs) == end
        self.cache.lock(m.node)
        self.cache.unlock(req.node)
        req.kv, req.matched, req.node = m.kv_locs + req.kv[end:], end, m.node

    def check(self) -> None:
        pool, cache = self.pool, self.cache
        tree = cache.cached_pages()
        assert len(tree) == len(set(tree)) == cache.num_cached_pages == len(self.model)
        assert set(tree) == set(self.model.values())
        held = [p for r in self.active for p in pool.pages_of(r.kv[r.matched :])]
        assert len(held) == len(set(held)) and not set(held) & set(tree)
        assert not any(pool.is_free(p) for p in tree + held)
        assert len(tree) + len(held) + pool.num_free_pages == pool.num_total_pages
        locked = {tuple(r.tokens[:k]) for r in self.active for k in range(self.ps, r.matched + 1, self.ps)}
        assert cache.num_evictable_pages == sum(1 for k in self.model if k not in locked)
        for r in self.active:
            assert r.kv[: r.matched] == self.expected(r.tokens)[: r.matched]

    def step(self) -> None:
        x = self.rng.random()
        if x < 0.2:
            self.match(self.gen())
        elif x < 0.45 and len(self.active) < 4:
            self.start()
        elif x < 0.7 and self.active:
            self.finish()
        elif x < 0.8 and self.active:
            self.checkpoint()
        else:
            self.evict(self.rng.randint(0, 6))
        self.check()

    def drain(self) -> None:
        while self.active:
            self.finish()
        self.evict(self.cache.num_cached_pages)
        assert self.cache.num_cached_pages == 0 == len(self.model)
        assert self.pool.num_free_pages == self.pool.num_total_pages


@pytest.mark.parametrize("ps", PAGE_SIZES)
@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_random_against_model(ps: int, seed: int) -> None:
    h = Harness(ps, seed)
    for _ in range(400):
        h.step()
    assert h.cache.num_hit_tokens > 0
    h.drain()
