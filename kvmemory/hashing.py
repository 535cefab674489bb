"""Content addresses and digests. Pure: no torch, no zarr.

A block's id names what determines its KV bytes: hash(fingerprint, parent id, tokens,
positions). Equal prefixes therefore share ids, and so share blocks on disk. A block's
digest is a hash of the KV bytes themselves, checked on every read.

A salted chain (an owner's states: one user's conversations) starts from the owner's root
instead of ROOT_PARENT, so none of its ids can equal another owner's or an unsalted block's:
the same prefix sent by another user is another block, never a cache hit (vLLM's cache_salt).
The root is recorded with the chain's first row (the manifest's roots), so every id still
re-derives from what the store holds.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np
import xxhash

ID_BYTES = 16
ROOT_PARENT = bytes(ID_BYTES)  # parent of a block at position 0


def salt_root(salt: str) -> bytes:
    """The parent id of the first block of a chain salted with `salt` (never ROOT_PARENT)."""
    if not isinstance(salt, str) or not salt:
        raise ValueError("a salt is a non-empty string")
    h = hashlib.blake2b(digest_size=ID_BYTES, person=b"kvmemory-salt")
    h.update(salt.encode("utf-8"))
    return h.digest()


def block_id(fingerprint: str, parent: bytes, tokens: Sequence[int], positions: Sequence[int]) -> bytes:
    """16-byte content address of a block (blake2b: collisions must not be constructible)."""
    if len(parent) != ID_BYTES:
        raise ValueError(f"parent id must be {ID_BYTES} bytes, got {len(parent)}")
    tok = np.asarray(tokens, dtype="<i4")
    pos = np.asarray(positions, dtype="<i4")
    if tok.shape != pos.shape or tok.ndim != 1:
        raise ValueError(f"tokens {tok.shape} and positions {pos.shape} must be equal 1-d shapes")
    h = hashlib.blake2b(digest_size=ID_BYTES, person=b"kvmemory-block")
    h.update(fingerprint.encode("ascii"))
    h.update(parent)
    h.update(len(tok).to_bytes(4, "little"))
    h.update(tok.tobytes())
    h.update(pos.tobytes())
    return h.digest()


def chain_ids(fingerprint: str, tokens: Sequence[int], block_tokens: int, parent: bytes = ROOT_PARENT,
              start: int = 0) -> list[bytes]:
    """Ids of the blocks covering `tokens` placed at positions start.. (the last may be partial)."""
    ids = []
    for s in range(0, len(tokens), block_tokens):
        chunk = tokens[s:s + block_tokens]
        parent = block_id(fingerprint, parent, chunk, range(start + s, start + s + len(chunk)))
        ids.append(parent)
    return ids


def digest(*buffers) -> bytes:
    """16-byte xxh3-128 of the concatenated buffers: fast enough (>10 GB/s) not to bound restore."""
    h = xxhash.xxh3_128()
    for b in buffers:
        h.update(b)
    return h.digest()
