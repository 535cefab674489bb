"""Writes: one commit is a transaction under the writer lock. Its build function returns a Change
(new blocks, states and documents added or removed) against the newest commit; the data files are
written and made durable first, the commit record last (create-only), so a crash or a full disk
leaves the previous commit whole. On an object store (no lock spans machines) a committer claims
shards of its own first and moves its planned rows there."""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import zarr

from kvmemory import hashing
from kvmemory.errors import CompactStoreError, StoreError, StoreExistsError, StoreLockedError, StoreReadOnlyError
from kvmemory.store import shards
from kvmemory.store.layout import INDEX_DIR, arrays, block_digest, chunk_keys
from kvmemory.store.lock import writer_lock
from kvmemory.store.log import write_record, write_snapshot
from kvmemory.store.manifest import LOG_DIR, SNAPSHOT_EVERY, CommitRecord, DocEntry, Manifest, StateEntry
from kvmemory.store.seal import SEAL_BYTES
from kvmemory.store.s3 import CLAIMS_DIR

TRACE_ENV = "KVMEMORY_TRACE_COMMITS"      # a file to append "begin/end <time>" of each commit to
# crash trials (benchmarks/bench_crash.py): "K SECONDS" SIGKILLs this process SECONDS into its K-th
# commit (0-based), or at that commit's last point (its record durable, before it returns) if it
# ends sooner; never set outside those trials
KILL_ENV = "KVMEMORY_KILL_IN_COMMIT"


@dataclass
class NewBlock:
    """A block to append. kv: [layers, 2, kv_heads, n, head_dim] in storage dtype, n <= C."""

    block_id: bytes
    parent_row: int
    tokens: np.ndarray      # [n] int
    positions: np.ndarray   # [n] int
    kv: np.ndarray
    root: bytes = hashing.ROOT_PARENT   # parent id of a chain's first block (parent_row -1): a salted root
    error: tuple[float, float, float] | None = None   # a compact store's: the block's measured error
    owner: str | None = None            # an encrypted store seals it with this owner's key (None: the store's)


@dataclass
class Change:
    """What one commit adds or removes (returned by the `build` function given to commit)."""

    blocks: list[NewBlock] = field(default_factory=list)
    states: dict[str, StateEntry] = field(default_factory=dict)
    docs: dict[str, DocEntry] = field(default_factory=dict)
    removed_docs: tuple[str, ...] = ()
    removed_states: tuple[str, ...] = ()
    @property
    def empty(self) -> bool:
        return not (self.blocks or self.states or self.docs or self.removed_docs or self.removed_states)


