"""A chat request with a user: the user's memory (kvmemory.chat_memory) recalled into the window as
KV, the exchange remembered after the reply.

    window = [the conversation before the new message: the session's stored state, exact]
             [the user's most relevant earlier turns, from other sessions: grafted, re-rotated]
             [the new message and the assistant's opening: prefilled]

Layout chosen so the session prefix restores bit-exactly (as without memory) and the recall sits
next to the question. A conversation longer than the window keeps its system message and latest
turns; its older exchanges are in the user's memory (remembered turn by turn) and recalled the
same way, as KV, not quoted. The user's states reuse only the user's own blocks: another user's
equal prefix is recomputed, never a cache hit (nor a faster first token)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvmemory import kv as kvops, prompts
from kvmemory.chat_memory import user_key
from kvmemory.chat_memory.graft import graft_after
from kvmemory.device import ids_tensor
from kvmemory.server.errors import ApiError

RECALL_TURNS = 3                   # earlier turns grafted per request at most
RECALL_SESSION = "default"         # the session of a user's request that names none


@dataclass
class Prepared:
    """A request's window, ready to decode from."""
    ids: list[int]                 # the prompt's tokens (saved afterwards, with the reply)
    cache: object                  # the KV the reply attends to
    logits: torch.Tensor           # [vocab] of the prompt's last token
    cached: int                    # tokens restored from the store instead of computed
    states: list[str]              # states saved on the way (the prompt's prefix)
    recalled: list[dict]
    memory: dict | None            # the response's `kvmemory` object (with a user)
    reuse: object                  # reuse(row) -> bool for saves: a user's own rows only
    label: str | None = None
    window: int | None = None      # tokens the reply attends to before it (prompt + grafted), if not len(ids)


def session_record(p) -> str:
    """The key of a session's record: a user's sessions are the user's own (two users may name a
    session alike)."""
    return p.session if p.user is None else f"{user_key(p.user)}/{p.session}"


def own_rows(service, p) -> set[int]:
    """Rows of the states of this user's sessions: the only stored blocks its requests may reuse."""
    store = service.mem.require_store()
    key = user_key(p.user)
    rows: set[int] = set()
    for rec in service.sessions.data.values():
        if rec.get("user_key") != key:
            continue
        for sid in rec["states"]:
            entry = store.manifest.states.get(sid)
            if entry is not None and store.is_committed(entry.last_row):
                rows.update(store.chain(entry.last_row))
    return rows


def _split(service, messages: list[dict]) -> tuple[list[int], list[int]] | None:
    """(ids before the new user message, ids of it with the assistant's opening), or None when the
    conversation does not end with a user message the template renders separately."""
    if not messages or messages[-1]["role"] != "user":
        return None
    ids = service.ids(messages)
    tok = service.mem.tokenizer
    tail = tok(prompts.turn_text(tok, messages[-1]["content"]), add_special_tokens=False)["input_ids"]
    if len(tail) >= len(ids) or ids[-len(tail):] != tail:
        return None
    return ids[:-len(tail)], tail


def _fit_with_memory(service, p, cm) -> list[dict]:
    """The messages that fit the window with room for recall: the system message(s) and the latest
    turns; the older exchanges dropped here are remembered first, so recall can bring them back."""
    mem = service.mem
    limit = mem.geometry.max_positions
    room = limit - p.max_tokens - RECALL_TURNS * mem.block_tokens
    messages = p.messages
    if len(service.ids(messages)) <= room:
        return messages
    n_head = next((i for i, m in enumerate(messages) if m["role"] != "system"), len(messages))
    head, rest = messages[:n_head], messages[n_head:]
    k = 0
    while k < len(rest) and len(service.ids(head + rest[k:])) > room:
        k += 1
    while k < len(rest) and rest[k]["role"] != "user":
        k += 1                                    # start the kept part at a user turn
    if k >= len(rest):
        raise ApiError(400, f"the latest message alone does not fit the model's window of {limit} tokens "
                            f"with max_tokens {p.max_tokens}", param="messages", code="context_length_exceeded")
    cm.remember(rest[:k], p.session)
    return head + rest[k:]


