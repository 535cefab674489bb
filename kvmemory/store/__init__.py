"""The store, bottom up (each module imports only those above it in this list):

    durable.py    write-new-file, atomic replace, fsync of files and directories
    files.py      a store's files: LocalFiles (a directory); s3.py: ObjectFiles (an S3 prefix)
    manifest.py   the in-memory view: header + replayed commit records (pure)
    log.py        the commit log read and written through a files object
    layout.py     the Zarr arrays, their chunk files, block digests
    lock.py, shards.py, cache.py   the writer lock, kvmemory's shard format, the disk cache tier
    commit.py, gc.py, blocks.py    BlockStore: writes, gc, and opening / reading / verifying
    info.py       what `kvmemory info` prints
"""

from kvmemory.store.blocks import BlockStore
from kvmemory.store.commit import Change, NewBlock
from kvmemory.store.encoding import STORAGE_DTYPE
from kvmemory.store.layout import block_digest

__all__ = ["BlockStore", "Change", "NewBlock", "STORAGE_DTYPE", "block_digest"]