class CommitMixin:
    """BlockStore's writes (kvmemory/store/blocks.py holds the state they use)."""

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

    def require_exact(self) -> None:
        """CompactStoreError unless this store holds exact KV: a compact store takes no new blocks."""
        if self.encoding.lossy:
            raise CompactStoreError(
                f"store {self.name} holds {self.manifest.encoding}-encoded (lossy) KV, written by `kvmemory "
                "compact` only: add to the exact store it was made from, and compact that again")

    def commit(self, build: Callable[["CommitMixin"], Change],
               after: Callable[[Manifest], None] | None = None) -> Manifest:
        """Run one write transaction under the writer lock.

        `build(store)` is called with the store refreshed to the newest commit; it returns a
        Change, its new blocks made
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
                    raise TypeError(f"a commit's build function returns a Change, got {type(ch).__name__}")
                m = self.manifest
                if ch.empty:
                    return m
                if ch.blocks:
                    self.require_exact()
                start = m.next_row
                if ch.blocks and not self.files.exclusive:
                    # no lock across machines: claim shards of our own (create-only), then move the
                    # rows build planned from next_row on to them
                    claimed = self._claim_rows(len(ch.blocks))
                    ch = relocate(ch, start, claimed)
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
                                           removed_states=list(ch.removed_states), time=time.time(),
                                           roots={str(start + i): b.root.hex() for i, b in enumerate(ch.blocks)
                                                  if b.root != hashing.ROOT_PARENT})
                        try:
                            write_record(self.files, rec)
                            break
                        except StoreExistsError:
                            if self.files.exclusive:
                                raise
                            # another machine committed first: take its commit, check that what ours
                            # names is still there, and try the next commit number
                            self.refresh()
                            self._check_refs(ch, start)
                except BaseException:
                    for k in keys:                    # rows no commit names: nothing may keep them
                        self.files.remove(k)
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
                   kv_of: Callable[[int], np.ndarray], root: bytes = hashing.ROOT_PARENT,
                   owner: str | None = None) -> tuple[list[NewBlock], list[int]]:
        """The one chain builder: blocks chain[i] (tokens[i*C:(i+1)*C] at positions start + i*C ..)
        that the store lacks become NewBlocks (kv_of(i): storage words), rows from next_row on.
        root: the parent id of chain[0] where it begins a chain (parent_row -1; a salted chain's root).
        owner: whose key seals the new blocks in an encrypted store.
        Returns (new blocks, the row of every block of the chain)."""
        if root != hashing.ROOT_PARENT and parent_row != -1:
            raise ValueError("only a chain's first block (parent_row -1) has a root")
        C = self.manifest.block_tokens
        new: list[NewBlock] = []
        rows: list[int] = []
        for i, bid in enumerate(chain):
            row = self.row_of(bid)
            if row is None:
                row = self.next_row + len(new)
                toks = np.asarray(tokens[i * C:(i + 1) * C])
                new.append(NewBlock(bid, parent_row, toks, np.arange(start + i * C, start + i * C + len(toks)),
                                    kv_of(i), root if parent_row == -1 else hashing.ROOT_PARENT, owner=owner))
            rows.append(row)
            parent_row = row
        return new, rows

    def _writable_arrays(self) -> dict[str, zarr.Array]:
        if self._writable is None:
            g = zarr.open_group(store=self.files.zarr_store("data", read_only=False), mode="r+", zarr_format=3)
            self._writable = {name: g[name] for name in arrays(self.manifest)}
        return self._writable

    def _append(self, start: int, blocks: list[NewBlock]) -> list[str]:
        """Write new rows [start, start + k) into new files; fsync them. Returns the files written."""
        arrs = self._writable_arrays()
        k = len(blocks)
        S, C = self.manifest.shard_blocks, self.manifest.block_tokens
        files = chunk_keys(start // S, (start + k - 1) // S, arrays(self.manifest))
        if self.files.exclusive:                     # (otherwise these shards are freshly claimed)
            for f in files:                          # leftovers of an interrupted commit: never merged
                self.files.remove(f)
        kv = np.zeros((k, *arrs["kv"].shape[1:]), dtype=arrs["kv"].dtype)
        tokens = np.full((k, C), -1, np.int32)
        positions = np.full((k, C), -1, np.int32)
        digests = np.zeros((k, hashing.ID_BYTES), np.uint8)
        errors = np.full((k, 3), np.nan, np.float32)
        seals = np.zeros((k, SEAL_BYTES), np.uint8)
        for i, b in enumerate(blocks):
            n = len(b.tokens)
            if b.kv.shape != (*kv.shape[1:4], n, kv.shape[5]) or b.kv.dtype != kv.dtype:
                raise StoreError(f"block {i}: kv {b.kv.shape} {b.kv.dtype} does not fit the store layout "
                                 f"{kv.shape[1:]} {kv.dtype}")
            kv[i, :, :, :, :n] = b.kv
            tokens[i, :n] = b.tokens
            positions[i, :n] = b.positions
            if self.sealer is not None:       # sealed by the owner's key; E1's digest is of the ciphertext
                seals[i] = self.sealer.seal_block(b.owner, b.block_id, kv[i], tokens[i])
            digests[i] = np.frombuffer(block_digest(kv[i], n), np.uint8)
            if b.error is not None:
                errors[i] = b.error
        sl = slice(start, start + k)
        try:
            with zarr.config.set({"array.write_empty_chunks": True}):   # an all-zero block is still a block
                if self._direct is not None and not self.files.remote and self.cache is None:
                    shards.write_shards(self._kv_dir, start, kv, S)    # raw local shards: the same bytes, directly
                else:
                    arrs["kv"][sl] = kv
                arrs["tokens"][sl] = tokens
                arrs["positions"][sl] = positions
                arrs["parent"][sl] = np.array([b.parent_row for b in blocks], np.int64)
                arrs["n_tokens"][sl] = np.array([len(b.tokens) for b in blocks], np.int32)
                arrs["block_id"][sl] = np.stack([np.frombuffer(b.block_id, np.uint8) for b in blocks])
                arrs["digest"][sl] = digests
                if "error" in arrs:
                    arrs["error"][sl] = errors
                if "seal" in arrs:
                    arrs["seal"][sl] = seals
            self.files.sync(files, "data")
        except Exception as e:
            for f in files:
                self.files.remove(f)
            if isinstance(e, OSError):
                why = "disk full" if e.errno in (errno.ENOSPC, errno.EDQUOT) else (e.strerror or str(e))
            elif not self.files.exclusive:          # the object store's client raises its own types
                why = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
            else:
                raise
            raise StoreError(f"store {self.name}: cannot write blocks: {why}; the store stays at commit "
                             f"{self.manifest.commit}") from None
        return files

    def clean_leftovers(self) -> int:
        """Remove what interrupted writes left (temp files, data files past the last commit), where
        the writer lock governs every writer (the files' clean_leftovers says what that is). Called
        under the writer lock on a writer's first commit. Returns the files removed."""
        removed = self.files.clean_leftovers(self.manifest.next_row // self.manifest.shard_blocks,
                                             arrays(self.manifest),
                                             ("data", LOG_DIR, INDEX_DIR))
        self._cleaned = True
        return removed


def relocate(ch: Change, planned: int, start: int) -> Change:
    """The same change with the rows of its new blocks moved from planned.. to start.."""
    if planned == start:
        return ch
    k = len(ch.blocks)

    def mv(r: int) -> int:
        return r - planned + start if planned <= r < planned + k else r
    blocks = [dataclasses.replace(b, parent_row=mv(b.parent_row)) for b in ch.blocks]
    states = {sid: dataclasses.replace(e, last_row=mv(e.last_row)) for sid, e in ch.states.items()}
    docs = {d: dataclasses.replace(e, rows=[mv(r) for r in e.rows]) for d, e in ch.docs.items()}
    return Change(blocks, states, docs, ch.removed_docs, ch.removed_states)


_commits_done = 0                         # this process's commits so far (for KILL_ENV)


def _trace(what: str) -> None:
    global _commits_done
    kill = os.environ.get(KILL_ENV)
    hit = False
    if kill:
        k, seconds = kill.split()
        hit = _commits_done == int(k)
        if hit and what == "end":             # the commit ended before the kill: it lands here, before
            time.sleep(3600)                  # the trace says "end"
    path = os.environ.get(TRACE_ENV)
    if path:
        with open(path, "a") as f:
            f.write(f"{what} {time.time():.6f}\n")
    if hit and what == "begin":
        threading.Thread(target=_kill_after, args=(float(seconds),), daemon=True).start()
    if what == "end":
        _commits_done += 1


def _kill_after(seconds: float) -> None:
    time.sleep(seconds)
    os.kill(os.getpid(), signal.SIGKILL)
