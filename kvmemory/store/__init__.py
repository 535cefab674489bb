"""The on-disk store: Zarr arrays of blocks, a manifest commit point, a writer lock."""

from kvmemory.store.zarr_store import STORAGE_DTYPE, BlockStore, NewBlock, block_digest

__all__ = ["BlockStore", "NewBlock", "STORAGE_DTYPE", "block_digest"]
