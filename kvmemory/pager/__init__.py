"""The tiered pager: GPU block pool <- host RAM <- the store on disk."""

from kvmemory.pager.lru import LRUTier
from kvmemory.pager.pager import Pager

__all__ = ["LRUTier", "Pager"]
