"""Where a store's files live, behind one small interface: a local directory (LocalFiles, here) or a
prefix on an S3-compatible object store (ObjectFiles, kvmemory/store/s3.py).

Everything the commit protocol needs is a few operations on named files: read, create (never
over an existing name: the commit point), list, delete; and what differs between the backends
is said here too, not in the block store: whether one lock orders every writer (`exclusive`),
how written data becomes durable (`sync`), best-effort removal, and the bytes a store takes.

The block arrays are Zarr v3 either way: `zarr_store()` gives zarr's `LocalStore` or its
`ObjectStore` over the same client, so the data layout is the same on disk and in a bucket.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

from kvmemory.errors import InputError
from kvmemory.store.durable import TEMP_SUFFIX, fsync_files, unlink, write_new_file

_SCHEMES = ("s3",)


def is_url(location) -> bool:
    """True for an object-store location (s3://bucket/prefix), False for a local path."""
    return isinstance(location, str) and re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*://", location) is not None


class LocalFiles:
    """A store's files in a local directory: durable POSIX writes, one writer lock for all writers."""

    remote = False
    exclusive = True               # the store's writer lock orders every writer

    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    def describe(self) -> str:
        return str(self.root)

    def read(self, key: str) -> bytes:
        return (self.root / key).read_bytes()

    def create(self, key: str, data: bytes) -> None:
        """Write a new file durably; StoreExistsError if the name exists (nothing is overwritten)."""
        path = self.root / key
        path.parent.mkdir(parents=True, exist_ok=True)
        write_new_file(path, data)

    def exists(self, key: str) -> bool:
        return (self.root / key).is_file()

    def list(self, prefix: str, after: str | None = None) -> list[str]:
        """Names of the files directly in folder `prefix` (after the key `after`, if given)."""
        d = self.root / prefix
        names = sorted(os.listdir(d)) if d.is_dir() else []
        if after is not None:
            names = [n for n in names if f"{prefix.rstrip('/')}/{n}" > after]
        return names

    def delete(self, key: str) -> None:
        unlink(self.root / key)

    def remove(self, key: str) -> int:
        """Best-effort removal of a data file no commit names; 1 if one was removed."""
        return unlink(self.root / key)

    def sync(self, keys: list[str], top: str) -> None:
        """Make the files written under `top` durable: fsync them and the directories naming them."""
        fsync_files([self.root / k for k in keys], self.root / top)

    def clean_leftovers(self, first_shard: int, arrays, dirs) -> int:
        """Remove what interrupted writes left: temp files in the root and `dirs`, and the chunk files
        of `arrays` from shard `first_shard` on (past the last commit). Only for folders the writer
        lock governs (the root, data/, log/, index/; not e.g. a server's serve/ folder). Returns the
        files removed."""
        removed = 0
        for top in dirs:
            for dirpath, _, names in os.walk(self.root / top):
                for f in names:
                    if f.endswith(".partial") or (f.startswith(".") and f.endswith(TEMP_SUFFIX)):
                        removed += unlink(Path(dirpath) / f)
        for f in os.listdir(self.root):
            if f.startswith(".") and f.endswith(TEMP_SUFFIX):
                removed += unlink(self.root / f)
        for name in arrays:
            cdir = self.root / "data" / name / "c"
            if not cdir.is_dir():
                continue
            for entry in os.listdir(cdir):
                if entry.isdigit() and int(entry) >= first_shard:
                    p = cdir / entry
                    if p.is_dir():
                        shutil.rmtree(p, ignore_errors=True)
                    else:
                        unlink(p)
                    removed += 1
        return removed

    def total_bytes(self) -> int:
        """Bytes of the store's committed files (temp files of interrupted writes not counted)."""
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

    def zarr_store(self, sub: str, read_only: bool):
        from zarr.storage import LocalStore

        return LocalStore(self.root / sub, read_only=read_only)


def open_files(location, storage_options: dict | None = None):
    """LocalFiles for a path, ObjectFiles for an s3:// URL."""
    if is_url(location):
        scheme = str(location).split("://", 1)[0].lower()
        if scheme not in _SCHEMES:
            raise InputError(f"{location!r}: unsupported scheme {scheme!r} (kvmemory stores live in a directory "
                             "or at s3://bucket/prefix)")
        from kvmemory.store.s3 import ObjectFiles     # obstore only when a store is on S3

        return ObjectFiles(str(location), storage_options)
    if storage_options:
        raise InputError("storage_options apply only to an s3:// location")
    return LocalFiles(Path(location))
