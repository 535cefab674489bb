"""The commit log of a store, read and written through its files object (kvmemory/store/files.py: a
local directory or an object-store prefix; the names are the same either way):

    manifest.json              the header, created once
    log/00000001.json ...      one record per commit, create-only: the commit point
    log/snapshot-00000064.json the whole view every SNAPSHOT_EVERY commits

Opening reads the header, the newest snapshot and the records after it."""

from __future__ import annotations

import re

from kvmemory.errors import StoreCorruptError
from kvmemory.store.manifest import LOG_DIR, MANIFEST_NAME, CommitRecord, Manifest

_SNAPSHOT = re.compile(r"^snapshot-(\d{8,})\.json$")


def record_key(commit: int) -> str:
    return f"{LOG_DIR}/{commit:08d}.json"


def snapshot_key(commit: int) -> str:
    return f"{LOG_DIR}/snapshot-{commit:08d}.json"


def _read_text(files, key: str) -> str:
    """A log file's text; FileNotFoundError if absent, StoreCorruptError if not UTF-8."""
    try:
        return files.read(key).decode("utf-8")
    except UnicodeDecodeError as e:
        raise StoreCorruptError(f"{files.describe()}/{key} is not UTF-8: {e}") from None


def read_manifest(f) -> Manifest:
    """The store's view at its newest commit: the header, the newest snapshot, the records after it."""
    where = f"{f.describe()}/{MANIFEST_NAME}"
    m = Manifest.from_header(_read_text(f, MANIFEST_NAME), where=where)
    snaps = sorted(int(x.group(1)) for x in map(_SNAPSHOT.match, f.list(LOG_DIR)) if x)
    if snaps:
        key = snapshot_key(snaps[-1])
        m.load_snapshot(_read_text(f, key), f"{f.describe()}/{key}")
    read_new_records(f, m)
    return m


def read_new_records(f, m: Manifest) -> list[CommitRecord]:
    """Apply the records after m.commit (in place) and return them. One read when nothing changed."""
    applied = []
    while True:
        key = record_key(m.commit + 1)
        try:
            text = _read_text(f, key)
        except FileNotFoundError:
            return applied
        where = f"{f.describe()}/{key}"
        rec = CommitRecord.from_json(text, where)
        m.apply(rec, where)
        applied.append(rec)


def write_header(files, m: Manifest) -> None:
    files.create(MANIFEST_NAME, m.header_json().encode("utf-8"))


def write_record(files, rec: CommitRecord) -> None:
    """The commit point: create-only, so of two writers racing for one commit number exactly one
    lands (StoreExistsError for the other)."""
    files.create(record_key(rec.commit), rec.to_json().encode("utf-8"))


def write_snapshot(files, m: Manifest) -> None:
    files.create(snapshot_key(m.commit), m.snapshot_json().encode("utf-8"))
