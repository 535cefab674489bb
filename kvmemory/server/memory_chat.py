"""A chat request with a user: the user's memory (kvmemory.chat_memory) recalled into the window as
KV, the exchange remembered after the reply.

    window = [the conversation before the new message: the session's stored state, exact]
             [the user's most relevant earlier turns, from other sessions: grafted, re-rotated]
             [the new message and the assistant's opening: prefilled]

Layout chosen so the session prefix restores bit-exactly (as without memory) and the recall sits
next to the question. A conversation longer than the window keeps its system message and latest
turns; its older exchanges are in the user's memory (remembered turn by turn) and recalled the
same way, as KV, not quoted. The user's states are salted chains (their ids keyed by the user):
another user's equal prefix is other blocks, recomputed and written again, never a cache hit (nor a
faster first token or a shorter commit).

A session without a user that outgrows the window takes the same path with a memory of its own
(session_memory: keyed by the session, no user's): its older exchanges remembered, and the most
relevant of them recalled as KV; nothing of any other session is recalled."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvmemory.chat_memory import ChatMemory, user_key, window
from kvmemory.chat_memory.memory import session_memory_key

RECALL_SESSION = "default"         # the session of a user's request that names none


@dataclass
class Prepared:
    """A request's window, ready to decode from."""
    ids: list[int]                 # the prompt's tokens (saved afterwards, with the reply)
    cache: object                  # the KV the reply attends to
    logits: torch.Tensor | None    # [vocab] of the prompt's last token (None: see feed)
    cached: int                    # tokens restored from the store instead of computed
    states: list[str]              # states saved on the way (the prompt's prefix)
    recalled: list[dict]
    memory: dict | None            # the response's `kvmemory` object (with a user)
    label: str | None = None
    window: int | None = None      # tokens the reply attends to before it (prompt + grafted), if not len(ids)
    owner: str | None = None       # salts the chains and keys the ids of the states saved (a user's own)
    feed: int | list[int] | None = None   # with logits None: the prompt's last token(s), not in the cache yet (decoded first)
    guard: bool = False            # keep the reply from opening as a recalled turn reads (ChatMemory.guard)


def session_memory(mem, session: str) -> ChatMemory:
    """The memory of a session without a user: only its own older turns, in a namespace keyed by the
    session (apart from every user's; forgotten with the session)."""
    return ChatMemory(mem.rt, mem.scopes, f"session {session}", key=session_memory_key(session))


def session_record(p) -> str:
    """The key of a session's record: a user's sessions are the user's own (two users may name a
    session alike)."""
    return p.session if p.user is None else f"{user_key(p.user)}/{p.session}"


def memory_window(mem, p, cm: ChatMemory, kept: list[dict], dropped: list[dict]) -> Prepared:
    """The window of a request with a user (cm: the user's memory), or of a session without one
    that outgrew the window (cm: session_memory). kept: the messages that fit the window with room
    for recall, dropped: the older exchanges left out (ChatService.fit_with_memory), remembered here
    first so that recall can bring them back."""
    label = cm.state_label(p.session)
    if dropped:
        cm.remember(dropped, p.session)
    extra = []
    if len(kept) < len(p.messages):                # older turns of this very session were dropped
        extra = [h for h in cm.recall(kept[-1]["content"], k=window.RECALL_TURNS) if h.session == p.session]
    w = window.build(mem.rt, cm, kept, p.session, p.max_tokens, "kv", label=label, extra=extra, owner=cm.key)
    memory = {"user": p.user, **({} if p.user is not None else {"session": p.session}),
              **{k: v for k, v in w.stats.items() if k != "recall_s"}}
    recalled = [{"doc_id": r["doc_id"], "score": r["score"], "text": r["text"], "start_token": 0,
                 "end_token": r["tokens"]} for r in w.stats["recalled"]]
    return Prepared(w.ids, w.cache, w.logits, w.cached, w.states, recalled, memory, label,
                    w.stats["window_tokens"], cm.key, guard=window.guarded(cm, w))


def remember(mem, p, reply: str) -> None:
    """The finished exchanges of the request, with its reply, into the user's memory (each once)."""
    mem.chat_memory(p.user).remember(p.messages + [{"role": "assistant", "content": reply}],
                                             p.session or RECALL_SESSION)
