"""The on-disk layout of a store: its arrays, their chunking, the keys of their files, block digests.

Layout of a store directory:
    manifest.json            header: format, model fingerprint and geometry, block layout (written once)
    log/                     commit records and snapshots (kvmemory/store/log.py): the commit point
    data/                    Zarr v3 group; every array's first axis is the block row
      kv        [R, layers, 2, kv_heads, C, head_dim]  raw KV words (bf16 as uint16), sharded
      tokens    [R, C] int32 (-1 pads a partial block)
      positions [R, C] int32 (-1 pads)
      parent    [R] int64   row of the previous block, -1 at position 0
      n_tokens  [R] int32
      block_id  [R, 16] uint8  hash(fingerprint, parent id, tokens, positions)
      digest    [R, 16] uint8  xxh3-128 of the block's valid KV bytes (as stored: encoded)
      error     [R, 3] float32 a compact store's only (not exact): each block's measured error
                               (kvmemory/store/encoding.py ERROR_FIELDS, kvmemory/compact.py)
      seal      [R, 72] uint8  an encrypted store's only: each block's key, nonces and GCM tags
                               (kvmemory/store/seal.py; kv and tokens then hold ciphertext)
    index/                   selection indexes (derived data)
    .lock                    writer lock

Arrays are created once with a fixed capacity of R = 2**32 rows (absent chunks are fill), so
no commit rewrites their metadata. Every commit starts at a shard boundary and every array is
chunked (kv: sharded) by `shard_blocks` rows, so a commit writes only new files: its kv shards,
its metadata chunks and its log record; it fsyncs exactly those files and their directories,
then writes the record. Rows a commit did not reach (a crash, a full disk) are ignored, and
their files are removed by the next writer. Block metadata is read lazily, chunk by chunk:
opening a store reads the header and the log only.
"""
from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import zarr
import zarr.codecs

from kvmemory import hashing
from kvmemory.store.encoding import get as get_encoding
from kvmemory.store.manifest import Manifest
from kvmemory.store.seal import SEAL_BYTES

ROW_CAPACITY = 1 << 32
META_ARRAYS = ("tokens", "positions", "parent", "n_tokens", "block_id", "digest")
ARRAYS = ("kv", *META_ARRAYS)
NDIM = {"kv": 6, "tokens": 2, "positions": 2, "parent": 1, "n_tokens": 1, "block_id": 2, "digest": 2, "error": 2,
        "seal": 2}


def meta_arrays(m: Manifest) -> tuple[str, ...]:
    """The block metadata arrays of a store: a store that is not exact also keeps each block's error,
    an encrypted one each block's seal."""
    return META_ARRAYS + (("error",) if m.encoding != "exact" else ()) + (("seal",) if m.encryption else ())


def arrays(m: Manifest) -> tuple[str, ...]:
    return ("kv", *meta_arrays(m))
INDEX_DIR = "index"                       # the selection indexes (derived data, written under the writer lock)


def chunk_keys(first_chunk: int, last_chunk: int, names=ARRAYS) -> list[str]:
    """The data files (keys under the store) holding metadata chunks / kv shards first..last (inclusive)."""
    return [f"data/{name}/c/" + "/".join([str(c)] + ["0"] * (NDIM[name] - 1))
            for name in names for c in range(first_chunk, last_chunk + 1)]


def create_arrays(zstore, m: Manifest) -> None:
    g = zarr.open_group(store=zstore, mode="w", zarr_format=3)
    C, S = m.block_tokens, m.shard_blocks
    kv_shape = (m.model["layers"], 2, m.model["kv_heads"], C, m.model["head_dim"])
    codecs = None
    if m.codec == "zstd":
        codecs = [zarr.codecs.BloscCodec(cname="zstd", clevel=3, shuffle="shuffle")]
    elif m.codec == "lz4":
        codecs = [zarr.codecs.BloscCodec(cname="lz4", clevel=5, shuffle="bitshuffle")]
    g.create_array("kv", shape=(ROW_CAPACITY, *kv_shape), dtype=get_encoding(m.encoding, m.kv_dtype).storage_dtype,
                   chunks=(1, *kv_shape), shards=(S, *kv_shape), compressors=codecs, fill_value=0)
    meta_codec = [zarr.codecs.ZstdCodec(level=1)]      # the fill of a partly used chunk costs nothing
    for name, shape, dtype, fill in (
        ("tokens", (C,), "int32", -1), ("positions", (C,), "int32", -1),
        ("parent", (), "int64", -1), ("n_tokens", (), "int32", 0),
        ("block_id", (hashing.ID_BYTES,), "uint8", 0), ("digest", (hashing.ID_BYTES,), "uint8", 0),
    ):
        g.create_array(name, shape=(ROW_CAPACITY, *shape), dtype=dtype, chunks=(S, *shape),
                       compressors=meta_codec, fill_value=fill)
    if m.encryption:
        g.create_array("seal", shape=(ROW_CAPACITY, SEAL_BYTES), dtype="uint8", chunks=(S, SEAL_BYTES),
                       compressors=meta_codec, fill_value=0)
    if m.encoding != "exact":
        g.create_array("error", shape=(ROW_CAPACITY, 3), dtype="float32", chunks=(S, 3),
                       compressors=meta_codec, fill_value=float("nan"))


def block_digest(kv_block: np.ndarray, n: int) -> bytes:
    """Digest of one block's valid KV: kv_block [L, 2, H, C, D] -> hash of [..., :n, :] bytes."""
    valid = kv_block[:, :, :, :n, :]
    return hashing.digest(np.ascontiguousarray(valid).view(np.uint8).reshape(-1))


def runs(rows: Sequence[int]) -> list[tuple[int, int]]:
    runs: list[tuple[int, int]] = []
    for r in rows:
        if runs and runs[-1][1] == r:
            runs[-1] = (runs[-1][0], r + 1)
        else:
            runs.append((r, r + 1))
    return runs


def default_work_dir(url: str) -> Path:
    """The local working directory of a store on an object store (disk cache tier, derived
    indexes): KVMEMORY_STORE_CACHE_DIR or the user cache directory, one folder per URL."""
    base = os.environ.get("KVMEMORY_STORE_CACHE_DIR")
    if not base:
        import platformdirs

        base = os.path.join(platformdirs.user_cache_dir("kvmemory"), "stores")
    return Path(base) / hashlib.sha256(url.encode()).hexdigest()[:20]
