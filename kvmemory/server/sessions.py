"""Chat sessions: session id -> the states of its turns (oldest first) and what its last turn
recalled, persisted in STORE/serve/sessions.json. A session's older turns, once the conversation
outgrows the window, are documents whose ids start with session_prefix(session id)."""

from __future__ import annotations

import time
from pathlib import Path

import xxhash

from kvmemory.server.persist import JsonFile

SESSION_DOCS = "session:"          # doc ids of chat memory: session:<hash of session id>:<hash of the message>


def session_prefix(session_id: str) -> str:
    """Doc id prefix of a session's memory: its id hashed, so no session's prefix is another's."""
    return f"{SESSION_DOCS}{xxhash.xxh3_64_hexdigest(session_id.encode())}:"


class Sessions:
    def __init__(self, root: Path) -> None:
        self.file = JsonFile(root / "sessions.json")
        self.data: dict[str, dict] = self.file.load()

    def record(self, sid: str, state_ids: list[str], tokens: int, recalled: list[dict] | None = None) -> None:
        """One turn of session sid: the states it saved (its prompt, the conversation with the reply),
        and what was recalled from its older turns (when the conversation outgrew the window)."""
        with self.file.lock:
            s = self.data.setdefault(sid, {"id": sid, "states": [], "turns": 0, "created": time.time()})
            s["last_recall"] = recalled or []
            s["states"] += [x for x in state_ids if x not in s["states"]]
            s["tokens"] = tokens
            s["turns"] += 1
            s["updated"] = time.time()
            self.file.save(self.data)

    def forget(self, sid: str) -> dict | None:
        with self.file.lock:
            s = self.data.pop(sid, None)
            self.file.save(self.data)
            return s
