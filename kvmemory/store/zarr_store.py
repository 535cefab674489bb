"""BlockStore: blocks of KV as append-only Zarr v3 arrays plus a commit log (the commit point).

Layout of a store directory:
    manifest.json            header: format, model fingerprint and geometry, block layout (written once)
    log/                     commit records and snapshots (kvmemory/manifest.py): the commit point
    data/                    Zarr v3 group; every array's first axis is the block row
      kv        [R, layers, 2, kv_heads, C, head_dim]  raw KV words (bf16 as uint16), sharded
      tokens    [R, C] int32 (-1 pads a partial block)
      positions [R, C] int32 (-1 pads)
      parent    [R] int64   row of the previous block, -1 at position 0
      n_tokens  [R] int32
      block_id  [R, 16] uint8  hash(fingerprint, parent id, tokens, positions)
      digest    [R, 16] uint8  xxh3-128 of the block's valid KV bytes
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

import dataclasses
import errno
import hashlib
import json
import os
import shutil
import socket
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import zarr
import zarr.codecs
from zarr.storage import LocalStore

from kvmemory import hashing
from kvmemory.errors import StoreCorruptError, StoreError, StoreExistsError, StoreLockedError, StoreReadOnlyError
from kvmemory.manifest import (LOG_DIR, MANIFEST_NAME, SNAPSHOT_EVERY, TEMP_SUFFIX, CommitRecord, DocEntry, Manifest,
                               StateEntry, fsync_dir, fsync_path, read_manifest, read_new_records, write_header,
                               write_record, write_snapshot)
from kvmemory.store import shards
from kvmemory.store.cache import ShardCache
from kvmemory.store.lock import writer_lock
from kvmemory.store.objects import LocalFiles, ObjectFiles

# numpy dtype that holds each KV dtype's raw words losslessly (Zarr has no bfloat16)
STORAGE_DTYPE = {"float32": "float32", "float16": "float16", "bfloat16": "uint16"}
ROW_CAPACITY = 1 << 32
META_ARRAYS = ("tokens", "positions", "parent", "n_tokens", "block_id", "digest")
ARRAYS = ("kv", *META_ARRAYS)
INDEX_DIR = "index"                       # the selection indexes (derived data, written under the writer lock)
TRACE_ENV = "KVMEMORY_TRACE_COMMITS"      # a file to append "begin/end <time>" of each commit to
CLAIMS_DIR = "claims"                     # object stores: claims/<shard> names the committer that owns a shard


@dataclass
class NewBlock:
    """A block to append. kv: [layers, 2, kv_heads, n, head_dim] in storage dtype, n <= C."""

    block_id: bytes
    parent_row: int
    tokens: np.ndarray      # [n] int
    positions: np.ndarray   # [n] int
    kv: np.ndarray


@dataclass
class Change:
    """What one commit adds or removes (returned by the `build` function given to commit)."""

    blocks: list[NewBlock]
    states: dict[str, StateEntry]
    docs: dict[str, DocEntry]
    removed_docs: tuple[str, ...] = ()
    removed_states: tuple[str, ...] = ()


@dataclass(frozen=True)
class GcReport:
    blocks_freed: int
    bytes_freed: int
    files_removed: int
    files_rewritten: int


class BlockStore:
    """The on-disk truth. Opening reads the header and the log; every block read verifies its digest."""

    def __init__(self, root: Path, read_only: bool = False, lock_timeout_s: float = 30.0, files=None,
                 cache_bytes: int = 8 << 30) -> None:
        """root: the store directory; for a store on an object store (`files` an ObjectFiles) the
        local working directory that holds its disk cache tier and derived indexes."""
        self.root = Path(root)
        self.files = files if files is not None else LocalFiles(self.root)
        self.remote = bool(self.files.remote)
        self.name = self.files.describe()
        self.read_only = read_only
        self.lock_timeout_s = lock_timeout_s
        if self.remote:
            self.root.mkdir(parents=True, exist_ok=True)
        self.cache = ShardCache(self.files, self.root / "cache", cache_bytes) if self.remote else None
        self.manifest = read_manifest(self.files)
        self._open_arrays()
        self._chunks: dict[int, dict[str, np.ndarray]] = {}   # metadata chunk -> arrays (committed: immutable)
        self._ids: dict[bytes, int] | None = None             # built on first row_of
        self._writable: dict[str, zarr.Array] | None = None
        self._cleaned = False
        self._claimed = 0                                     # object stores: shards below this are taken
        self._mutex = threading.RLock()                        # one thread at a time changes this object
        self._lock_depth = 0

    # ---------------------------------------------------------------- create / open
    @classmethod
    def open(cls, root, read_only: bool = True, lock_timeout_s: float = 30.0, storage_options: dict | None = None,
             work_dir=None) -> "BlockStore":
        """Open an existing store (a directory, or s3://bucket/prefix); StoreError if `root` is not one."""
        from kvmemory.store.objects import is_url, open_files

        if is_url(root):
            files = open_files(root, storage_options)
            if not files.exists(MANIFEST_NAME):
                raise StoreError(f"no kvmemory store at {files.describe()} (no {MANIFEST_NAME})")
            return cls(Path(work_dir) if work_dir is not None else default_work_dir(files.describe()),
                       read_only=read_only, lock_timeout_s=lock_timeout_s, files=files)
        root = Path(root)
        if root.exists() and not root.is_dir():
            raise StoreError(f"{root} is a file, not a store directory")
        if not (root / MANIFEST_NAME).is_file():
            raise StoreError(f"no kvmemory store at {root} (no {MANIFEST_NAME})")
        return cls(root, read_only=read_only, lock_timeout_s=lock_timeout_s)

    @classmethod
    def create_remote(cls, files: ObjectFiles, work_dir: Path, manifest: Manifest, lock_timeout_s: float = 30.0,
                      cache_bytes: int = 8 << 30) -> "BlockStore":
        """Create a store on an object store. The arrays' metadata first, the header last with a
        create-only write: of two processes creating one store, one header lands and both open it."""
        if not files.exists(MANIFEST_NAME):
            try:
                _create_arrays(files.zarr_store("data", read_only=False), manifest)
                write_header(files, manifest)
            except StoreExistsError:
                pass                                   # another process created it meanwhile
        return cls(work_dir, lock_timeout_s=lock_timeout_s, files=files, cache_bytes=cache_bytes)

    @classmethod
    def create(cls, root: Path, manifest: Manifest, lock_timeout_s: float = 30.0) -> "BlockStore":
        root = Path(root)
        root.mkdir(parents=True, exist_ok=True)
        with writer_lock(root, lock_timeout_s):
            if (root / MANIFEST_NAME).exists():  # another process created it meanwhile
                return cls(root, lock_timeout_s=lock_timeout_s)
            shutil.rmtree(root / "data", ignore_errors=True)   # an earlier create that did not finish
            try:
                _create_arrays(LocalStore(root / "data"), manifest)
                _fsync_tree(root / "data")
                (root / LOG_DIR).mkdir(exist_ok=True)
                for d in (root / "data", root / LOG_DIR, root):
                    fsync_dir(d)
            except OSError as e:
                raise StoreError(f"cannot create store {root}: {e.strerror or e}") from None
            write_header(root, manifest)  # last: the store exists once this lands
        return cls(root, lock_timeout_s=lock_timeout_s)

    def _open_arrays(self) -> None:
        try:
            store = self.files.zarr_store("data", read_only=True)
            g = zarr.open_group(store=store, mode="r", zarr_format=3)
            self._arr = {name: g[name] for name in ARRAYS}
        except Exception as e:  # zarr raises many types for a damaged group; name the store
            raise StoreCorruptError(f"store {self.name}: cannot open its Zarr arrays: {e}") from None
        for name, a in self._arr.items():
            per = a.shards[0] if name == "kv" and a.shards else a.chunks[0]
            if a.shape[0] != ROW_CAPACITY or per != self.manifest.shard_blocks:
                raise StoreCorruptError(f"store {self.name}: array {name} has shape {a.shape} and {per} rows per "
                                        f"file; this layout needs {ROW_CAPACITY} rows, {self.manifest.shard_blocks} "
                                        "per file")
        # our own shard layout is read straight from the files (see shards.py); on an object store
        # from local copies of the shard objects (the disk cache tier)
        self._layout = shards.layout_of(self.files.read("data/kv/zarr.json").decode())
        self._direct = self._layout if self._layout is not None and self._layout.raw else None
        self._kv_dir = (self.cache.root if self.remote else self.root) / "data" / "kv"

    # ---------------------------------------------------------------- queries
    @property
    def n_blocks(self) -> int:
        """Committed blocks (not reclaimed by gc)."""
        return self.manifest.n_blocks

    @property
    def next_row(self) -> int:
        """Row of the first block the next commit appends."""
        return self.manifest.next_row

    def is_committed(self, row: int) -> bool:
        return self.manifest.is_committed(int(row))

    def row_of(self, block_id: bytes) -> int | None:
        with self._mutex:
            if self._ids is None:
                self._ids = {}
                for bid, row in self.manifest.ids():
                    self._ids.setdefault(bid, row)
            return self._ids.get(block_id)

    @property
    def loaded_metadata_chunks(self) -> int:
        """How many metadata chunks this object has read (opening reads none)."""
        return len(self._chunks)

    def refresh(self) -> None:
        """Pick up commits made by other processes since this store was opened (one stat if none)."""
        with self._mutex:
            self._after_records(read_new_records(self.files, self.manifest))

    def _after_records(self, records: list[CommitRecord]) -> None:
        """Bring the id map (if built) up to date with records just applied: only what they changed."""
        if self._ids is None:
            return
        for rec in records:
            if rec.n_new:
                raw = bytes.fromhex(rec.ids)
                for i in range(rec.n_new):
                    self._ids.setdefault(raw[i * 16:(i + 1) * 16], rec.start + i)
            for r in rec.freed:
                bid = self.manifest.id_of(r)
                if self._ids.get(bid) == r:
                    del self._ids[bid]

    def chain(self, last_row: int) -> list[int]:
        """Rows from position 0 to last_row, following parent pointers."""
        rows = []
        row = int(last_row)
        while row != -1:
            if not self.is_committed(row) or len(rows) > self.manifest.n_blocks:
                raise StoreCorruptError(f"store {self.name}: broken parent chain at row {row}")
            rows.append(row)
            row = int(self.block_meta([row])["parent"][0])
        return rows[::-1]

    def block_meta(self, rows: Sequence[int]) -> dict[str, np.ndarray]:
        """tokens, positions, n_tokens, parent, block_id, digest of the given committed rows.

        Metadata chunks are read on first use (contiguous chunks in one request) and kept."""
        rows = [int(r) for r in rows]
        S = self.manifest.shard_blocks
        with self._mutex:
            need = sorted({r // S for r in rows} - self._chunks.keys())
            for c0, c1 in _runs(need):
                parts = {name: self._read(name, c0 * S, c1 * S) for name in META_ARRAYS}
                for c in range(c0, c1):
                    self._chunks[c] = {name: a[(c - c0) * S:(c - c0 + 1) * S] for name, a in parts.items()}
            chunks = self._chunks
        out = {}
        for name in META_ARRAYS:
            a = self._arr[name]
            buf = np.empty((len(rows), *a.shape[1:]), a.dtype)
            for i, r in enumerate(rows):
                buf[i] = chunks[r // S][name][r % S]
            out[name] = buf
        return out

    def _read(self, name: str, start: int, stop: int) -> np.ndarray:
        try:
            return self._arr[name][start:stop]
        except Exception as e:
            raise StoreCorruptError(f"store {self.name}: cannot read {name} rows {start}..{stop - 1}: {e}") from None

    def verified_meta(self, rows: Sequence[int]) -> dict[str, np.ndarray]:
        """block_meta of committed rows whose ids re-derive from their parent's id, tokens and positions,
        and whose positions are consecutive: metadata a RoPE shift or a graft may rely on."""
        rows = [int(r) for r in rows]
        self._check_committed(rows)
        meta = self.block_meta(rows)
        parents = [int(p) for p in meta["parent"]]
        pmeta = self.block_meta([p for p in parents if p >= 0])
        pid = iter(pmeta["block_id"])
        fp = self.manifest.fingerprint
        for i, r in enumerate(rows):
            n = int(meta["n_tokens"][i])
            pos = meta["positions"][i][:n]
            parent_id = next(pid).tobytes() if parents[i] >= 0 else hashing.ROOT_PARENT
            bid = meta["block_id"][i].tobytes()
            if not (0 < n <= self.manifest.block_tokens) or np.any(np.diff(pos) != 1) or \
                    hashing.block_id(fp, parent_id, meta["tokens"][i][:n], pos) != bid or \
                    self.manifest.id_of(r) != bid:
                raise StoreCorruptError(f"store {self.name}: block {bid.hex()} (row {r}): its id does not match "
                                        "its parent, tokens and positions")
        return meta

    def _check_committed(self, rows: Iterable[int]) -> None:
        for r in rows:
            if not self.is_committed(r):
                why = "was reclaimed by gc" if r in self.manifest.freed else "is not committed"
                raise StoreCorruptError(f"store {self.name}: row {r} {why}")

    def read_kv(self, rows: Sequence[int], verify: bool = True) -> tuple[np.ndarray, np.ndarray]:
        """KV of committed rows, digest-checked. Returns (kv [k, L, 2, H, C, D], n_tokens [k]).

        Raises StoreCorruptError naming the first bad block.
        """
        rows = [int(r) for r in rows]
        self._check_committed(rows)
        meta = self.block_meta(rows)
        if self._direct is not None:
            kv = np.empty((len(rows), *self._arr["kv"].shape[1:]), dtype=self._arr["kv"].dtype)

            def read() -> None:
                shards.read_blocks(self._kv_dir, rows, kv, self._direct.per_shard)
                if verify:                       # inside: a damaged disk-tier copy is fetched again
                    self._check_digests(rows, kv, meta)
            self._cached_read(rows, read)
            return kv, meta["n_tokens"]
        else:
            parts = [self._read("kv", start, stop) for start, stop in _runs(rows)]
            kv = parts[0] if len(parts) == 1 else np.concatenate(parts)
        if verify:
            self._check_digests(rows, kv, meta)
        return kv, meta["n_tokens"]

    def read_state_kv(self, rows: Sequence[int]) -> np.ndarray:
        """Blocks of a chain concatenated along tokens, digest-checked: [L, 2, H, T, D] storage words."""
        rows = [int(r) for r in rows]
        self._check_committed(rows)
        meta = self.block_meta(rows)
        n = [int(x) for x in meta["n_tokens"]]
        shape = self._arr["kv"].shape
        want = (shape[1], shape[2], shape[3], sum(n), shape[5])
        if self._direct is None:      # compressed chunks: zarr decodes, then one concatenation
            res = np.zeros(want, dtype=self._arr["kv"].dtype)
            if rows:
                kv, _ = self.read_kv(rows)
                np.concatenate([kv[i][:, :, :, :n[i]] for i in range(len(rows))], axis=3, out=res)
            return res
        res = shards.host_buffer(want, self._arr["kv"].dtype)
        self._cached_read(rows, lambda: shards.read_state(
            self._kv_dir, rows, n, [d.tobytes() for d in meta["digest"]], [b.tobytes().hex() for b in meta["block_id"]],
            res, self._direct.per_shard))
        return res

    def _check_digests(self, rows: list[int], kv: np.ndarray, meta: dict) -> None:
        for i, r in enumerate(rows):
            self._check_digest(r, kv[i], int(meta["n_tokens"][i]), meta["digest"][i], meta["block_id"][i])

    def _shard_key(self, shard: int) -> str:
        return "data/kv/c/" + "/".join([str(shard)] + ["0"] * (self._arr["kv"].ndim - 1))

    def _cached_read(self, rows: list[int], read: Callable[[], object]) -> None:
        """Run a direct read of `rows`. On an object store: first bring their shard objects to the
        disk tier; a read that fails (a damaged or evicted copy) drops the copies and fetches them
        once more, and what fails then is reported as it is."""
        if not self.remote:
            read()
            return
        S = self._direct.per_shard
        want: dict[str, int] = {}
        for r in rows:
            k = self._shard_key(r // S)
            want[k] = want.get(k, 0) + 1
        self.cache.ensure(want)
        try:
            read()
        except StoreCorruptError:
            self.cache.drop(want)
            self.cache.ensure(want)
            read()
        finally:
            self.cache.trim(keep=())

    def _check_digest(self, row: int, kv: np.ndarray, n: int, want: np.ndarray, bid: np.ndarray) -> None:
        got = block_digest(kv, n)
        if got != want.tobytes():
            raise StoreCorruptError(
                f"store {self.name}: block {bid.tobytes().hex()} (row {row}) failed its digest check: "
                f"stored {want.tobytes().hex()}, read {got.hex()}")

    def verify_all(self, progress=None) -> list[tuple[int, str]]:
        """E1 over every committed block: KV digest, the id re-derived from parent, tokens, positions,
        and the id the commit log recorded. Returns [(row, reason)] of bad blocks; empty if all are good."""
        bad = []
        rows = self.manifest.committed_rows()
        for part in range(0, len(rows), 64):
            chunk = rows[part:part + 64]
            for row in chunk:
                try:
                    parent = int(self.verified_meta([row])["parent"][0])
                    if parent >= row or (parent >= 0 and not self.is_committed(parent)):
                        raise StoreCorruptError(f"block (row {row}): its parent row {parent} is not an earlier "
                                                "committed block")
                except StoreCorruptError as e:
                    bad.append((row, str(e)))
                    continue
                try:
                    self.read_kv([row])
                except StoreCorruptError as e:
                    bad.append((row, str(e)))
            if progress is not None:
                progress.update(len(chunk))
        return bad

    # ---------------------------------------------------------------- writes
    @contextmanager
    def write_lock(self):
        """The store's writer lock (across processes), re-entrant within this object."""
        if self.read_only:
            raise StoreReadOnlyError(f"store {self.name} is open read-only")
        with self._mutex:
            if self._lock_depth:
                self._lock_depth += 1
                try:
                    yield
                finally:
                    self._lock_depth -= 1
                return
            # on an object store this lock (on the local working directory) orders the processes of
            # one machine, which share its derived indexes; machines commit without a common lock
            with writer_lock(self.root, self.lock_timeout_s):
                self._lock_depth = 1
                try:
                    yield
                finally:
                    self._lock_depth = 0

    def commit(self, build: Callable[["BlockStore"], "Change | tuple"],
               after: Callable[[Manifest], None] | None = None) -> Manifest:
        """Run one write transaction under the writer lock.

        `build(store)` is called with the store refreshed to the newest commit; it returns a
        Change (or the tuple (blocks, states[, docs, removed_doc_ids])), its new blocks made
        against the refreshed ids (rows from store.next_row on). Data files are written and
        fsynced first, the commit record last: a crash or a full disk leaves the previous commit
        whole. `after(manifest)` runs once the commit is durable, still under the lock.
        StoreReadOnlyError on a read-only store (from write_lock).
        """
        with self.write_lock():
            _trace("begin")
            try:
                self.refresh()
                if not self._cleaned:
                    self.clean_leftovers()
                ch = build(self)
                if not isinstance(ch, Change):
                    ch = Change(ch[0], ch[1], *(ch[2:4] if len(ch) > 2 else ({}, ())))
                m = self.manifest
                if not ch.blocks and not ch.states and not ch.docs and not ch.removed_docs and not ch.removed_states:
                    return m
                start = m.next_row
                if ch.blocks and self.remote:
                    # no lock across machines: claim shards of our own (create-only), then move the
                    # rows build planned from next_row on to them
                    claimed = self._claim_rows(len(ch.blocks))
                    ch = _relocate(ch, start, claimed)
                    start = claimed
                self._check_refs(ch, start)
                keys: list[str] = []
                try:
                    if ch.blocks:
                        keys = self._append(start, ch.blocks)
                    while True:
                        rec = CommitRecord(commit=self.manifest.commit + 1, start=start if ch.blocks else 0,
                                           ids="".join(b.block_id.hex() for b in ch.blocks),
                                           tokens=sum(len(b.tokens) for b in ch.blocks), states=dict(ch.states),
                                           docs=dict(ch.docs), removed_docs=list(ch.removed_docs),
                                           removed_states=list(ch.removed_states), time=time.time())
                        try:
                            write_record(self.files, rec)
                            break
                        except StoreExistsError:
                            if not self.remote:
                                raise
                            # another machine committed first: take its commit, check that what ours
                            # names is still there, and try the next commit number
                            self.refresh()
                            self._check_refs(ch, start)
                except BaseException:
                    for k in keys:                    # rows no commit names: nothing may keep them
                        self._remove(k)
                    raise
                self._apply(rec)
                if rec.commit % SNAPSHOT_EVERY == 0:
                    try:
                        write_snapshot(self.files, self.manifest)
                    except StoreError:
                        pass                          # an optimisation: the records alone are complete
                if after is not None:
                    after(self.manifest)
                return self.manifest
            finally:
                _trace("end")

    def _claim_rows(self, k: int) -> int:
        """Object stores: claim ceil(k / shard_blocks) consecutive shards no one else holds, each
        with a create-only claims/<shard> object; returns the first row. A shard another committer
        claimed first is skipped (with the ones claimed before it: rows, not bytes, are lost)."""
        S = self.manifest.shard_blocks
        n = -(-k // S)
        low = max(self.manifest.next_row // S, self._claimed)
        # claims past what this process knows of (LIST from there on: one page, however big the store)
        taken = [int(x) for x in self.files.list(CLAIMS_DIR, after=f"{CLAIMS_DIR}/{low:010d}") if x.isdigit()]
        c = max([low] + [t + 1 for t in taken])
        deadline = time.monotonic() + max(self.lock_timeout_s, 1.0)
        body = json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "time": time.time()}).encode()
        while True:
            got = 0
            for j in range(n):
                try:
                    self.files.create(f"{CLAIMS_DIR}/{c + j:010d}", body)
                except StoreExistsError:
                    break
                got += 1
            if got == n:
                self._claimed = c + n
                return c * S
            if time.monotonic() > deadline:
                raise StoreLockedError(f"store {self.name}: could not claim {n} free shards within "
                                       f"{self.lock_timeout_s:g} s (many committers at once?)")
            c += got + 1

    def _check_refs(self, ch: Change, start: int) -> None:
        """A commit may only name rows that are committed or that it appends."""
        new = range(start, start + len(ch.blocks))
        rows = [s.last_row for s in ch.states.values()] + [r for d in ch.docs.values() for r in d.rows]
        lost = [r for r in rows if r not in new and not self.is_committed(r)]
        if lost:
            why = "were reclaimed by gc meanwhile" if any(r in self.manifest.freed for r in lost) else \
                "are not committed"
            raise StoreError(f"store {self.name}: this commit names block rows that {why} "
                             f"({lost[:5]}); nothing was written: run it again")

    def _apply(self, rec: CommitRecord) -> None:
        self.manifest.apply(rec)
        self._after_records([rec])

    def plan_chain(self, chain: Sequence[bytes], tokens: Sequence[int], start: int, parent_row: int,
                   kv_of: Callable[[int], np.ndarray]) -> tuple[list[NewBlock], list[int]]:
        """The one chain builder: blocks chain[i] (tokens[i*C:(i+1)*C] at positions start + i*C ..)
        that the store lacks become NewBlocks (kv_of(i): storage words), rows from next_row on.
        Returns (new blocks, the row of every block of the chain)."""
        C = self.manifest.block_tokens
        new: list[NewBlock] = []
        rows: list[int] = []
        for i, bid in enumerate(chain):
            row = self.row_of(bid)
            if row is None:
                row = self.next_row + len(new)
                toks = np.asarray(tokens[i * C:(i + 1) * C])
                new.append(NewBlock(bid, parent_row, toks, np.arange(start + i * C, start + i * C + len(toks)),
                                    kv_of(i)))
            rows.append(row)
            parent_row = row
        return new, rows

    def _writable_arrays(self) -> dict[str, zarr.Array]:
        if self._writable is None:
            g = zarr.open_group(store=self.files.zarr_store("data", read_only=False), mode="r+", zarr_format=3)
            self._writable = {name: g[name] for name in ARRAYS}
        return self._writable

    def _files_of(self, first_chunk: int, last_chunk: int) -> list[str]:
        """The data files (keys under the store) holding metadata chunks / kv shards first..last (inclusive)."""
        out = []
        for name in ARRAYS:
            a = self._arr[name]
            for c in range(first_chunk, last_chunk + 1):
                out.append(f"data/{name}/c/" + "/".join([str(c)] + ["0"] * (a.ndim - 1)))
        return out

    def _remove(self, key: str) -> int:
        if self.remote:
            try:
                self.files.delete(key)
            except StoreError:
                return 0                                # best effort: unnamed rows are never read
            return 1
        return _unlink(self.root / key)

    def _append(self, start: int, blocks: list[NewBlock]) -> list[str]:
        """Write new rows [start, start + k) into new files; fsync them. Returns the files written."""
        arrs = self._writable_arrays()
        k = len(blocks)
        S, C = self.manifest.shard_blocks, self.manifest.block_tokens
        files = self._files_of(start // S, (start + k - 1) // S)
        if not self.remote:                          # (on an object store these shards are freshly claimed)
            for f in files:                          # leftovers of an interrupted commit: never merged
                self._remove(f)
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
        sl = slice(start, start + k)
        try:
            with zarr.config.set({"array.write_empty_chunks": True}):   # an all-zero block is still a block
                arrs["kv"][sl] = kv
                arrs["tokens"][sl] = tokens
                arrs["positions"][sl] = positions
                arrs["parent"][sl] = np.array([b.parent_row for b in blocks], np.int64)
                arrs["n_tokens"][sl] = np.array([len(b.tokens) for b in blocks], np.int32)
                arrs["block_id"][sl] = np.stack([np.frombuffer(b.block_id, np.uint8) for b in blocks])
                arrs["digest"][sl] = digests
            if not self.remote:
                _fsync_files([self.root / f for f in files], self.root / "data")
        except Exception as e:
            for f in files:
                self._remove(f)
            if not isinstance(e, OSError) or self.remote:
                if not self.remote:
                    raise
                raise StoreError(f"store {self.name}: cannot write blocks: {type(e).__name__}: "
                                 f"{str(e).splitlines()[0][:300] if str(e) else ''}; the store stays at commit "
                                 f"{self.manifest.commit}") from None
            why = "disk full" if e.errno in (errno.ENOSPC, errno.EDQUOT) else (e.strerror or str(e))
            raise StoreError(f"store {self.name}: cannot write blocks: {why}; the store stays at commit "
                             f"{self.manifest.commit}") from None
        return files

    def clean_leftovers(self) -> int:
        """Remove what interrupted writes left: temp files, and data files past the last commit.
        Called under the writer lock on a writer's first commit. Returns the files removed.

        Only where the writer lock governs writes: the store's root, data/, log/, index/ (not,
        e.g., a server's serve/ folder, whose files are written without that lock).

        On an object store there is no lock: a shard past the last commit may be another
        committer's work in progress, so nothing is removed (rows a failed commit claimed stay
        unnamed, never read)."""
        if self.remote:
            self._cleaned = True
            return 0
        removed = 0
        for top in (self.root / "data", self.root / LOG_DIR, self.root / INDEX_DIR):
            for dirpath, _, names in os.walk(top):
                for f in names:
                    if f.endswith(".partial") or (f.startswith(".") and f.endswith(TEMP_SUFFIX)):
                        removed += _unlink(Path(dirpath) / f)
        for f in os.listdir(self.root):
            if f.startswith(".") and f.endswith(TEMP_SUFFIX):
                removed += _unlink(self.root / f)
        first = self.manifest.next_row // self.manifest.shard_blocks
        for name in ARRAYS:
            cdir = self.root / "data" / name / "c"
            if not cdir.is_dir():
                continue
            for entry in os.listdir(cdir):
                if entry.isdigit() and int(entry) >= first:
                    p = cdir / entry
                    if p.is_dir():
                        shutil.rmtree(p, ignore_errors=True)
                    else:
                        _unlink(p)
                    removed += 1
        self._cleaned = True
        return removed

    # ---------------------------------------------------------------- gc
    def gc(self, grace_s: float = 3600.0) -> GcReport:
        """Reclaim blocks no state or document reaches (through parent pointers), except blocks
        committed in the last `grace_s` seconds (a document being added commits its blocks before
        the document itself: they are not garbage yet).

        First a commit records the rows as freed (from then on no reader takes them as valid: a
        read of a freed row raises), then each shard holding freed rows is rewritten without them
        (temp file, fsync, rename: the live rows are in the old or the new file, never in neither)
        or removed. A crash mid-way leaves bytes to reclaim, which the next gc finds.
        """
        if self.remote:
            raise StoreError(f"store {self.name}: gc of a store on an object store is not supported yet "
                             "(its shard objects are immutable; unreferenced blocks only cost space)")
        with self.write_lock():
            self.refresh()
            if not self._cleaned:
                self.clean_leftovers()
            m = self.manifest
            live = self.reachable() | m.committed_since(time.time() - grace_s)
            dead = sorted(r for r in m.committed_rows() if r not in live)
            if dead:
                toks = int(self.block_meta(dead)["n_tokens"].sum())
                rec = CommitRecord(commit=m.commit + 1, freed=dead, freed_tokens=toks, time=time.time())
                write_record(self.files, rec)
                self._apply(rec)
            return self._reclaim(len(dead))

    def reachable(self) -> set[int]:
        """Rows reachable from a state or a document, parents included."""
        m = self.manifest
        todo = [s.last_row for s in m.states.values()] + [r for d in m.docs.values() for r in d.rows]
        live: set[int] = set()
        while todo:
            fresh = [r for r in set(todo) if r not in live and r >= 0]
            live.update(fresh)
            todo = [int(p) for p in self.block_meta(fresh)["parent"]] if fresh else []
        return live

    def _reclaim(self, blocks_freed: int) -> GcReport:
        m = self.manifest
        S = m.shard_blocks
        if self._layout is None:
            raise StoreError(f"store {self.name}: its kv array does not use kvmemory's shard layout; cannot gc")
        freed, removed, rewritten = 0, 0, 0
        for shard in sorted({r // S for r in m.freed}):
            rows = range(shard * S, (shard + 1) * S)
            keep = [r - shard * S for r in rows if m.is_committed(r)]
            files = [self.root / k for k in self._files_of(shard, shard)]
            kv_file = files[0]
            if not kv_file.exists():
                continue
            if not keep:
                for f in files:
                    if f.exists():
                        freed += f.stat().st_size
                        removed += _unlink(f)
                continue
            got = shards.rewrite_shard(kv_file, set(keep), S)
            if got:
                freed += got
                rewritten += 1
        return GcReport(blocks_freed, freed, removed, rewritten)

    # ---------------------------------------------------------------- sizes
    def disk_bytes(self) -> int:
        """Bytes of the store's committed files (temp files of interrupted writes not counted)."""
        if self.remote:
            return sum(n for k, n in self.files.walk() if not k.startswith(CLAIMS_DIR + "/"))
        total = 0
        for dirpath, _, names in os.walk(self.root):
            for f in names:
                if f.endswith(".partial") or f.endswith(TEMP_SUFFIX):
                    continue
                try:
                    total += os.stat(os.path.join(dirpath, f)).st_size
                except FileNotFoundError:
                    pass
        return total


def default_work_dir(url: str) -> Path:
    """The local working directory of a store on an object store (disk cache tier, derived
    indexes): KVMEMORY_STORE_CACHE_DIR or the user cache directory, one folder per URL."""
    base = os.environ.get("KVMEMORY_STORE_CACHE_DIR")
    if not base:
        import platformdirs

        base = os.path.join(platformdirs.user_cache_dir("kvmemory"), "stores")
    return Path(base) / hashlib.sha256(url.encode()).hexdigest()[:20]


def _relocate(ch: Change, planned: int, start: int) -> Change:
    """The same change with the rows of its new blocks moved from planned.. to start.."""
    if planned == start:
        return ch
    k = len(ch.blocks)

    def mv(r: int) -> int:
        return r - planned + start if planned <= r < planned + k else r
    blocks = [NewBlock(b.block_id, mv(b.parent_row), b.tokens, b.positions, b.kv) for b in ch.blocks]
    states = {sid: dataclasses.replace(e, last_row=mv(e.last_row)) for sid, e in ch.states.items()}
    docs = {d: dataclasses.replace(e, rows=[mv(r) for r in e.rows]) for d, e in ch.docs.items()}
    return Change(blocks, states, docs, ch.removed_docs, ch.removed_states)


def _fsync_tree(top: Path) -> None:
    for dirpath, _, files in os.walk(top):
        for f in files:
            fsync_path(Path(dirpath) / f)
        fsync_dir(Path(dirpath))


def _create_arrays(zstore, m: Manifest) -> None:
    g = zarr.open_group(store=zstore, mode="w", zarr_format=3)
    C, S = m.block_tokens, m.shard_blocks
    kv_shape = (m.model["layers"], 2, m.model["kv_heads"], C, m.model["head_dim"])
    codecs = None
    if m.codec == "zstd":
        codecs = [zarr.codecs.BloscCodec(cname="zstd", clevel=3, shuffle="shuffle")]
    g.create_array("kv", shape=(ROW_CAPACITY, *kv_shape), dtype=STORAGE_DTYPE[m.kv_dtype],
                   chunks=(1, *kv_shape), shards=(S, *kv_shape), compressors=codecs, fill_value=0)
    meta_codec = [zarr.codecs.ZstdCodec(level=1)]      # the fill of a partly used chunk costs nothing
    for name, shape, dtype, fill in (
        ("tokens", (C,), "int32", -1), ("positions", (C,), "int32", -1),
        ("parent", (), "int64", -1), ("n_tokens", (), "int32", 0),
        ("block_id", (hashing.ID_BYTES,), "uint8", 0), ("digest", (hashing.ID_BYTES,), "uint8", 0),
    ):
        g.create_array(name, shape=(ROW_CAPACITY, *shape), dtype=dtype, chunks=(S, *shape),
                       compressors=meta_codec, fill_value=fill)


def _fsync_files(files: list[Path], top: Path) -> None:
    """fsync exactly these files (those that exist: zarr may skip none, but be exact) and every
    directory between them and `top`, deepest first, so their names are durable too."""
    dirs: set[Path] = set()
    for f in files:
        if f.exists():
            fsync_path(f)
        d = f.parent
        while d != top and top in d.parents:
            dirs.add(d)
            d = d.parent
    for d in sorted(dirs, key=lambda p: -len(p.parts)):
        if d.exists():
            fsync_dir(d)


def _unlink(p: Path) -> int:
    try:
        os.unlink(p)
        return 1
    except FileNotFoundError:
        return 0


def _trace(what: str) -> None:
    path = os.environ.get(TRACE_ENV)
    if path:
        with open(path, "a") as f:
            f.write(f"{what} {time.time():.6f}\n")


def block_digest(kv_block: np.ndarray, n: int) -> bytes:
    """Digest of one block's valid KV: kv_block [L, 2, H, C, D] -> hash of [..., :n, :] bytes."""
    valid = kv_block[:, :, :, :n, :]
    return hashing.digest(np.ascontiguousarray(valid).view(np.uint8).reshape(-1))


def _runs(rows: Sequence[int]) -> list[tuple[int, int]]:
    runs: list[tuple[int, int]] = []
    for r in rows:
        if runs and runs[-1][1] == r:
            runs[-1] = (runs[-1][0], r + 1)
        else:
            runs.append((r, r + 1))
    return runs


__all__ = ["BlockStore", "Change", "GcReport", "NewBlock", "StateEntry", "block_digest"]
