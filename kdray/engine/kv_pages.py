"""The KV page pool: fixed-size pages of cache rows handed to sequences and returned when they end."""
from __future__ import annotations


class PagePool:
    """Free list of page ids ``0 .. num_pages-1``; a sequence holds the pages its positions map to."""

    def __init__(self, num_pages: int, page_size: int):
        self.page_size = page_size
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, -1, -1))

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def free_pages(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"KV page pool exhausted: {n} pages asked, {len(self._free)} free")
        return [self._free.pop() for _ in range(n)]

    def release(self, pages: list[int]):
        self._free.extend(reversed(pages))
        pages.clear()
