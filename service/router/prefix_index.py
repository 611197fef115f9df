"""What the dispatcher knows of one rank's prefix cache without asking its scheduler: the page-aligned
prefixes of the prompts sent there, most recent kept, as many pages as the rank's KV pool holds."""

from __future__ import annotations

import collections
import threading
from typing import Iterator, Sequence


class PrefixIndex:
    def __init__(self, page_size: int, max_pages: int) -> None:
        self.page_size = page_size
        self.max_pages = max(max_pages, 1)
        self._pages: collections.OrderedDict[int, None] = collections.OrderedDict()  # chained page hash, LRU order
        self._lock = threading.Lock()  # dispatch and failover may add from different threads

    def _hashes(self, token_ids: Sequence[int]) -> Iterator[int]:
        """One hash per full page, each over the whole prefix up to that page's end."""
        h = 0
        for end in range(self.page_size, len(token_ids) + 1, self.page_size):
            h = hash((h, tuple(token_ids[end - self.page_size:end])))
            yield h

    def add(self, token_ids: Sequence[int]) -> None:
        with self._lock:
            for h in self._hashes(token_ids):
                self._pages[h] = None
                self._pages.move_to_end(h)
            while len(self._pages) > self.max_pages:
                self._pages.popitem(last=False)

    def match_len(self, token_ids: Sequence[int]) -> int:
        """Tokens of ``token_ids`` (whole pages) this rank likely holds in its cache."""
        n = 0
        with self._lock:
            for h in self._hashes(token_ids):
                if h not in self._pages:
                    break
                n += self.page_size
        return n
