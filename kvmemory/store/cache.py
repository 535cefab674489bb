"""The local-disk tier of a store on an object store: read-through copies of kv shard objects.

A committed kv shard object is immutable (a commit writes only shards of rows it claimed, and
no commit rewrites another's), so a local copy keyed by the object's name never goes stale.
Misses download whole shard objects, in parallel, to `dir` (temp file + rename: a reader sees
a whole file or none); reads then go through the same pread path as a local store, and every
block is digest-checked as always, so a damaged copy (or a damaged object) raises, and the
store drops the copy and fetches once more before it reports the corruption.

The tier keeps within `budget_bytes` by evicting the least recently used copies after each
read (never the ones the read in progress uses). Several processes may share one directory:
a copy another process evicted is simply fetched again.
"""

from __future__ import annotations

import os
import threading
import uuid
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

_FETCHERS = ThreadPoolExecutor(max_workers=8, thread_name_prefix="kvmemory-fetch")


@dataclass
class TierStats:
    """Counts in blocks (what a read asked for) and bytes (what crossed the network)."""

    hits: int = 0             # blocks whose shard was already on local disk
    misses: int = 0           # blocks whose shard was fetched from the object store
    shards_fetched: int = 0
    bytes_fetched: int = 0
    evictions: int = 0

    @property
    def hit_rate(self) -> float:
        n = self.hits + self.misses
        return self.hits / n if n else 0.0


class ShardCache:
    def __init__(self, files, root: Path, budget_bytes: int) -> None:
        self.files = files
        self.root = Path(root)
        self.budget_bytes = int(budget_bytes)
        self.stats = TierStats()
        self._lock = threading.Lock()
        self._lru: OrderedDict[str, int] = OrderedDict()     # key -> bytes, oldest first
        for dirpath, _, names in os.walk(self.root):
            for n in names:
                if n.endswith(".part"):
                    continue
                p = Path(dirpath) / n
                try:
                    self._lru[p.relative_to(self.root).as_posix()] = p.stat().st_size
                except FileNotFoundError:
                    pass

    @property
    def used_bytes(self) -> int:
        with self._lock:
            return sum(self._lru.values())

    def path(self, key: str) -> Path:
        return self.root / key

    def ensure(self, keys: dict[str, int]) -> None:
        """Make local copies of these objects (key -> blocks wanted from it), fetching the missing ones."""
        todo = []
        with self._lock:
            for k, blocks in keys.items():
                if k in self._lru and self.path(k).is_file():
                    self._lru.move_to_end(k)
                    self.stats.hits += blocks
                else:
                    self._lru.pop(k, None)
                    todo.append(k)
                    self.stats.misses += blocks
        for k, n in zip(todo, [j.result() for j in [_FETCHERS.submit(self._fetch, k) for k in todo]]):
            with self._lock:
                self._lru[k] = n
                self.stats.shards_fetched += 1
                self.stats.bytes_fetched += n

    def _fetch(self, key: str) -> int:
        data = self.files.read(key)
        p = self.path(key)
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_name(f".{p.name}.{uuid.uuid4().hex[:8]}.part")
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, p)
        return len(data)

    def drop(self, keys) -> None:
        """Forget local copies (a damaged copy: the next read fetches it again)."""
        with self._lock:
            for k in keys:
                self._lru.pop(k, None)
                try:
                    os.unlink(self.path(k))
                except FileNotFoundError:
                    pass

    def trim(self, keep=()) -> None:
        """Evict least recently used copies until within the byte budget (never those in `keep`)."""
        keep = set(keep)
        with self._lock:
            total = sum(self._lru.values())
            for k in list(self._lru):
                if total <= self.budget_bytes:
                    break
                if k in keep:
                    continue
                total -= self._lru.pop(k)
                self.stats.evictions += 1
                try:
                    os.unlink(self.path(k))
                except FileNotFoundError:
                    pass
