"""BlockStore: blocks of KV as append-only Zarr v3 arrays plus a manifest (the commit point).

Layout of a store directory:
    manifest.json            committed row count, states, model fingerprint (written last)
    data/                    Zarr v3 group; every array's first axis is the block row
      kv        [N, layers, 2, kv_heads, C, head_dim]  raw KV words (bf16 as uint16), sharded
      tokens    [N, C] int32 (-1 pads a partial block)
      positions [N, C] int32 (-1 pads)
      parent    [N] int64   row of the previous block, -1 at position 0
      n_tokens  [N] int32
      block_id  [N, 16] uint8  hash(fingerprint, parent id, tokens, positions)
      digest    [N, 16] uint8  xxh3-128 of the block's valid KV bytes
    .lock                    writer lock

Rows past manifest.n_blocks are leftovers of an interrupted write: ignored and overwritten.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import zarr
import zarr.codecs
from zarr.storage import LocalStore

from kvmemory import hashing
from kvmemory.errors import StoreCorruptError, StoreError, StoreReadOnlyError
from kvmemory.manifest import MANIFEST_NAME, Manifest, StateEntry, fsync_dir, read_manifest, write_manifest
from kvmemory.store import shards
from kvmemory.store.lock import writer_lock

# numpy dtype that holds each KV dtype's raw words losslessly (Zarr has no bfloat16)
STORAGE_DTYPE = {"float32": "float32", "float16": "float16", "bfloat16": "uint16"}
META_CHUNK_ROWS = 1024
META_ARRAYS = ("tokens", "positions", "parent", "n_tokens", "block_id", "digest")


@dataclass
class NewBlock:
    """A block to append. kv: [layers, 2, kv_heads, n, head_dim] in storage dtype, n <= C."""

    block_id: bytes
    parent_row: int
    tokens: np.ndarray      # [n] int
    positions: np.ndarray   # [n] int
    kv: np.ndarray


class BlockStore:
    """The on-disk truth. Opening verifies the manifest; every block read verifies its digest."""

    def __init__(self, root: Path, read_only: bool = False, lock_timeout_s: float = 30.0) -> None:
        self.root = Path(root)
        self.read_only = read_only
        self.lock_timeout_s = lock_timeout_s
        self.manifest = read_manifest(self.root)
        self._open_arrays()
        self._ids: dict[bytes, int] = {}
        self._meta: dict[str, np.ndarray] = {}
        self._index_rows(0, self.manifest.n_blocks)

    # ---------------------------------------------------------------- create / open
    @classmethod
    def open(cls, root, read_only: bool = True, lock_timeout_s: float = 30.0) -> "BlockStore":
        """Open an existing store; StoreError if `root` is not one."""
        root = Path(root)
        if root.exists() and not root.is_dir():
            raise StoreError(f"{root} is a file, not a store directory")
        if not (root / MANIFEST_NAME).is_file():
            raise StoreError(f"no kvmemory store at {root} (no {MANIFEST_NAME})")
        return cls(root, read_only=read_only, lock_timeout_s=lock_timeout_s)

    @classmethod
    def create(cls, root: Path, manifest: Manifest, lock_timeout_s: float = 30.0) -> "BlockStore":
        root = Path(root)
        root.mkdir(parents=True, exist_ok=True)
        with writer_lock(root, lock_timeout_s):
            if (root / MANIFEST_NAME).exists():  # another process created it meanwhile
                return cls(root, lock_timeout_s=lock_timeout_s)
            g = zarr.open_group(store=LocalStore(root / "data"), mode="w", zarr_format=3)
            m = manifest
            C = m.block_tokens
            kv_shape = (m.model["layers"], 2, m.model["kv_heads"], C, m.model["head_dim"])
            codecs = None
            if m.codec == "zstd":
                codecs = [zarr.codecs.BloscCodec(cname="zstd", clevel=3, shuffle="shuffle")]
            g.create_array("kv", shape=(0, *kv_shape), dtype=STORAGE_DTYPE[m.kv_dtype],
                           chunks=(1, *kv_shape), shards=(m.shard_blocks, *kv_shape),
                           compressors=codecs, fill_value=0)
            for name, shape, dtype, fill in (
                ("tokens", (C,), "int32", -1), ("positions", (C,), "int32", -1),
                ("parent", (), "int64", -1), ("n_tokens", (), "int32", 0),
                ("block_id", (hashing.ID_BYTES,), "uint8", 0), ("digest", (hashing.ID_BYTES,), "uint8", 0),
            ):
                g.create_array(name, shape=(0, *shape), dtype=dtype, chunks=(META_CHUNK_ROWS, *shape),
                               compressors=None, fill_value=fill)
            _fsync_tree(root / "data")
            write_manifest(root, manifest)  # last: the store exists once this lands
        return cls(root, lock_timeout_s=lock_timeout_s)

    def _open_arrays(self) -> None:
        try:
            store = LocalStore(self.root / "data", read_only=True)
            g = zarr.open_group(store=store, mode="r", zarr_format=3)
            self._arr = {name: g[name] for name in
                         ("kv", "tokens", "positions", "parent", "n_tokens", "block_id", "digest")}
        except Exception as e:  # zarr raises many types for a damaged group; name the store
            raise StoreCorruptError(f"store {self.root}: cannot open its Zarr arrays: {e}") from None
        # our own raw layout is read straight from the shard files (see shards.py)
        self._direct = shards.direct_layout(self.root / "data" / "kv")
        for name, a in self._arr.items():
            if a.shape[0] < self.manifest.n_blocks:
                raise StoreCorruptError(
                    f"store {self.root}: array {name} has {a.shape[0]} rows, manifest commits "
                    f"{self.manifest.n_blocks}")

    def _writable_arrays(self) -> dict[str, zarr.Array]:
        g = zarr.open_group(store=LocalStore(self.root / "data"), mode="r+", zarr_format=3)
        return {name: g[name] for name in self._arr}

    def _index_rows(self, start: int, stop: int) -> None:
        """Load metadata of committed rows [start, stop): committed rows never change, so it is kept."""
        for name in META_ARRAYS:
            part = self._read(name, start, stop) if stop > start else self._arr[name][0:0]
            self._meta[name] = part if start == 0 else np.concatenate([self._meta[name][:start], part])
        for row in range(start, stop):
            self._ids[self._meta["block_id"][row].tobytes()] = row

    def _read(self, name: str, start: int, stop: int) -> np.ndarray:
        try:
            return self._arr[name][start:stop]
        except Exception as e:
            raise StoreCorruptError(f"store {self.root}: cannot read {name} rows {start}..{stop - 1}: {e}") from None

    # ---------------------------------------------------------------- queries
    @property
    def n_blocks(self) -> int:
        return self.manifest.n_blocks

    def row_of(self, block_id: bytes) -> int | None:
        return self._ids.get(block_id)

    def refresh(self) -> None:
        """Pick up commits made by other processes since this store was opened."""
        m = read_manifest(self.root)
        if m.commit == self.manifest.commit:
            return
        if m.fingerprint != self.manifest.fingerprint:
            raise StoreCorruptError(f"store {self.root}: fingerprint changed under an open store")
        old = self.manifest.n_blocks
        self.manifest = m
        self._open_arrays()
        self._index_rows(old, m.n_blocks)

    def chain(self, last_row: int) -> list[int]:
        """Rows from position 0 to last_row, following parent pointers."""
        parents = self._meta["parent"]
        rows = []
        row = last_row
        while row != -1:
            if not (0 <= row < self.manifest.n_blocks) or len(rows) > self.manifest.n_blocks:
                raise StoreCorruptError(f"store {self.root}: broken parent chain at row {row}")
            rows.append(row)
            row = int(parents[row])
        return rows[::-1]

    def block_meta(self, rows: Sequence[int]) -> dict[str, np.ndarray]:
        """tokens, positions, n_tokens, parent, block_id, digest of the given committed rows."""
        idx = np.asarray(list(rows), dtype=np.int64)
        return {name: arr[idx] for name, arr in self._meta.items()}

    def read_kv(self, rows: Sequence[int], verify: bool = True) -> tuple[np.ndarray, np.ndarray]:
        """KV of committed rows, digest-checked. Returns (kv [k, L, 2, H, C, D], n_tokens [k]).

        Contiguous runs of rows are read with one slice each, so Zarr fetches their chunks
        concurrently. Raises StoreCorruptError naming the first bad block.
        """
        rows = [int(r) for r in rows]
        for r in rows:
            if not (0 <= r < self.manifest.n_blocks):
                raise StoreCorruptError(f"store {self.root}: row {r} is not committed")
        meta = self.block_meta(rows)
        if self._direct is not None:
            kv = np.empty((len(rows), *self._arr["kv"].shape[1:]), dtype=self._arr["kv"].dtype)
            shards.read_blocks(self.root / "data" / "kv", rows, kv, self._direct[0])
        else:
            parts = [self._read("kv", start, stop) for start, stop in _runs(rows)]
            kv = parts[0] if len(parts) == 1 else np.concatenate(parts)
        if verify:
            for i, r in enumerate(rows):
                self._check_digest(r, kv[i], int(meta["n_tokens"][i]), meta["digest"][i], meta["block_id"][i])
        return kv, meta["n_tokens"]

    def read_state_kv(self, rows: Sequence[int]) -> np.ndarray:
        """Blocks of a chain concatenated along tokens, digest-checked: [L, 2, H, T, D] storage words."""
        rows = [int(r) for r in rows]
        meta = self.block_meta(rows)
        n = [int(x) for x in meta["n_tokens"]]
        shape = self._arr["kv"].shape
        if self._direct is None:      # compressed chunks: zarr decodes, then one concatenation
            if not rows:
                return np.zeros((*shape[1:4], 0, shape[5]), dtype=self._arr["kv"].dtype)
            kv, _ = self.read_kv(rows)
            return np.concatenate([kv[i][:, :, :, :n[i]] for i in range(len(rows))], axis=3)
        out = np.empty((shape[1], shape[2], shape[3], sum(n), shape[5]), dtype=self._arr["kv"].dtype)
        shards.read_state(self.root / "data" / "kv", rows, n, [d.tobytes() for d in meta["digest"]],
                          [b.tobytes().hex() for b in meta["block_id"]], out, self._direct[0])
        return out

    def _check_digest(self, row: int, kv: np.ndarray, n: int, want: np.ndarray, bid: np.ndarray) -> None:
        got = block_digest(kv, n)
        if got != want.tobytes():
            raise StoreCorruptError(
                f"store {self.root}: block {bid.tobytes().hex()} (row {row}) failed its digest check: "
                f"stored {want.tobytes().hex()}, read {got.hex()}")

    def verify_all(self, progress: Iterable | None = None) -> list[tuple[int, str]]:
        """E1 over every committed block: KV digest, and the id re-derived from parent, tokens, positions.

        Returns [(row, reason)] of bad blocks; empty if all are good.
        """
        bad = []
        n = self.manifest.n_blocks
        meta = self.block_meta(range(n))
        for row in (progress if progress is not None else range(n)):
            bid = meta["block_id"][row].tobytes()
            k = int(meta["n_tokens"][row])
            parent = int(meta["parent"][row])
            parent_id = meta["block_id"][parent].tobytes() if parent >= 0 else hashing.ROOT_PARENT
            if not (-1 <= parent < row) or hashing.block_id(self.manifest.fingerprint, parent_id,
                                                             meta["tokens"][row][:k], meta["positions"][row][:k]) != bid:
                bad.append((row, f"block {bid.hex()} (row {row}): its id does not match its parent, tokens and positions"))
                continue
            try:
                self.read_kv([row])
            except StoreCorruptError as e:
                bad.append((row, str(e)))
        return bad

    # ---------------------------------------------------------------- writes
    def commit(self, build) -> Manifest:
        """Run one write transaction under the writer lock.

        `build(store)` is called with the store refreshed to the newest commit; it returns
        (new_blocks, new_states) or (new_blocks, new_states, new_docs, removed_doc_ids), where
        new_blocks were made against the refreshed ids. Data is written and fsynced first, the
        manifest last: a crash leaves the old commit whole.
        """
        if self.read_only:
            raise StoreReadOnlyError(f"store {self.root} is open read-only")
        with writer_lock(self.root, self.lock_timeout_s):
            self.refresh()
            result = build(self)
            new_blocks, new_states = result[0], result[1]
            new_docs, removed_docs = (result[2], result[3]) if len(result) > 2 else ({}, ())
            m = self.manifest
            if not new_blocks and not new_states and not new_docs and not removed_docs:
                return m
            start = m.n_blocks
            if new_blocks:
                self._append(start, new_blocks)
            states = {**m.states, **new_states}
            docs = {k: v for k, v in {**m.docs, **new_docs}.items() if k not in removed_docs}
            new_m = Manifest(**{**m.__dict__, "n_blocks": start + len(new_blocks),
                                "commit": m.commit + 1, "states": states, "docs": docs})
            write_manifest(self.root, new_m)
            self.manifest = new_m
            self._open_arrays()
            self._index_rows(start, new_m.n_blocks)
            return new_m

    def _append(self, start: int, blocks: list[NewBlock]) -> None:
        t0 = time.time()                 # before the resize: the new shapes must be fsynced too
        arrs = self._writable_arrays()
        k = len(blocks)
        C = self.manifest.block_tokens
        need = start + k
        for a in arrs.values():
            if a.shape[0] < need:
                a.resize((need, *a.shape[1:]))
        kv = np.zeros((k, *arrs["kv"].shape[1:]), dtype=arrs["kv"].dtype)
        tokens = np.full((k, C), -1, np.int32)
        positions = np.full((k, C), -1, np.int32)
        digests = np.zeros((k, hashing.ID_BYTES), np.uint8)
        for i, b in enumerate(blocks):
            n = len(b.tokens)
            if b.kv.shape != (*kv.shape[1:4], n, kv.shape[5]) or b.kv.dtype != kv.dtype:
                raise StoreError(f"block {i}: kv {b.kv.shape} {b.kv.dtype} does not fit the store layout "
                                 f"{kv.shape[1:]} {kv.dtype}")
            kv[i, :, :, :, :n] = b.kv
            tokens[i, :n] = b.tokens
            positions[i, :n] = b.positions
            digests[i] = np.frombuffer(block_digest(kv[i], n), np.uint8)
        sl = slice(start, need)
        arrs["kv"][sl] = kv
        arrs["tokens"][sl] = tokens
        arrs["positions"][sl] = positions
        arrs["parent"][sl] = np.array([b.parent_row for b in blocks], np.int64)
        arrs["n_tokens"][sl] = np.array([len(b.tokens) for b in blocks], np.int32)
        arrs["block_id"][sl] = np.stack([np.frombuffer(b.block_id, np.uint8) for b in blocks])
        arrs["digest"][sl] = digests
        # mtime has coarse granularity on some filesystems: look a little further back
        _fsync_tree(self.root / "data", since=t0 - 2.0)

    # ---------------------------------------------------------------- sizes
    def disk_bytes(self) -> int:
        return sum(p.stat().st_size for p in (self.root / "data").rglob("*") if p.is_file())


def block_digest(kv_block: np.ndarray, n: int) -> bytes:
    """Digest of one block's valid KV: kv_block [L, 2, H, C, D] -> hash of [..., :n, :] bytes."""
    valid = kv_block[:, :, :, :n, :]
    return hashing.digest(np.ascontiguousarray(valid).view(np.uint8).reshape(-1))


def _runs(rows: Sequence[int]) -> list[tuple[int, int]]:
    runs = []
    for r in rows:
        if runs and runs[-1][1] == r:
            runs[-1] = (runs[-1][0], r + 1)
        else:
            runs.append((r, r + 1))
    return runs


def _fsync_tree(path: Path, since: float | None = None) -> None:
    """fsync data files (and their directories) so the manifest never commits unsynced data."""
    for dirpath, _, files in os.walk(path):
        for f in files:
            p = os.path.join(dirpath, f)
            if since is not None and os.stat(p).st_mtime < since:
                continue
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(Path(dirpath))


__all__ = ["BlockStore", "NewBlock", "StateEntry", "block_digest"]
