"""Pager: brings selected blocks to where attention runs, through the tiers.

    GPU block pool (when CUDA is present)  <-  host RAM (LRU)  <-  the store on disk (the truth)
    ... <- host RAM <- local disk cache (LRU, byte budget) <- object store (the truth), for a store on S3

`fetch(rows)` returns a pool tensor [k, L, 2, H, C, D] on the target device holding the rows
in the order asked, and what came from where. Misses are read from disk together, in one
concurrent request (digest-checked), not one by one.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from kvmemory import kv as kvops
from kvmemory.pager.lru import LRUTier
from kvmemory.store import BlockStore


@dataclass
class FetchStats:
    blocks: int = 0
    from_gpu: int = 0
    from_host: int = 0
    from_disk: int = 0             # read from the store (a local store; or the next two summed)
    from_disk_cache: int = 0       # store on an object store: blocks whose shard was on local disk
    from_object_store: int = 0     # store on an object store: blocks whose shard was fetched
    disk_bytes: int = 0
    host_bytes: int = 0
    disk_s: float = 0.0
    tiers: dict = field(default_factory=dict)


class Pager:
    def __init__(self, store: BlockStore, dtype: torch.dtype, host_budget_bytes: int = 2 << 30,
                 gpu_budget_bytes: int = 0, device: torch.device | str = "cpu") -> None:
        self.store = store
        self.dtype = dtype
        self.device = torch.device(device)
        self.host = LRUTier("host", host_budget_bytes)
        self.gpu = LRUTier("gpu", gpu_budget_bytes) if self.device.type == "cuda" else None

    def forget(self, rows) -> None:
        """Drop rows from every tier (after a document is removed)."""
        self.host.discard(rows)
        if self.gpu is not None:
            self.gpu.discard(rows)

    def fetch(self, rows: list[int], stacked: bool = True) -> tuple[torch.Tensor | list[torch.Tensor], FetchStats]:
        """The blocks of `rows` [k, L, 2, H, C, D], verified, through the tiers; stacked=False: a
        list of the k blocks as the tiers hold them (no copy of them all into one tensor)."""
        st = FetchStats(blocks=len(rows))
        got: dict[int, torch.Tensor] = {}
        if self.gpu is not None:
            for r in rows:
                v = self.gpu.get(r)
                if v is not None:
                    got[r] = v
                    st.from_gpu += 1
        need = [r for r in dict.fromkeys(rows) if r not in got]
        host_hits: dict[int, torch.Tensor] = {}
        for r in need:
            v = self.host.get(r)
            if v is not None:
                host_hits[r] = v
                st.from_host += 1
                st.host_bytes += v.numel() * v.element_size()
        misses = [r for r in need if r not in host_hits]
        if misses:
            t = time.perf_counter()
            cache = self.store.cache
            before = (cache.stats.hits, cache.stats.misses) if cache is not None else None
            blocks, _ = self.store.read_kv(misses)       # one concurrent, verified read
            st.disk_s = time.perf_counter() - t
            if cache is not None:
                st.from_disk_cache = cache.stats.hits - before[0]
                st.from_object_store = cache.stats.misses - before[1]
            st.from_disk = len(misses)
            st.disk_bytes = blocks.nbytes
            for i, r in enumerate(misses):
                # a copy of its own: a cached block must not keep the whole batch buffer alive
                v = kvops.from_storage(blocks[i], self.dtype).clone()
                if self.device.type == "cuda":
                    v = v.pin_memory()
                self.host.put(r, v, v.numel() * v.element_size())
                host_hits[r] = v
        for r in need:
            v = host_hits[r]
            if self.device.type == "cuda":
                v = v.to(self.device, non_blocking=True)
                self.gpu.put(r, v, v.numel() * v.element_size())
            got[r] = v
        pool = (torch.stack([got[r] for r in rows]) if rows else torch.empty(0)) if stacked else [got[r] for r in rows]
        st.tiers = {t.name: vars(t.stats) | {"hit_rate": t.stats.hit_rate, "used_bytes": t.used_bytes}
                    for t in (self.host, self.gpu) if t is not None}
        if self.store.cache is not None:
            c = self.store.cache
            st.tiers["disk_cache"] = vars(c.stats) | {"hit_rate": c.stats.hit_rate, "used_bytes": c.used_bytes,
                                                      "budget_bytes": c.budget_bytes}
        return pool, st
