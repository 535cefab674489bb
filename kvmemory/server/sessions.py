"""Chat sessions: session id -> the states of its turns (oldest first) and what its last turn
recalled, persisted in STORE/serve/sessions.json. A session's older turns, once the conversation
outgrows the window, are documents whose ids start with session_prefix(session id)."""

from __future__ import annotations

import time
from pathlib import Path

import xxhash

from kvmemory.chat_memory import user_key
from kvmemory.server.persist import JsonFile

SESSION_DOCS = "session:"          # doc ids of chat memory: session:<hash of session id>:<hash of the message>


def session_prefix(session_id: str) -> str:
    """Doc id prefix of a session's memory: its id hashed, so no session's prefix is another's."""
    return f"{SESSION_DOCS}{xxhash.xxh3_64_hexdigest(session_id.encode())}:"


class Sessions:
    def __init__(self, root: Path, seal=None) -> None:
        self.file = JsonFile(root / "sessions.json", seal)     # an encrypted store's: sealed by its key
        # an encrypted store's records keep no recalled text: the store's key seals this file, and a
        # user's words are only ever sealed by the user's own key (forgetting destroys it)
        self.keep_text = seal is None
        self.data: dict[str, dict] = self.file.load()

    def record(self, sid: str, state_ids: list[str], tokens: int, recalled: list[dict] | None = None,
               user: str | None = None) -> None:
        """One turn of session sid: the states it saved (its prompt, the conversation with the reply),
        and what was recalled (from its older turns, or with a user from the user's memory). A user's
        sessions are recorded under "<user key>/<session id>" and name their user."""
        with self.file.lock:
            s = self.data.setdefault(sid, {"id": sid.split("/", 1)[-1] if user else sid, "states": [], "turns": 0,
                                           "created": time.time()})
            if user is not None:
                s["user"], s["user_key"] = user, user_key(user)
            s["last_recall"] = [r if self.keep_text else {**r, "text": ""} for r in recalled or []]
            s["states"] += [x for x in state_ids if x not in s["states"]]
            s["tokens"] = tokens
            s["turns"] += 1
            s["updated"] = time.time()
            self.file.save(self.data)

    def add_state(self, sid: str, state_id: str) -> None:
        """A state a turn saved after it was recorded (a reply's deferred save); nothing for a session
        forgotten meanwhile."""
        with self.file.lock:
            s = self.data.get(sid)
            if s is None or state_id in s["states"]:
                return
            s["states"].append(state_id)
            s["updated"] = time.time()
            self.file.save(self.data)

    def of_user(self, user: str) -> dict[str, dict]:
        """The records of a user's sessions, by record key."""
        key = user_key(user)
        return {k: s for k, s in self.data.items() if s.get("user_key") == key}

    def forget(self, sid: str) -> dict | None:
        with self.file.lock:
            s = self.data.pop(sid, None)
            self.file.save(self.data)
            return s
