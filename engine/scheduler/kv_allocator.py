"""Page allocator for the flat KV cache, and the slot arithmetic that goes with it.

The KV cache is one flat array of ``num_pages * page_size`` token slots; slot ``s`` lives in page
``s // page_size``. Page 0 is reserved (padded tokens write there) and is never handed out, so every
slot a request owns is ``>= page_size``.

Ownership rule used throughout the scheduler: a request's *own* tokens start at a page-aligned
position and occupy its pages consecutively, so its position ``p`` (counting from its first own
position) is at ``pages[p // page_size] * page_size + p % page_size``. Anything before that first own
position is a page-aligned prefix borrowed from the radix cache.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence


class PagePool:
    """A free list of KV pages with a free bitmap for cheap misuse detection.

    Invariants: every page in ``1 .. num_pages - 1`` is either free (in the free list, exactly once)
    or handed out (owned by exactly one holder: a request or the radix cache); page 0 is never free
    and never handed out. ``alloc`` and ``free`` are O(n) in the number of pages they touch.
    """

    RESERVED_PAGE: int = 0

    def __init__(self, num_pages: int, page_size: int) -> None:
        if num_pages < 2:
            raise ValueError(f"num_pages must be >= 2 (page 0 is reserved), got {num_pages}")
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self._num_pages = num_pages
        self._page_size = page_size
        # A stack: alloc pops from the end, so a fresh pool hands out 1, 2, 3, ... in order.
        self._free_list: list[int] = list(range(num_pages - 1, 0, -1))
        self._is_free: list[bool] = [False] + [True] * (num_pages - 1)

    @property
    def page_size(self) -> int:
        return self._page_size

    @property
    def num_pages(self) -> int:
        """All pages of the KV array, the reserved page 0 included."""
        return self._num_pages

    @property
    def num_total_pages(self) -> int:
        """Allocatable pages (``num_pages - 1``)."""
        return self._num_pages - 1

    @property
    def num_free_pages(self) -> int:
        return len(self._free_list)

    @property
    def num_used_pages(self) -> int:
        return self.num_total_pages - len(self._free_list)

    @property
    def capacity_tokens(self) -> int:
        """Allocatable token slots (page 0 excluded)."""
        return self.num_total_pages * self._page_size

    def is_free(self, page: int) -> bool:
        self._check_page(page)
        return self._is_free[page]

    def alloc(self, n: int) -> list[int] | None:
        """Hand out ``n`` distinct page ids, or return ``None`` (allocating nothing) if fewer are free."""
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of pages ({n})")
        if n > len(self._free_list):
            return None
        if n == 0:
            return []
        pages = self._free_list[-n:]
        del self._free_list[-n:]
        pages.reverse()
        is_free = self._is_free
        for page in pages:
            is_free[page] = False
        return pages

    def free(self, pages: Iterable[int]) -> None:
        """Return pages to the pool. Atomic: on a bad page nothing is freed and ``ValueError`` is raised.

        Bad pages: the reserved page 0, out of range, already free, or listed twice in ``pages``.
        """
        batch = list(pages)
        seen: set[int] = set()
        for page in batch:
            if page == self.RESERVED_PAGE:
                raise ValueError("cannot free the reserved page 0")
            self._check_page(page)
            if self._is_free[page] or page in seen:
                raise ValueError(f"double free of page {page}")
            seen.add(page)
        for page in batch:
            self._is_free[page] = True
        self._free_list.extend(reversed(batch))

    def slots_for(self, pages: Sequence[int]) -> list[int]:
        """All token slots of ``pages``, page by page, in order."""
        ps = self._page_size
        slots: list[int] = []
        for page in pages:
            self._check_page(page)
            slots.extend(range(page * ps, page * ps + ps))
        return slots

    def pages_of(self, slots: Sequence[int]) -> list[int]:
        """The distinct pages holding ``slots``, in first-seen order."""
        ps = self._page_size
        limit = self._num_pages * ps
        pages: dict[int, None] = {}
        for slot in slots:
            if not 0 <= slot < limit:
                raise ValueError(f"slot {slot} out of range [0, {limit})")
            pages[slot // ps] = None
        return list(pages)

    def _check_page(self, page: int) -> None:
        if not 0 <= page < self._num_pages:
            raise ValueError(f"page {page} out of range [0, {self._num_pages})")


def pages_needed(page_size: int, start_pos: int, n: int) -> int:
    """New pages that ``extend_slots`` would allocate to add ``n`` tokens at position ``start_pos``."""
    if n < 0 or start_pos < 0:
        raise ValueError(f"start_pos and n must be >= 0, got start_pos={start_pos}, n={n}")
    room = (-start_pos) % page_size  # free slots left in the current (partially filled) page
    rest = max(0, n - room)
    return (rest + page_size - 1) // page_size


def extend_slots(pool: PagePool, kv_locs: Sequence[int], start_pos: int, n: int) -> list[int] | None:
    """Slots for ``n`` more tokens of a request whose tokens ``0 .. start_pos - 1`` sit at ``kv_locs``.

    ``start_pos`` must equal ``len(kv_locs)``. If ``start_pos`` is not page-aligned, the last page is
    partially filled; it is the request's own page (a prefix borrowed from the radix cache always
    ends on a page boundary), so the next slots are ``kv_locs[-1] + 1, ...`` up to the page end. The
    remaining tokens go to freshly allocated whole pages; the unused tail of the last new page stays
    reserved for the request's later tokens. At an aligned ``start_pos`` nothing past ``kv_locs[-1]``
    is reused (that slot may end a borrowed cache page).

    Returns ``None`` and allocates nothing if the pool is short of pages. The new pages are exactly
    ``pool.pages_of(result)`` minus the page of ``kv_locs[-1]`` when ``start_pos`` is unaligned.
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if start_pos != len(kv_locs):
        raise ValueError(f"start_pos ({start_pos}) must equal len(kv_locs) ({len(kv_locs)})")
    ps = pool.page_size
    in_page = start_pos % ps
    head: list[int] = []
    if in_page and n:
        last = kv_locs[-1]
        if last % ps != in_page - 1:
            raise ValueError(
                f"kv_locs[-1]={last} is at page offset {last % ps}, but position {start_pos - 1} "
                f"must be at offset {in_page - 1}: the request's own pages are not position-aligned"
            )
        take = min(n, ps - in_page)
        head = list(range(last + 1, last + 1 + take))
    pages = pool.alloc(pages_needed(ps, start_pos, n))
    if pages is None:
        return None
    return head + pool.slots_for(pages)[: n - len(head)]
