"""Small JSON documents the server keeps beside the store (jobs, sessions), replaced atomically."""

from __future__ import annotations

import json
import threading
from pathlib import Path

from kvmemory.errors import StoreError
from kvmemory.store.durable import replace_file

SERVE_DIR = "serve"          # STORE/serve/: jobs.json, sessions.json, uploads/


class JsonFile:
    """A JSON document on disk, replaced atomically (temp file, fsync, rename). seal: an encrypted
    store's (kvmemory/store/seal.py FileSeal of the store's key): the file's bytes sealed."""

    def __init__(self, path: Path, seal=None) -> None:
        self.path = path
        self.seal = seal
        self.lock = threading.Lock()

    def load(self) -> dict:
        try:
            raw = self.path.read_bytes()
            if self.seal is not None:
                raw = self.seal.load(raw, self.path.name, str(self.path))
            return json.loads(raw.decode("utf-8"))
        except FileNotFoundError:
            return {}
        except (ValueError, UnicodeDecodeError) as e:
            raise StoreError(f"{self.path} is damaged: {e}") from None

    def save(self, data: dict) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        raw = json.dumps(data).encode("utf-8")
        replace_file(self.path, raw if self.seal is None else self.seal.dump(raw, self.path.name))


def store_seal(mem):
    """How the server's files beside an encrypted store are sealed (by the store's own key); None: plain."""
    from kvmemory.store.seal import FileSeal
    sealer = mem.store.sealer if mem.store is not None else None
    return None if sealer is None else FileSeal(sealer, None)
