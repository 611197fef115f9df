"""Page-granular radix cache: a prefix tree over token ids whose values are KV slot indices.

Every node boundary is page-aligned, so each node's ``value`` covers whole pages and the cache
owns (and frees) pages, never single slots. Matches and inserts only look at the longest prefix
whose length is a multiple of ``page_size``.

Lifecycle of a request against the cache (single-threaded, as the scheduler runs it)::

    m = cache.match_prefix(tokens); cache.lock(m.node)      # borrow m.kv_locs (page-aligned)
    kv = m.kv_locs + own slots (extend_slots)               # the request owns pages_of(kv[len(m.kv_locs):])
    done = cache.insert(tokens, kv)                         # see insert() for who owns what afterwards
    cache.unlock(m.node)

The slots in ``m.kv_locs`` are only safe to use while ``m.node`` is locked: lock right after the
match, before anything can call ``evict``.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator, Sequence
from typing import NamedTuple

from .kv_allocator import PagePool


class RadixNode:
    """One edge of the tree: a run of tokens (``key``) and the KV slots holding them (``value``).

    Invariants: ``len(key) == len(value)``, a positive multiple of page_size (0 for the root), and
    ``value`` is whole pages, each page's slots consecutive. ``lock_ref`` counts the locks taken on
    this node or on any descendant, so a locked node's ancestors are locked too. A node keeps its
    identity across splits (the new node is inserted *above* it), so a node handed out by
    ``match_prefix`` always ends at the same depth until it is evicted.
    """

    __slots__ = ("key", "value", "children", "parent", "lock_ref", "last_access", "node_id", "evicted")

    def __init__(self, key: list[int], value: list[int], parent: RadixNode | None, node_id: int) -> None:
        self.key = key
        self.value = value
        self.children: dict[tuple[int, ...], RadixNode] = {}
        self.parent = parent
        self.lock_ref = 0
        self.last_access = 0
        self.node_id = node_id
        self.evicted = False

    def __repr__(self) -> str:
        return f"RadixNode(id={self.node_id}, tokens={len(self.key)}, lock_ref={self.lock_ref})"


class PrefixMatch(NamedTuple):
    kv_locs: list[int]  # slots of the longest cached page-aligned prefix; safe only while node is locked
    node: RadixNode  # deepest matched node, ending exactly at the match (the root when nothing matched)


class RadixCache:
    """Radix tree with reference counts and LRU eviction of unlocked leaves, over a ``PagePool``.

    Invariants: every page in the tree is handed out by the pool and appears in exactly one node;
    ``num_evictable_pages`` is the number of pages in nodes with ``lock_ref == 0`` and equals what
    ``evict`` can free; last-access times come from a counter bumped once per match/insert call.
    """

    def __init__(self, pool: PagePool) -> None:
        self._pool = pool
        self._ps: int = pool.page_size
        self._init_state()

    def _init_state(self) -> None:
        self._next_id = 1
        self._root = RadixNode([], [], None, node_id=0)
        self._clock = 0
        self._heap: list[tuple[int, int, RadixNode]] = []  # (last_access, node_id, node), lazily pruned
        self._num_nodes = 0
        self._cached_pages = 0
        self._evictable_pages = 0
        self._in_tree = [False] * self._pool.num_pages
        self.num_queries = 0
        self.num_query_tokens = 0
        self.num_hit_tokens = 0

    @property
    def root(self) -> RadixNode:
        return self._root

    @property
    def page_size(self) -> int:
        return self._ps

    @property
    def num_cached_pages(self) -> int:
        return self._cached_pages

    @property
    def num_cached_tokens(self) -> int:
        return self._cached_pages * self._ps

    @property
    def num_evictable_pages(self) -> int:
        return self._evictable_pages

    # ---------------------------------------------------------------- lookup and insert

    def match_prefix(self, token_ids: Sequence[int]) -> PrefixMatch:
        """Longest cached page-aligned prefix of ``token_ids``; splits a node so ``node`` ends at it."""
        tokens = list(token_ids)
        kv: list[int] = []
        node, pos = self._walk(tokens, len(tokens) // self._ps * self._ps, kv)
        self._push_if_evictable(node)
        self.num_queries += 1
        self.num_query_tokens += len(tokens)
        self.num_hit_tokens += pos
        return PrefixMatch(kv, node)

    def peek_prefix_len(self, token_ids: Sequence[int]) -> int:
        """Length of the longest cached page-aligned prefix, without touching the tree (no split,
        no LRU update): what a router asks when it chooses where a request goes."""
        tokens = list(token_ids)
        return sum(n for _, n in self._descend(tokens, len(tokens) // self._ps * self._ps))

    def _descend(self, tokens: list[int], end: int) -> Iterator[tuple[RadixNode, int]]:
        """The nodes ``tokens[:end]`` passes through and the tokens matched in each, read-only; a node
        matched only in part comes last (its caller may split it)."""
        ps = self._ps
        node, pos = self._root, 0
        while pos < end:
            child = node.children.get(tuple(tokens[pos : pos + ps]))
            if child is None:
                return
            n = self._common_len(child.key, tokens, pos, end)
            partial = n < len(child.key)  # decided before the caller may split ``child``
            yield child, n
            if partial:
                return
            node, pos = child, pos + n

    def _walk(self, tokens: list[int], end: int, kv: list[int] | None) -> tuple[RadixNode, int]:
        """Follow ``tokens[:end]`` down the tree (splitting the last node at the match end), touch
        every node passed; returns the deepest node and the matched length; collects slots into kv."""
        self._clock += 1
        node, pos = self._root, 0
        for child, n in self._descend(tokens, end):
            if n < len(child.key):
                child = self._split(child, n)
            if kv is not None:
                kv.extend(child.value)
            child.last_access = self._clock
            node, pos = child, pos + n
        return node, pos

    def insert(self, token_ids: Sequence[int], kv_locs: Sequence[int]) -> int:
        """Cache the page-aligned prefix of ``token_ids``; return how many leading tokens were cached.

        Let ``end = len(token_ids) // page_size * page_size`` and ``done`` the return value (a
        multiple of page_size, ``<= end``). Ownership afterwards:

        * ``kv_locs[done:end]`` now belong to the tree (do not free or reuse them).
        * ``kv_locs[:done]`` stay the caller's. Where they are the tree's own slots (the prefix the
          caller got from ``match_prefix`` and kept locked) there is nothing to do; every other page
          there is a duplicate the caller must free: ``pool.free(pool.pages_of(kv_locs[matched:done]))``
          with ``matched = len(match.kv_locs)`` (``done >= matched`` while the match is locked).
        * ``kv_locs[end:]`` (the partial last page) stay the caller's, as before.

        A request that keeps running (chunked prefill) must re-``match_prefix`` afterwards to pick up
        the tree's slots for ``[matched, done)``, lock the new node and unlock the old one.
        ``ValueError`` if the lengths differ or the new part is not whole, allocated pages that the
        tree does not already hold (the tree may have been split, which changes no content).
        """
        if len(token_ids) != len(kv_locs):
            raise ValueError(f"len(token_ids)={len(token_ids)} != len(kv_locs)={len(kv_locs)}")
        ps = self._ps
        end = len(token_ids) // ps * ps
        tokens = list(token_ids[:end])
        node, pos = self._walk(tokens, end, None)
        done = pos
        if pos < end:
            value = list(kv_locs[pos:end])
            pages = self._check_new_pages(value)
            leaf = self._new_node(tokens[pos:], value, node)
            leaf.last_access = self._clock
            node.children[tuple(tokens[pos : pos + ps])] = leaf
            for page in pages:
                self._in_tree[page] = True
            self._cached_pages += len(pages)
            self._evictable_pages += len(pages)
            node = leaf
        self._push_if_evictable(node)
        return done

    # ---------------------------------------------------------------- locking

    def lock(self, node: RadixNode) -> None:
        """Pin ``node`` and its ancestors against eviction (reference counted; root is a no-op)."""
        for n in self._path(node):
            if n.lock_ref == 0:
                self._evictable_pages -= len(n.value) // self._ps
            n.lock_ref += 1

    def unlock(self, node: RadixNode) -> None:
        """Undo one ``lock(node)``; ``ValueError`` if it is not locked."""
        path = self._path(node)
        if any(n.lock_ref <= 0 for n in path):
            raise ValueError(f"unlock of {node!r} below zero")
        for n in path:
            n.lock_ref -= 1
            if n.lock_ref == 0:
                self._evictable_pages += len(n.value) // self._ps
        if path:
            self._push_if_evictable(path[0])

    # ---------------------------------------------------------------- eviction

    def evict(self, num_pages: int) -> int:
        """Free up to ``num_pages`` pages, least recently used unlocked leaves first; return pages freed.

        Frees exactly ``min(num_pages, num_evictable_pages)``: a leaf larger than what is still
        needed loses only its tail pages. A parent whose children are all gone becomes a leaf.
        """
        if num_pages < 0:
            raise ValueError(f"num_pages must be >= 0, got {num_pages}")
        ps, freed = self._ps, 0
        while freed < num_pages and self._heap:
            stamp, _, node = heapq.heappop(self._heap)
            if node.evicted or node.children or node.lock_ref or stamp != node.last_access:
                continue  # stale entry: a fresher one exists or the node is not evictable now
            node_pages = len(node.value) // ps
            take = min(node_pages, num_pages - freed)
            keep = (node_pages - take) * ps
            tail = node.value[keep:]
            if keep:
                node.key, node.value = node.key[:keep], node.value[:keep]
                heapq.heappush(self._heap, (stamp, node.node_id, node))
            else:
                self._remove_leaf(node)
            pages = [slot // ps for slot in tail[::ps]]
            self._pool.free(pages)
            for page in pages:
                self._in_tree[page] = False
            self._cached_pages -= take
            self._evictable_pages -= take
            freed += take
        return freed

    def reset(self) -> None:
        """Return every cached page to the pool and clear the tree and stats; ``ValueError`` if locked."""
        if any(child.lock_ref for child in self._root.children.values()):
            raise ValueError("cannot reset the radix cache while nodes are locked")
        self._pool.free(self.cached_pages())
        self._init_state()

    def cached_pages(self) -> list[int]:
        """Every page the tree holds (for invariant checks and debugging; O(tree size))."""
        ps = self._ps
        return [slot // ps for node in self._nodes() for slot in node.value[::ps]]

    # ---------------------------------------------------------------- internals

    def _common_len(self, key: list[int], tokens: list[int], pos: int, end: int) -> int:
        """Length of the common page-aligned prefix of ``key`` and ``tokens[pos:end]`` (first page equal)."""
        ps = self._ps
        n = min(len(key), end - pos)
        if key[:n] == tokens[pos : pos + n]:
            return n
        i = ps
        while i < n and key[i : i + ps] == tokens[pos + i : pos + i + ps]:
            i += ps
        return i

    def _split(self, child: RadixNode, n: int) -> RadixNode:
        """Insert a node above ``child`` holding its first ``n`` tokens; return the new node."""
        parent = child.parent
        assert parent is not None
        ps = self._ps
        mid = self._new_node(child.key[:n], child.value[:n], parent)
        mid.lock_ref, mid.last_access = child.lock_ref, child.last_access
        parent.children[tuple(child.key[:ps])] = mid
        child.key, child.value, child.parent = child.key[n:], child.value[n:], mid
        mid.children[tuple(child.key[:ps])] = child
        return mid

    def _new_node(self, key: list[int], value: list[int], parent: RadixNode) -> RadixNode:
        node = RadixNode(key, value, parent, self._next_id)
        self._next_id += 1
        self._num_nodes += 1
        return node

    def _remove_leaf(self, node: RadixNode) -> None:
        parent = node.parent
        assert parent is not None
        del parent.children[tuple(node.key[: self._ps])]
        node.evicted, node.parent = True, None
        self._num_nodes -= 1
        self._push_if_evictable(parent)

    def _push_if_evictable(self, node: RadixNode) -> None:
        """Queue ``node`` for eviction if it is an unlocked leaf (every such node has a live entry)."""
        if node is self._root or node.children or node.lock_ref:
            return
        heapq.heappush(self._heap, (node.last_access, node.node_id, node))
        if len(self._heap) > 4 * self._num_nodes + 64:
            self._rebuild_heap()

    def _rebuild_heap(self) -> None:
        heap = [(n.last_access, n.node_id, n) for n in self._nodes() if not n.children and not n.lock_ref]
        heapq.heapify(heap)
        self._heap = heap

    def _nodes(self) -> Iterator[RadixNode]:
        """Every node but the root, parents before children."""
        stack = list(self._root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def _path(self, node: RadixNode) -> list[RadixNode]:
        """``node`` and its ancestors, root excluded; ``ValueError`` if it is not in this tree."""
        if node.evicted:
            raise ValueError(f"{node!r} has been evicted")
        path: list[RadixNode] = []
        cur: RadixNode | None = node
        while cur is not None and cur is not self._root:
            path.append(cur)
            cur = cur.parent
        if cur is not self._root:
            raise ValueError(f"{node!r} does not belong to this radix cache")
        return path

    def _check_new_pages(self, value: list[int]) -> list[int]:
        """Pages of ``value``; ``ValueError`` unless whole, consecutive, allocated and not yet cached."""
        ps = self._ps
        pages: list[int] = []
        seen: set[int] = set()
        for i in range(0, len(value), ps):
            first = value[i]
            page = first // ps
            if first % ps or value[i : i + ps] != list(range(first, first + ps)):
                raise ValueError(f"kv_locs[{i}:{i + ps}] is not one whole page: {value[i:i + ps]}")
            if page == PagePool.RESERVED_PAGE or self._pool.is_free(page):
                raise ValueError(f"page {page} is not allocated from the pool")
            if self._in_tree[page] or page in seen:
                raise ValueError(f"page {page} is already held by the radix cache")
            seen.add(page)
            pages.append(page)
        return pages
