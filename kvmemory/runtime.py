"""The runtime: what the rooms below Memory work with, built once by Memory and handed down.

    Runtime      frozen: model, tokenizer, geometry, KV dtype, fingerprint, the store's handle (store,
                 pager), RoPE frequencies, the States room, the lock, the deposit's pause point
    StoreHandle  the open store and its pager (created on first use); closed with the Memory
    Deferral     which thread's deposits give way to other work, and for how long

Documents, Library, ChatMemory, ask, rerank, retrieve, graft, compact and audit take a Runtime (never
the Memory facade): every attribute they use is named here, typed, and visible to a reader and a
type checker.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from kvmemory.config import RuntimeConfig
from kvmemory.decode import eos_ids
from kvmemory.errors import StoreError
from kvmemory.model.fingerprint import KVGeometry
from kvmemory.states import State, States
from kvmemory.batching import let_go
from kvmemory.threads import ModelLock

if TYPE_CHECKING:
    from kvmemory.pager import Pager
    from kvmemory.store import BlockStore

MAKE_WAY_S = 2.0          # the longest a deposit waits between two blocks for other work (Deferral)


class StoreHandle:
    """The open store of a Memory, and the tiered pager over it (created on first use)."""

    def __init__(self, store: BlockStore, location: str, kv_dtype: torch.dtype, config: RuntimeConfig,
                 device: torch.device) -> None:
        self.store: BlockStore | None = store
        self.location = location
        self._pager: Pager | None = None
        self._pager_args = (kv_dtype, config.host_cache_bytes, config.gpu_cache_bytes, device)

    def require(self) -> BlockStore:
        """The open BlockStore; StoreError once closed."""
        if self.store is None:
            raise StoreError(f"memory {self.location} is closed")
        return self.store

    @property
    def pager(self) -> Pager:
        if self._pager is None:
            from kvmemory.pager import Pager
            self._pager = Pager(self.require(), *self._pager_args)
        return self._pager

    def forget_blocks(self, rows) -> None:
        """Drop rows from the pager's caches (after their document was removed)."""
        if self._pager is not None:
            self._pager.forget(rows)

    @property
    def pager_if_open(self) -> Pager | None:
        """The pager if one was made (its tiers' figures), without making one."""
        return self._pager

    def drop_pager(self) -> None:
        """Start the pager afresh, its tiers empty (a cold read: benchmarks)."""
        self._pager = None

    def close(self) -> None:
        self.store, self._pager = None, None


class Deferral:
    """Which thread's deposits give way between blocks, and to what (busy() -> bool: other work waits
    for the model). Memory.defer_to sets it; a deposit calls make_way between blocks."""

    def __init__(self, lock: ModelLock) -> None:
        self.lock = lock
        self.busy: Callable[[], bool] | None = None
        self.thread: int | None = None

    def set(self, busy: Callable[[], bool] | None) -> None:
        self.busy, self.thread = busy, (threading.get_ident() if busy is not None else None)

    def make_way(self) -> float:
        """A deposit's pause point: while busy() (at most MAKE_WAY_S) the model is let go. Returns the
        seconds waited (0 on any other thread, or when nothing waits)."""
        busy = self.busy
        if busy is None or self.thread != threading.get_ident() or not busy() or not self.lock._is_owned():
            return 0.0
        t0 = time.monotonic()
        with let_go(self.lock):
            while busy() and time.monotonic() - t0 < MAKE_WAY_S:
                time.sleep(0.005)
        return time.monotonic() - t0


@dataclass(frozen=True)
class Runtime:
    """What the rooms below Memory use. model/tokenizer: the transformers objects; geometry: the KV
    layout ([layers, 2, kv_heads, tokens, head_dim] in kv_dtype); fingerprint: the store's (the
    model's, or derived for a store with its own prefill size)."""

    model: Any
    tokenizer: Any
    geometry: KVGeometry
    kv_dtype: torch.dtype
    fingerprint: str
    location: str                  # the store's name as given (a path or an s3:// URL)
    path: Path                     # its local directory (for a remote store: the working directory)
    config: RuntimeConfig
    lock: ModelLock
    handle: StoreHandle
    states: States
    deferral: Deferral = field(repr=False, default=None)    # type: ignore[assignment]

    def __post_init__(self) -> None:
        if self.deferral is None:
            object.__setattr__(self, "deferral", Deferral(self.lock))

    def store(self) -> BlockStore:
        """The open BlockStore (StoreError once the Memory is closed)."""
        return self.handle.require()

    @property
    def pager(self) -> Pager:
        return self.handle.pager

    @functools.cached_property
    def freqs(self) -> torch.Tensor:
        """RoPE inverse frequencies [R / 2] (or per layer [L, R / 2]) float32 on the CPU (kvmemory.rope.inv_freq)."""
        from kvmemory.rope import inv_freq
        return inv_freq(self.model)

    @property
    def eos_ids(self) -> set[int]:
        return eos_ids(self.tokenizer, self.model)

    @property
    def block_tokens(self) -> int:
        return self.store().manifest.block_tokens

    @property
    def prefill_tokens(self) -> int:
        return self.store().manifest.chunk_tokens

    # the States room under the model's lock (re-entrant): a room may save or load on any thread
    def tokenize(self, text_or_ids) -> list[int]:
        return self.states.tokenize(text_or_ids)

    def save(self, text_or_ids, label: str = "", owner: str | None = None) -> State:
        with self.lock:
            return self.states.save(text_or_ids, label, owner)

    def load(self, state_id: str) -> State:
        with self.lock:
            return self.states.load(state_id)

    def make_way(self) -> float:
        return self.deferral.make_way()

    def forget_blocks(self, rows) -> None:
        self.handle.forget_blocks(rows)
