"""Durable writes on a local disk, the bottom of the store: a new file written whole or not at all
(temp file, every byte checked, fsync, link into place, fsync of its directory), a file replaced
atomically, and fsync of files and the directories that name them. No other kvmemory import."""

from __future__ import annotations

import errno
import os
import uuid
from pathlib import Path

from kvmemory.errors import StoreError, StoreExistsError

TEMP_SUFFIX = ".tmp"


def _write_temp(path: Path, data: bytes) -> Path:
    """data in a new temp file beside path, fsynced; its name."""
    tmp = path.parent / f".{path.name}.{uuid.uuid4().hex[:12]}{TEMP_SUFFIX}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        try:
            view = memoryview(data)
            while view:
                n = os.write(fd, view)
                if n <= 0:
                    raise OSError(errno.EIO, "write returned 0 bytes")
                view = view[n:]
            os.fsync(fd)
        finally:
            os.close(fd)
    except BaseException:
        unlink(tmp)                  # a short write or a full disk leaves nothing behind
        raise
    return tmp


def _why(e: OSError) -> str:
    return "disk full" if e.errno in (errno.ENOSPC, errno.EDQUOT) else (e.strerror or str(e))


def write_new_file(path: Path, data: bytes) -> None:
    """Write `data` to `path`, which must not exist, durably. StoreExistsError if it exists,
    StoreError (nothing left behind) on any other failure."""
    tmp = None
    try:
        tmp = _write_temp(path, data)
        os.link(tmp, path)           # never over an existing file: EEXIST instead
        fsync_dir(path.parent)
    except FileExistsError:
        raise StoreExistsError(f"cannot write {path}: it already exists") from None
    except OSError as e:
        raise StoreError(f"cannot write {path}: {_why(e)}") from None
    finally:
        if tmp is not None:
            unlink(tmp)


def replace_file(path: Path, data: bytes) -> None:
    """Replace `path` with `data` atomically (a reader sees the old or the new bytes, never a mix)."""
    tmp = None
    try:
        tmp = _write_temp(path, data)
        os.replace(tmp, path)
        tmp = None
        fsync_dir(path.parent)
    except OSError as e:
        raise StoreError(f"cannot write {path}: {_why(e)}") from None
    finally:
        if tmp is not None:
            unlink(tmp)


def fsync_path(path: Path) -> None:
    """fsync a file or a directory (a directory: so the names in it are durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


fsync_dir = fsync_path


def fsync_files(files: list[Path], top: Path) -> None:
    """fsync exactly these files (those that exist) and every directory between them and `top`,
    deepest first, so their names are durable too."""
    dirs: set[Path] = set()
    for f in files:
        if f.exists():
            fsync_path(f)
        d = f.parent
        while d != top and top in d.parents:
            dirs.add(d)
            d = d.parent
    for d in sorted(dirs, key=lambda p: -len(p.parts)):
        if d.exists():
            fsync_dir(d)


def fsync_tree(top: Path) -> None:
    for dirpath, _, files in os.walk(top):
        for f in files:
            fsync_path(Path(dirpath) / f)
        fsync_dir(Path(dirpath))


def unlink(p: Path) -> int:
    """Remove a file if it exists; 1 if it did."""
    try:
        os.unlink(p)
        return 1
    except FileNotFoundError:
        return 0
