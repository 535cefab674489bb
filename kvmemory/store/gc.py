"""gc: reclaim the disk space of blocks that no state or document reaches. A commit first records
the rows as freed (no reader takes them as valid from then on), then each shard holding freed rows
is rewritten without them or removed. Local stores only (object-store shards are immutable)."""

from __future__ import annotations

import time
from dataclasses import dataclass

from kvmemory.errors import StoreError
from kvmemory.store import shards
from kvmemory.store.durable import unlink
from kvmemory.store.layout import arrays, chunk_keys
from kvmemory.store.log import write_record
from kvmemory.store.manifest import CommitRecord


@dataclass(frozen=True)
class GcReport:
    blocks_freed: int
    bytes_freed: int
    files_removed: int
    files_rewritten: int


class GcMixin:
    """BlockStore's gc (kvmemory/store/blocks.py holds the state it uses)."""

    def gc(self, grace_s: float = 3600.0) -> GcReport:
        """Reclaim blocks no state or document reaches (through parent pointers), except blocks
        committed in the last `grace_s` seconds (a document being added commits its blocks before
        the document itself: they are not garbage yet).

        First a commit records the rows as freed (from then on no reader takes them as valid: a
        read of a freed row raises), then each shard holding freed rows is rewritten without them
        (temp file, fsync, rename: the live rows are in the old or the new file, never in neither)
        or removed. A crash mid-way leaves bytes to reclaim, which the next gc finds.
        """
        if not self.files.exclusive:
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
            files = [self.root / k for k in chunk_keys(shard, shard, arrays(self.manifest))]
            kv_file = files[0]
            if not kv_file.exists():
                continue
            if not keep:
                for f in files:
                    if f.exists():
                        freed += f.stat().st_size
                        removed += unlink(f)
                continue
            got = shards.rewrite_shard(kv_file, set(keep), S)
            if got:
                freed += got
                rewritten += 1
        return GcReport(blocks_freed, freed, removed, rewritten)
