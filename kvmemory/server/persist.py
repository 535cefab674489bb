"""Small JSON documents the server keeps beside the store (jobs, sessions), replaced atomically."""

from __future__ import annotations

import json
import threading
from pathlib import Path

from kvmemory.errors import StoreError
from kvmemory.store.durable import replace_file

SERVE_DIR = "serve"          # STORE/serve/: jobs.json, sessions.json, uploads/


class JsonFile:
    """A JSON document on disk, replaced atomically (temp file, fsync, rename)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.lock = threading.Lock()

    def load(self) -> dict:
        try:
            return json.loads(self.path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return {}
        except (ValueError, UnicodeDecodeError) as e:
            raise StoreError(f"{self.path} is damaged: {e}") from None

    def save(self, data: dict) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        replace_file(self.path, json.dumps(data).encode("utf-8"))
