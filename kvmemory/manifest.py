"""The manifest: the commit point of a store. Pure: no torch, no zarr.

Data arrays are append-only and may hold rows past the committed count after a crash;
the manifest says how many rows are real. It is written last, atomically (temp file,
fsync, rename, fsync of the directory), so a crash leaves the previous commit whole.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kvmemory.errors import StoreCorruptError

FORMAT = "kvmemory-store"
FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"


@dataclass
class StateEntry:
    """A committed state: the chain ending at block row `last_row`."""

    last_row: int
    n_tokens: int
    label: str = ""
    created: float = 0.0


@dataclass
class DocEntry:
    """A deposited document: its content blocks in document order (prelude blocks excluded)."""

    rows: list[int]
    n_tokens: int
    segments: int
    source: str = ""
    created: float = 0.0


@dataclass
class Manifest:
    fingerprint: str
    model: dict                    # name, layers, kv_heads, head_dim, dtype, max_positions, rope
    block_tokens: int
    shard_blocks: int
    codec: str
    kv_dtype: str                  # torch dtype name of the KV ("float32", "bfloat16", ...)
    n_blocks: int = 0              # committed rows in every data array
    commit: int = 0
    states: dict[str, StateEntry] = field(default_factory=dict)
    docs: dict[str, DocEntry] = field(default_factory=dict)
    format: str = FORMAT
    version: int = FORMAT_VERSION

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str, where: str = "manifest") -> "Manifest":
        try:
            raw = json.loads(text)
            if raw.get("format") != FORMAT:
                raise StoreCorruptError(f"{where} is not a kvmemory manifest (format={raw.get('format')!r})")
            if raw.get("version") != FORMAT_VERSION:
                raise StoreCorruptError(
                    f"{where} has format version {raw.get('version')}, this kvmemory reads {FORMAT_VERSION}")
            raw["states"] = {k: StateEntry(**v) for k, v in raw["states"].items()}
            raw["docs"] = {k: DocEntry(**v) for k, v in raw.get("docs", {}).items()}
            m = cls(**raw)
        except StoreCorruptError:
            raise
        except (ValueError, TypeError, KeyError, AttributeError) as e:
            raise StoreCorruptError(f"{where} cannot be decoded: {e}") from None
        if m.n_blocks < 0 or any(not (0 <= s.last_row < m.n_blocks) for s in m.states.values()) \
                or any(not (0 <= r < m.n_blocks) for d in m.docs.values() for r in d.rows):
            raise StoreCorruptError(f"{where} is inconsistent: a state or document points past n_blocks={m.n_blocks}")
        return m


def read_manifest(root: Path) -> Manifest:
    path = root / MANIFEST_NAME
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise StoreCorruptError(f"{path} is not UTF-8: {e}") from None
    return Manifest.from_json(text, where=str(path))


def write_manifest(root: Path, manifest: Manifest) -> None:
    """Atomically replace root/manifest.json; durable once this returns."""
    path = root / MANIFEST_NAME
    tmp = root / f".{MANIFEST_NAME}.{os.getpid()}.tmp"
    data = manifest.to_json().encode("utf-8")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    fsync_dir(root)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
