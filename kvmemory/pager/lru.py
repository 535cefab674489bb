"""A byte-budgeted LRU cache tier with hit/miss counters. Pure: no torch."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass
class TierStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    bytes_in: int = 0        # bytes put into this tier
    bytes_served: int = 0    # bytes returned on hits

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0


class LRUTier:
    """Holds values up to `budget_bytes`; the least recently used go first."""

    def __init__(self, name: str, budget_bytes: int) -> None:
        if budget_bytes < 0:
            raise ValueError(f"budget_bytes must be >= 0, got {budget_bytes}")
        self.name = name
        self.budget_bytes = budget_bytes
        self.used_bytes = 0
        self.stats = TierStats()
        self._items: OrderedDict = OrderedDict()     # key -> (value, nbytes)

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, key) -> bool:
        return key in self._items

    def get(self, key):
        item = self._items.get(key)
        if item is None:
            self.stats.misses += 1
            return None
        self._items.move_to_end(key)
        self.stats.hits += 1
        self.stats.bytes_served += item[1]
        return item[0]

    def put(self, key, value, nbytes: int) -> None:
        if nbytes > self.budget_bytes:
            return                                   # larger than the tier: never cached
        if key in self._items:
            self.used_bytes -= self._items.pop(key)[1]
        self._items[key] = (value, nbytes)
        self.used_bytes += nbytes
        self.stats.bytes_in += nbytes
        self._evict()

    def set_budget(self, budget_bytes: int) -> None:
        """Change the budget; evicts the least recently used down to it at once."""
        if budget_bytes < 0:
            raise ValueError(f"budget_bytes must be >= 0, got {budget_bytes}")
        self.budget_bytes = budget_bytes
        self._evict()

    def _evict(self) -> None:
        while self.used_bytes > self.budget_bytes:
            _, (_, nb) = self._items.popitem(last=False)
            self.used_bytes -= nb
            self.stats.evictions += 1

    def discard(self, keys) -> None:
        for k in keys:
            item = self._items.pop(k, None)
            if item is not None:
                self.used_bytes -= item[1]