def memory_window(service, p) -> Prepared:
    mem = service.mem
    cm = mem.chat_memory(p.user)
    key = user_key(p.user)
    owned = own_rows(service, p)
    reuse = owned.__contains__
    label = f"kvmemory:chat:{key}"
    messages = _fit_with_memory(service, p, cm)
    split = _split(service, messages)
    if split is None:                              # nothing to put the recall before: plain, own rows only
        ids = service.ids(messages)
        prefix_ids, tail = ids[:-1], ids[-1:]
        hits = []
    else:
        prefix_ids, tail = split
        kept = {m["content"] for m in messages}
        hits = [h for h in cm.recall(messages[-1]["content"], k=RECALL_TURNS, exclude_session=p.session)
                if h.text.split("\nassistant: ")[0].removeprefix("user: ") not in kept]
        if len(messages) < len(p.messages):        # older turns of this very session were dropped
            hits = _merge(hits, [h for h in cm.recall(messages[-1]["content"], k=RECALL_TURNS)
                                 if h.session == p.session])
    limit = mem.geometry.max_positions
    while hits and len(prefix_ids) + sum(h.n_tokens for h in hits) + len(tail) + p.max_tokens > limit:
        hits = hits[1:]                            # the oldest go first: the latest stays nearest
    if len(prefix_ids) + len(tail) + p.max_tokens > limit:
        raise ApiError(400, f"the conversation is {len(prefix_ids) + len(tail)} tokens and max_tokens "
                            f"{p.max_tokens}; the model's window is {limit}", param="messages",
                       code="context_length_exceeded")
    if prefix_ids:
        prefix = mem.save(prefix_ids, label=label, reuse=reuse)
        prefix_kv, cached, states = prefix.kv, prefix.reused_tokens, [prefix.id]
        owned.update(mem.require_store().chain(mem.require_store().manifest.states[prefix.id].last_row))
    else:
        prefix_kv = torch.zeros((mem.geometry.layers, 2, mem.geometry.kv_heads, 0, mem.geometry.head_dim),
                                dtype=mem.kv_dtype)
        cached, states = 0, []
    rows = [r for h in hits for r in h.rows]
    kv, grafted, rerotated, _ = graft_after(mem, prefix_kv, rows, mem.documents.freqs)
    cache = kvops.make_cache(kv.to(mem.model.device), mem.model.config) if kv.shape[3] else \
        kvops.make_cache(None, mem.model.config)
    logits = kvops.last_logits(mem.model, ids_tensor(tail, mem.model), cache)
    recalled = [{"session": h.session, "turn": h.turn, "time": h.time, "doc_id": h.doc_id, "score": h.score,
                 "tokens": h.n_tokens, "text": h.text} for h in hits]
    memory = {"user": p.user, "recalled": recalled, "tokens_grafted": grafted, "tokens_rerotated": rerotated,
              "tokens_recomputed": 0, "tokens_restored": cached + grafted, "tokens_prefilled":
              len(prefix_ids) - cached + len(tail), "window_tokens": kv.shape[3] + len(tail)}
    return Prepared(prefix_ids + tail, cache, logits, cached + grafted, states,
                    [{k: r[k] for k in ("doc_id", "score", "text")} | {"start_token": 0, "end_token": r["tokens"]}
                     for r in recalled], memory, reuse, label, kv.shape[3] + len(tail))


def _merge(a, b):
    seen = {h.doc_id for h in a}
    return sorted(a + [h for h in b if h.doc_id not in seen], key=lambda h: (h.time, h.turn))[-RECALL_TURNS:]


def remember(service, p, reply: str) -> None:
    """The finished exchanges of the request, with its reply, into the user's memory (each once)."""
    service.mem.chat_memory(p.user).remember(p.messages + [{"role": "assistant", "content": reply}],
                                             p.session or RECALL_SESSION)
