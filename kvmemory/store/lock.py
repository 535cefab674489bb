"""Writer lock: one committing writer per store, across processes (fcntl.flock)."""

from __future__ import annotations

import errno
import fcntl
import os
import time
from contextlib import contextmanager
from pathlib import Path

from kvmemory.errors import StoreLockedError, StoreReadOnlyError

LOCK_NAME = ".lock"


@contextmanager
def writer_lock(root: Path, timeout_s: float):
    """Hold the store's writer lock; wait up to timeout_s for another writer, then raise."""
    path = root / LOCK_NAME
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        if e.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
            raise StoreReadOnlyError(f"cannot write to store {root}: {e.strerror}") from None
        raise
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise StoreLockedError(
                        f"store {root} is locked by another writer; waited {timeout_s:g} s "
                        "(raise KVMEMORY_LOCK_TIMEOUT to wait longer)") from None
                time.sleep(0.05)
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)
