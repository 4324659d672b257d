"""The KV page pool: fixed-size pages of cache rows, handed out as sequences grow, shared through the prefix cache.

A page is free, held (by one or more sequences: a reference count), or cached and idle (held by nobody but
keeping the KV of a full page of tokens, found again by the hash chain of its tokens and all tokens before it).
Allocation takes free pages first, then evicts idle cached pages, least recently used first.
"""
from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Sequence


def chain_key(previous: bytes, page_tokens: Sequence[int]) -> bytes:
    """A full page's key in the hash chain: its tokens and, through ``previous`` (the key of the page before it, or
    ``b""``), every token before them, so equal keys mean equal prefixes."""
    data = previous + struct.pack(f"<{len(page_tokens)}I", *page_tokens)  # 4 little-endian bytes a token
    return hashlib.blake2b(data, digest_size=16).digest()


def extend_keys(keys: list[bytes], tokens: Sequence[int], page_size: int, full: int):
    """Append to ``keys`` the chain keys of pages ``len(keys)`` to ``full``: ``tokens`` are the tokens from page
    ``len(keys)`` on (no copy of the context before them)."""
    start = len(keys)
    for i in range(start, full):
        j = (i - start) * page_size
        keys.append(chain_key(keys[-1] if keys else b"", tokens[j:j + page_size]))


class PagePool:
    """Page ids ``0 .. num_pages-1`` with reference counts and (``prefix_caching``) a cache of full pages."""

    def __init__(self, num_pages: int, page_size: int, prefix_caching: bool = False):
        self.page_size, self.num_pages, self.prefix_caching = page_size, num_pages, prefix_caching
        self._free = list(range(num_pages - 1, -1, -1))
        self._refs = [0] * num_pages
        self._key_of: dict[int, bytes] = {}  # cached page -> its chain key
        self._page_of: dict[bytes, int] = {}  # chain key -> cached page
        self._idle: OrderedDict[int, None] = OrderedDict()  # cached pages nobody holds, least recently used first

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def free_pages(self) -> int:
        """Pages an allocation can take: free ones and idle cached ones."""
        return len(self._free) + len(self._idle)

    def allocate(self, n: int) -> list[int]:
        if n > self.free_pages():
            raise RuntimeError(f"KV page pool exhausted: {n} pages asked, {self.free_pages()} free")
        out = []
        for _ in range(n):
            if self._free:
                page = self._free.pop()
            else:  # evict the least recently used idle cached page
                page, _ = self._idle.popitem(last=False)
                del self._page_of[self._key_of.pop(page)]
            self._refs[page] = 1
            out.append(page)
        return out

    def release(self, pages: list[int]):
        """Drop one reference to each page (emptying ``pages``); a cached page nobody holds stays cached, idle."""
        for page in reversed(pages):
            self._refs[page] -= 1
            if self._refs[page] == 0:
                if page in self._key_of:
                    self._idle[page] = None
                else:
                    self._free.append(page)
        pages.clear()

    def match(self, keys: list[bytes]) -> list[int]:
        """Cached pages holding the longest prefix whose chain ``keys`` are given, each now held once more."""
        if not self.prefix_caching:
            return []
        found = []
        for key in keys:
            page = self._page_of.get(key)
            if page is None:
                break
            found.append(page)
        for page in found:
            if self._refs[page] == 0:
                del self._idle[page]
            self._refs[page] += 1
        return found

    def forget(self):
        """Empty the prefix cache (the KV behind it is gone: a runner rebuilt after a failure)."""
        self._free.extend(reversed(self._idle))
        self._idle.clear()
        self._key_of.clear()
        self._page_of.clear()

    def register(self, pages: list[int], keys: list[bytes]):
        """Record a sequence's full pages (``pages[i]`` written for good, its chain key ``keys[i]``) in the prefix
        cache; a page whose prefix is cached already under another page stays private."""
        if not self.prefix_caching:
            return
        for page, key in zip(pages, keys):
            if page not in self._key_of and key not in self._page_of:
                self._key_of[page], self._page_of[key] = key, page
