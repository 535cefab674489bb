"""Where a store is, decided in one place: a directory or s3://bucket/prefix, whether a store is
there, and the local directory that goes with it (the store itself, or the working directory of
a store on an object store: its disk cache tier and derived indexes)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvmemory.errors import InputError, StoreError
from kvmemory.store.files import LocalFiles, is_url, open_files
from kvmemory.store.layout import default_work_dir
from kvmemory.store.manifest import MANIFEST_NAME


@dataclass(frozen=True)
class Location:
    files: object            # LocalFiles or ObjectFiles
    root: Path               # the local directory
    name: str                # for messages: the path or the URL
    exists: bool             # a store's header is there

    @property
    def remote(self) -> bool:
        return bool(self.files.remote)


def locate(location, *, must_exist: bool, storage_options: dict | None = None, work_dir=None) -> Location:
    """The Location of `location`. StoreError if there is no store and must_exist, or if the place
    cannot hold one (a file; a non-empty directory without a store: never written into)."""
    if is_url(location):
        files = open_files(location, storage_options)    # typed errors for a bad URL
        root = Path(work_dir) if work_dir is not None else default_work_dir(files.describe())
        there = files.exists(MANIFEST_NAME)
    else:
        if storage_options is not None or work_dir is not None:
            raise InputError("storage_options and work_dir apply only to an s3:// store")
        root = Path(location)
        files = LocalFiles(root)
        if root.exists() and not root.is_dir():
            raise StoreError(f"{root} is a file, not a store directory")
        there = (root / MANIFEST_NAME).is_file()
        if not there and not must_exist and root.exists() and any(root.iterdir()):
            raise StoreError(f"{root} exists and is not a kvmemory store (no {MANIFEST_NAME}); "
                             "refusing to write into it")
    if must_exist and not there:
        raise StoreError(f"no kvmemory store at {files.describe()} (no {MANIFEST_NAME})")
    return Location(files, root, files.describe(), there)
