"""Deterministic stand-ins for what the model would produce.

There is no model: sampled tokens and the KV bytes a forward pass writes are
fabricated from hashes, so every rank (in any process) derives the same
tokens, and the KV bytes of a token depend only on the token prefix (plus
layer, rank and head), exactly like real KV. That makes prefix-cache hits and
restored blocks checkable byte for byte.

Python's ``hash()`` is salted per process, so everything here uses blake2b.
"""

from __future__ import annotations

import hashlib

import numpy as np

# Token ids below this are reserved (pad/bos/eos in the tiny Llama config).
FIRST_NORMAL_TOKEN = 3


def _digest(data: bytes, size: int = 8) -> bytes:
    return hashlib.blake2b(data, digest_size=size).digest()


def sampled_token(seed: int, req_id: str, position: int, vocab_size: int) -> int:
    """The token "sampled" for ``req_id`` at sequence ``position``."""
    h = _digest(f"tok:{seed}:{req_id}:{position}".encode())
    span = vocab_size - FIRST_NORMAL_TOKEN
    return FIRST_NORMAL_TOKEN + int.from_bytes(h, "little") % span


def random_tokens(seed: int, label: str, n: int, vocab_size: int) -> list[int]:
    """``n`` pseudo-random prompt tokens, reproducible from (seed, label)."""
    rng = np.random.default_rng(int.from_bytes(_digest(f"{seed}:{label}".encode()), "little"))
    return rng.integers(FIRST_NORMAL_TOKEN, vocab_size, size=n).tolist()


class PrefixHashes:
    """Chained hash of every token prefix of one sequence, extended lazily."""

    def __init__(self) -> None:
        self._hashes: list[bytes] = []
        self._tokens: list[int] = []

    def upto(self, tokens: list[int], n: int) -> list[bytes]:
        """Hashes of prefixes ``tokens[:1] .. tokens[:n]``."""
        # Reuse the chain only while it agrees with ``tokens``.
        keep = 0
        limit = min(len(self._tokens), n)
        while keep < limit and self._tokens[keep] == tokens[keep]:
            keep += 1
        del self._hashes[keep:], self._tokens[keep:]
        prev = self._hashes[-1] if self._hashes else b"root"
        for t in tokens[keep:n]:
            prev = _digest(prev + t.to_bytes(4, "little"), 16)
            self._hashes.append(prev)
            self._tokens.append(t)
        return self._hashes[:n]


class KVFabricator:
    """The bytes one rank's attention layers write for a token."""

    def __init__(self, rank: int, num_heads: int, content_bytes: int) -> None:
        self.rank = rank
        self.num_heads = num_heads
        self.content_bytes = content_bytes
        self._cache: dict[tuple[bytes, int], np.ndarray] = {}

    def token_bytes(self, prefix_hash: bytes, layer_idx: int) -> np.ndarray:
        """``(num_heads, content_bytes)`` int8 bytes of one token in one layer."""
        key = (prefix_hash, layer_idx)
        cached = self._cache.get(key)
        if cached is not None:
            return cached
        per_head = -(-self.content_bytes // 64)
        out = bytearray()
        for head in range(self.num_heads):
            for i in range(per_head):
                tag = bytes((layer_idx, self.rank & 0xFF, head & 0xFF, i & 0xFF))
                out += hashlib.blake2b(prefix_hash + tag, digest_size=64).digest()
        arr = np.frombuffer(bytes(out), dtype=np.int8).reshape(self.num_heads, -1)
        arr = np.ascontiguousarray(arr[:, : self.content_bytes])
        self._cache[key] = arr
        return arr

    def tokens_bytes(self, prefix_hashes: list[bytes], layer_idx: int) -> np.ndarray:
        """``(len(prefix_hashes), num_heads, content_bytes)`` int8."""
        if not prefix_hashes:
            return np.zeros((0, self.num_heads, self.content_bytes), dtype=np.int8)
        return np.stack([self.token_bytes(h, layer_idx) for h in prefix_hashes])
