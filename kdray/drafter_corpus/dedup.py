"""Deduplication: exact after normalisation (case, punctuation, whitespace), and near-duplicates by MinHash over
word 5-gram shingles with LSH banding (candidates whose estimated Jaccard similarity reaches the threshold are
duplicates). Texts are kept in the order offered: the first of a group stays."""
from __future__ import annotations

import hashlib
import re
import zlib

import numpy as np

SHINGLE = 5  # words per shingle
NUM_PERM = 64  # MinHash permutations
BANDS = 16  # LSH bands of 4 rows: a pair at Jaccard 0.8 shares a band with probability 0.9998, at 0.5 0.64
PRIME = (1 << 61) - 1


def normalise(text: str) -> str:
    """Lowercase words without punctuation, single-spaced."""
    return " ".join(re.findall(r"\w+", text.lower()))


class Dedup:
    """Offer texts one at a time: ``duplicate`` says whether a text is an exact or a near duplicate of a text kept
    before ("exact", "near") or new (None: remembered from then on). ``threshold`` None: exact duplicates only."""

    def __init__(self, threshold: float | None = 0.8):
        if threshold is not None and not 0 < threshold <= 1:
            raise ValueError(f"near-duplicate threshold {threshold}: give a Jaccard similarity in (0, 1]")
        self.threshold = threshold
        rng = np.random.default_rng(0)
        self.a = rng.integers(1, 1 << 32, NUM_PERM, dtype=np.uint64)  # a*x+b < 2^64 for 32-bit x: no overflow
        self.b = rng.integers(0, 1 << 32, NUM_PERM, dtype=np.uint64)
        self.exact: set[bytes] = set()
        self.buckets: list[dict[bytes, list[int]]] = [{} for _ in range(BANDS)]
        self.signatures: list[np.ndarray] = []

    def signature(self, words: list[str]) -> np.ndarray:
        """MinHash signature ``[NUM_PERM]`` of the words' shingles (a*x+b mod 2^61-1 over their CRC-32s)."""
        shingles = {" ".join(words[i:i + SHINGLE]) for i in range(max(1, len(words) - SHINGLE + 1))}
        x = np.fromiter((zlib.crc32(s.encode()) for s in shingles), np.uint64, len(shingles))
        return ((x[:, None] * self.a[None, :] + self.b[None, :]) % np.uint64(PRIME)).min(axis=0)

    def duplicate(self, text: str) -> str | None:
        norm = normalise(text)
        key = hashlib.blake2b(norm.encode(), digest_size=16).digest()
        if key in self.exact:
            return "exact"
        self.exact.add(key)
        words = norm.split()
        if self.threshold is None or len(words) < 2 * SHINGLE:  # a few words: only exact copies count
            return None
        sig = self.signature(words)
        rows = NUM_PERM // BANDS
        keys = [sig[i * rows:(i + 1) * rows].tobytes() for i in range(BANDS)]
        seen = {j for band, k in zip(self.buckets, keys) for j in band.get(k, ())}
        if any((self.signatures[j] == sig).mean() >= self.threshold for j in seen):
            return "near"
        for band, k in zip(self.buckets, keys):
            band.setdefault(k, []).append(len(self.signatures))
        self.signatures.append(sig)
        return None
