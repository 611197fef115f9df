"""KV bookkeeping for requests: prefix matching, slot allocation with eviction, caching, release.

Owns the page pool and (optionally) the radix prefix cache; never touches KV memory itself.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from ..forward_batch import SlotUpdate
from ..request import Req
from .kv_allocator import PagePool, extend_slots, pages_needed
from .radix_cache import RadixCache


class KVManager:
    def __init__(self, num_pages: int, page_size: int, enable_prefix_cache: bool) -> None:
        self.pool = PagePool(num_pages, page_size)
        self.page_size = page_size
        self.cache = RadixCache(self.pool) if enable_prefix_cache else None

    @property
    def capacity_tokens(self) -> int:
        return self.pool.capacity_tokens

    @property
    def num_available_pages(self) -> int:
        evictable = self.cache.num_evictable_pages if self.cache is not None else 0
        return self.pool.num_free_pages + evictable

    def cached_prefix_len(self, token_ids: Sequence[int]) -> int:
        """Tokens of ``token_ids`` the prefix cache could serve now (read-only)."""
        return self.cache.peek_prefix_len(token_ids) if self.cache is not None else 0

    def match_prefix(self, req: Req) -> int:
        """Borrow the longest cached prefix of ``req`` (leaving >= 1 token to compute); returns its length."""
        if self.cache is None or req.num_computed:
            return 0
        match = self.cache.match_prefix(req.fill_ids[: req.fill_len - 1])
        self.cache.lock(match.node)
        req.cache_node, req.kv_locs, req.num_cached = match.node, list(match.kv_locs), len(match.kv_locs)
        return req.num_cached

    def shorten_match(self, req: Req, n: int) -> None:
        """Use only the first ``n`` tokens of the prefix ``match_prefix`` borrowed (``n`` page-aligned; the
        matched node stays locked, keeping the rest cached too, until the request releases it)."""
        del req.kv_locs[n:]
        req.num_cached = min(req.num_cached, n)

    def undo_match(self, req: Req) -> None:
        if self.cache is not None and req.cache_node is not None:
            self.cache.unlock(req.cache_node)
        req.cache_node, req.kv_locs, req.num_cached = None, [], 0

    def alloc(self, req: Req, n: int, keep_free_pages: int = 0) -> list[int] | None:
        """Slots for the next ``n`` tokens of ``req`` (appended to ``req.kv_locs``), evicting cached
        prefixes if needed; None (nothing changed) if that would leave < ``keep_free_pages``."""
        locs = req.kv_locs
        if n == 1 and not keep_free_pages and len(locs) % self.page_size:
            # a decode step's slot, in the request's last page (its own: shared prefixes end on a
            # page boundary): the next one, with no pool or cache work
            locs.append(locs[-1] + 1)
            return locs[-1:]
        need = pages_needed(self.page_size, req.num_computed, n)
        if self.num_available_pages - need < keep_free_pages:
            return None
        short = need - self.pool.num_free_pages
        if short > 0 and self.cache is not None:
            self.cache.evict(short)
        slots = extend_slots(self.pool, req.kv_locs, req.num_computed, n)
        if slots is None:
            return None
        req.kv_locs.extend(slots)
        return slots

    def truncate(self, req: Req, n: int) -> None:
        """Keep the KV of ``req``'s first ``n`` tokens and give back the slots after them (a verify
        step's rejected drafts): the pages no kept token uses return to the pool; the rest of the
        last kept page stays the request's, for its next tokens."""
        tail = req.kv_locs[n:]
        if not tail:
            return
        del req.kv_locs[n:]
        pages = self.pool.pages_of(tail)
        if n % self.page_size:
            pages = [p for p in pages if p != req.kv_locs[-1] // self.page_size]
        self.pool.free(pages)

    def cache_prefix(self, req: Req) -> SlotUpdate | None:
        """Share a running request's computed page-aligned prefix through the cache.

        If another request cached the same tokens first, this request's duplicate pages are freed
        and its slots repointed to the cached ones; the returned update tells the engine.
        """
        if self.cache is None:
            return None
        n = self._cacheable(req)
        if n <= req.num_cached:
            return None
        num_dup = self._insert(req, n)
        match = self.cache.match_prefix(req.fill_ids[:n])
        self.cache.lock(match.node)
        self.cache.unlock(req.cache_node)
        req.cache_node = match.node
        update = None
        if num_dup > req.num_cached:  # repoint the freed duplicates to the cached copies
            req.kv_locs[req.num_cached : num_dup] = match.kv_locs[req.num_cached : num_dup]
            update = SlotUpdate(req.req_pool_idx, req.num_cached,
                                np.asarray(match.kv_locs[req.num_cached : num_dup], dtype=np.int64))
        req.num_cached = n
        return update

    def _cacheable(self, req: Req) -> int:
        """Page-aligned count of leading tokens with a KV slot and a known id (steps still in flight
        may hold slots for tokens not sampled yet; those are never cached)."""
        n = min(req.num_computed, req.num_known)
        return n - n % self.page_size

    def _insert(self, req: Req, n: int) -> int:
        """Cache ``req``'s first ``n`` tokens; free its own pages that duplicate what another request
        cached first (the tree keeps its copy). Returns how many leading tokens were cached already."""
        assert self.cache is not None
        num_dup = self.cache.insert(req.fill_ids[:n], req.kv_locs[:n])
        if num_dup > req.num_cached:
            self.pool.free(self.pool.pages_of(req.kv_locs[req.num_cached : num_dup]))
        return num_dup

    def release(self, req: Req) -> None:
        """Give back all of ``req``'s KV: its computed page-aligned prefix stays cached (evictable)."""
        own_start = req.num_cached
        if self.cache is not None:
            n = self._cacheable(req)
            self._insert(req, n)
            if req.cache_node is not None:
                self.cache.unlock(req.cache_node)
            own_start = max(n, req.num_cached)
        tail = req.kv_locs[own_start:]
        if tail:
            self.pool.free(self.pool.pages_of(tail))
        req.cache_node, req.kv_locs, req.num_cached = None, [], 0
