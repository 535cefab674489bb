"""The window of a chat turn with memory, and a reply from it (Python; the server's chat uses the
same window). By default (ChatMemory.place "message"):

    [the conversation before the new message: restored exactly from its stored state]
    [the new message's opening ("<|im_start|>user\n")]
    [the user's most relevant earlier turns: grafted as KV, re-rotated to follow it]   (as="kv")
    [the new message's words and the assistant's opening: prefilled]

The turns layout computed each turn behind the opening of a new conversation's first message (the
chat template's default system prompt, if any, and the user message's opening): they sit where they
were computed. ChatMemory.recompute of their tokens are recomputed there (1.0, the default: all of
them), but for the first turn of a first message (no system message of the client's): it sits at the
very positions, behind the very tokens, it was computed at, so its stored KV is restored as it is
(lead; ChatMemory.exact_lead) and only the turns after it and the message's words are prefilled.
place "after": between the conversation and the new message; "system": a session's first message
gets them inside its system message, where quoting puts them; a layout or template where "message"
cannot apply grafts them after. as="text" quotes the same recalled turns where the place puts them
(opening the new message; otherwise in the system message, as mem0-style memories do) and prefills
everything (the text-memory baseline); as="none" recalls nothing."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from kvmemory import graft, kv as kvops, prompts
from kvmemory.chat_memory.guard import Guard
from kvmemory.chat_memory.turns import ORDERS, said
from kvmemory.decode import TextStream, greedy
from kvmemory.device import ids_tensor
from kvmemory.errors import InputError, WindowExceededError
from kvmemory.runtime import Runtime

RECALL_TURNS = 3
QUOTE_HEAD = "What this user said in earlier conversations:\n"     # the text baseline's heading
# where recalled turns are grafted: after the conversation, inside its system message (inline_parts), or
# opening the new user message (opening_parts; the turns layout, whose turns were computed behind a user
# message's opening)
PLACES = ("after", "system", "message")
QUOTE_END = ""          # after the last quoted turn ("\n": the tokens a system-placed graft holds)


@dataclass
class Window:
    ids: list[int]                 # the conversation's tokens (prefix + new message): what is saved after
    cache: object
    logits: torch.Tensor           # [vocab]
    cached: int                    # tokens restored from the store (prefix reused + grafted)
    states: list[str]              # the prefix state saved on the way
    hits: list = field(default_factory=list)     # the Recall objects, window order
    stats: dict = field(default_factory=dict)


def split(tokenizer, messages: list[dict]) -> tuple[list[int], list[int]] | None:
    """(ids before the last user message, ids of it with the assistant's opening), or None when the
    conversation does not end with a user message the template renders separately."""
    if not messages or messages[-1]["role"] != "user":
        return None
    ids = prompts.chat_ids(tokenizer, messages)
    tail = tokenizer(prompts.turn_text(tokenizer, messages[-1]["content"]), add_special_tokens=False)["input_ids"]
    if len(tail) >= len(ids) or ids[-len(tail):] != tail:
        return None
    return ids[:-len(tail)], tail


def quoted(messages: list[dict], hits, note: str | None = None) -> list[dict]:
    """messages with the recalled turns quoted as text: in the system message, or (turns kept in the
    messages layout) as their chat messages before the new message, where KV recall grafts them.
    note: the system message's addition as given (inline_parts' mark)."""
    if hits and all(h.messages for h in hits):
        return messages[:-1] + [dict(m) for h in hits for m in h.messages] + messages[-1:]
    if note is None:
        note = QUOTE_HEAD + "\n".join(h.text.strip() for h in hits) + QUOTE_END
    if messages and messages[0]["role"] == "system":
        return [{"role": "system", "content": messages[0]["content"] + "\n\n" + note}] + messages[1:]
    return [{"role": "system", "content": note}] + messages


def inline_parts(tokenizer, messages: list[dict]) -> tuple[list[int], list[int]] | None:
    """(ids up to where quoting puts the recalled turns in the system message, ids after them to the
    assistant's opening): place="system" grafts the turns there, so the window holds the tokens quoting
    shows. None where the conversation has more than a system message before the new one (its
    messages would be prefilled again after the turns: the turns then follow it)."""
    if any(m["role"] != "system" for m in messages[:-1]):
        return None
    mark = "\u0000kvmemory-recalled\u0000"
    text = tokenizer.apply_chat_template(quoted(messages, [], note=QUOTE_HEAD + mark), tokenize=False,
                                         add_generation_prompt=True)
    if text.count(mark) != 1:
        return None
    before, after = text.split(mark)
    return (tokenizer(before, add_special_tokens=False)["input_ids"],
            tokenizer(after, add_special_tokens=False)["input_ids"])


def opening_parts(tokenizer, tail: list[int]) -> tuple[list[int], list[int]] | None:
    """tail (the new user message with the assistant's opening, split's) cut after the message's
    opening ("<|im_start|>user\n"): place="message" grafts the recalled turns there, the new message's
    words after them in the same message. None where the template's opening is not a token prefix of it."""
    mark = "\u0000kvmemory-opening\u0000"
    text = prompts.turn_text(tokenizer, mark)
    if text.count(mark) != 1:
        return None
    opening = tokenizer(text.split(mark)[0], add_special_tokens=False)["input_ids"]
    if not opening or tail[:len(opening)] != opening:
        return None
    return opening, tail[len(opening):]


def build(rt: Runtime, cm, messages: list[dict], session: str | None, max_new_tokens: int, as_: str = "kv",
          k: int = RECALL_TURNS, label: str | None = None, extra=(), owner: str | None = None) -> Window:
    """The window of `messages` for user memory `cm` (ChatMemory). Recalled turns exclude `session`'s
    own (they are in its prompt); `extra` are Recall objects to add (older turns of this session)."""
    if as_ not in ("kv", "text", "none"):
        raise InputError(f"recall as 'kv', 'text' or 'none', got {as_!r}")
    if cm.place not in PLACES:
        raise InputError(f"place is one of {PLACES}, got {cm.place!r}")
    if cm.order not in ORDERS:
        raise InputError(f"order is one of {ORDERS}, got {cm.order!r}")
    t0 = time.perf_counter()
    hits = []
    if as_ != "none" and messages and messages[-1]["role"] == "user":
        kept = {m["content"] for m in messages}
        hits = [h for h in cm.recall(messages[-1]["content"], k=k, exclude_session=session)
                if said(h.text) not in kept]
        seen = {h.doc_id for h in hits}
        hits = sorted(hits + [h for h in extra if h.doc_id not in seen], key=lambda h: (h.time, h.turn))[-k:]
        if cm.order == "relevance":                      # the most relevant nearest the new message
            hits = sorted(hits, key=lambda h: h.score)
    recall_s = time.perf_counter() - t0
    limit = rt.geometry.max_positions
    label = label or "kvmemory:chat"
    parts = split(rt.tokenizer, messages) if as_ == "kv" and hits else None
    at_opening = cm.place == "message" and cm.layout == "turns"     # where the turns layout computed them
    if parts is None:                                     # quoted as text (or nothing recalled)
        def shown(hits):
            if not hits:
                return messages
            if at_opening and messages[-1]["role"] == "user":
                # the very words a graft there holds: the turns open the new message
                return messages[:-1] + [{"role": "user", "content": "".join(h.text for h in hits)
                                         + messages[-1]["content"]}]
            return quoted(messages, hits)
        ids = prompts.chat_ids(rt.tokenizer, shown(hits))
        while hits and len(ids) + max_new_tokens > limit:
            hits = _drop_least(hits)
            ids = prompts.chat_ids(rt.tokenizer, shown(hits))
        _fits(len(ids), max_new_tokens, limit)
        prefix = rt.save(ids[:-1], label=label, owner=owner) if len(ids) > 1 else None
        cache = prefix.cache() if prefix is not None else kvops.make_cache(None, rt.model.config)
        logits = kvops.last_logits(rt.model, ids_tensor(ids[-1:], rt.model), cache)
        cached = prefix.reused_tokens if prefix is not None else 0
        saved = ids if not hits else prompts.chat_ids(rt.tokenizer, messages)
        return Window(saved, cache, logits, cached, [prefix.id] if prefix is not None else [], hits,
                      _stats(hits, cached, 0, 0, len(ids) - cached, len(ids), recall_s))
    prefix_ids, tail = parts
    saved = prefix_ids + tail
    inline = inline_parts(rt.tokenizer, messages) if cm.place == "system" else None
    opened = opening_parts(rt.tokenizer, tail) if at_opening else None
    if inline is not None:          # grafted inside the conversation's system message, as quoting shows them
        prefix_ids, tail = inline
    elif opened is not None:        # grafted where they were computed: after a user message's opening
        prefix_ids, tail = prefix_ids + opened[0], opened[1]
    while hits and len(prefix_ids) + sum(h.n_tokens for h in hits) + len(tail) + max_new_tokens > limit:
        hits = _drop_least(hits)
    _fits(len(prefix_ids) + len(tail), max_new_tokens, limit)
    g = rt.geometry
    # the first turn restored as it is stored, where the window opens as it was computed behind (lead)
    first = lead(rt, cm, prefix_ids, hits) if cm.recompute >= 1.0 and cm.exact_lead and inline is None \
        and not cm.graft_head else None
    if first is not None:           # the prefix is the user's prelude state: read, not saved again (the user's,
        prefix_kv, cached, states = first.kv, len(prefix_ids), []      # not the session's: not listed as its)
    elif prefix_ids:
        prefix = rt.save(prefix_ids, label=label, owner=owner)
        prefix_kv, cached, states = prefix.kv, prefix.reused_tokens, [prefix.id]
    else:
        prefix_kv = torch.zeros((g.layers, 2, g.kv_heads, 0, g.head_dim), dtype=rt.kv_dtype)
        cached, states = 0, []
    # the recall's own system message: its opening is the user's prelude state (the tokens every
    # turn was computed behind), grafted with the turns, so each turn keeps its relative position
    # to it; the message's end and the new message are all that is prefilled
    head = []
    if cm.graft_head and inline is None:
        _, last = cm.docs.prelude_state()
        head = rt.store().chain(last)
    foot = (rt.tokenizer(cm.foot_text, add_special_tokens=False)["input_ids"]
            if cm.foot_text and inline is None else []) + tail
    rows = head + [r for h in hits for r in h.rows]
    if cm.recompute >= 1.0:
        # every recalled token recomputed (the default): prefilled after the conversation, their stored KV
        # not read (the blend at r = 1 computes the same window, up to float rounding, at more cost); but
        # the lead turn's, restored at the positions it was computed at (no re-rotation: its bytes as stored)
        restored = 0
        if first is not None:
            lead_rows = list(hits[0].rows)
            prefix_kv, restored, rerotated = graft.after(rt, prefix_kv, lead_rows)
            assert rerotated == 0, "a lead turn sits where it was computed"
            rows = rows[len(lead_rows):]
        done, n = graft.prefill_rows(rt, prefix_kv, rows, foot)
        return Window(saved, done.cache, done.logits, cached + restored, states, hits,
                      _stats(hits, cached, restored + n, 0, len(prefix_ids) - cached + len(foot),
                             done.cache.get_seq_length(), recall_s, n))
    kv, grafted, rerotated = graft.after(rt, prefix_kv, rows)
    # recompute the grafted turns' tokens that deviate most (CacheBlend), attending to the
    # conversation before them; the prefix stays exact. r: of the grafted tokens, not the window
    r = min(1.0, cm.recompute * grafted / (len(prefix_ids) + grafted)) if grafted else 0.0

    def ctx_ids():
        return list(prefix_ids) + rt.store().token_ids(rows)
    done = graft.prefill_tail(rt, kv, foot, recompute=r, ctx_ids=ctx_ids, exact_tokens=len(prefix_ids))
    cache, logits, recomputed = done.cache, done.logits, done.recomputed
    window = cache.get_seq_length()
    return Window(saved, cache, logits, cached + grafted - recomputed, states, hits,
                  _stats(hits, cached, grafted, rerotated, len(prefix_ids) - cached + len(foot), window, recall_s,
                         recomputed))


def lead(rt: Runtime, cm, prefix_ids: list[int], hits: list):
    """The user's stored prelude state where the window opens with it (prefix_ids are its very tokens) and the
    first recalled turn was computed right behind it: every block of that turn follows the prelude's last
    block (its id re-derives from the prelude's chain: computed after those tokens) at the positions it
    holds in this window. Its stored KV is then the canonical computation of the window's first tokens
    (E1): restored, not prefilled. None otherwise (nothing is saved here)."""
    if not hits or not prefix_ids or list(cm.docs.prelude.ids) != list(prefix_ids):
        return None
    row, rows = cm.docs.prelude_row(), list(hits[0].rows)
    if row is None or not rows:
        return None
    meta = rt.store().verified_meta(rows)        # each block's id re-derives from its parent's, tokens, positions
    at, parent = len(prefix_ids), row
    for i in range(len(rows)):
        if int(meta["parent"][i]) != parent or int(meta["positions"][i][0]) != at:
            return None
        at, parent = at + int(meta["n_tokens"][i]), rows[i]
    return cm.docs.prelude_state()[0]


def _drop_least(hits: list) -> list:
    """hits (in window order) without the least relevant one: what goes first when they do not all fit
    (the oldest may be the one asked about)."""
    worst = min(range(len(hits)), key=lambda i: (hits[i].score, -i))
    return hits[:worst] + hits[worst + 1:]


def _fits(n: int, max_new_tokens: int, limit: int) -> None:
    if n + max_new_tokens > limit:
        raise WindowExceededError(f"the conversation is {n} tokens and max_new_tokens {max_new_tokens}; the "
                                  f"model's window is {limit}")


def _stats(hits, cached, grafted, rerotated, prefilled, window, recall_s, recomputed=0) -> dict:
    return {"recalled": [{"session": h.session, "turn": h.turn, "time": h.time, "doc_id": h.doc_id,
                          "score": h.score, "tokens": h.n_tokens, "text": h.text} for h in hits],
            "tokens_grafted": grafted, "tokens_rerotated": rerotated, "tokens_recomputed": recomputed,
            "tokens_restored": cached + grafted - recomputed, "tokens_prefilled": prefilled, "window_tokens": window,
            "recall_s": recall_s}


def guarded(cm, w: Window) -> bool:
    """Whether a reply from window w picks through a Guard: turns were recalled and cm.guard is on (the
    Python reply's rule and the server's, ChatService._pick)."""
    return bool(cm.guard and w.hits)


@torch.inference_mode()
def reply(rt: Runtime, cm, messages: list[dict], session: str | None = None, max_new_tokens: int = 64, as_: str = "kv",
          k: int = RECALL_TURNS, remember: bool = True):
    """Greedy reply to `messages` with the user's memory; remembers the exchange (remember=True).
    Returns (text, stats): stats has the window's figures and timings (ttft, decode)."""
    t0 = time.perf_counter()
    with rt.lock:
        w = build(rt, cm, messages, session, max_new_tokens, as_, k, label=cm.state_label(session), owner=cm.key)
        ttft = time.perf_counter() - t0
        stream = TextStream(rt.tokenizer, strip=True)
        pick = Guard(rt.tokenizer) if guarded(cm, w) else None
        new = greedy(rt.model, w.cache, w.logits, max_new_tokens, rt.eos_ids, on_token=stream, pick=pick)
        text = stream.finish(new)
        rt.save(w.ids + new, label=cm.state_label(session), owner=cm.key)   # next turn
        if remember and session:
            cm.remember(messages + [{"role": "assistant", "content": text}], session)
    return text, {**w.stats, "ttft_s": ttft, "tokens_decoded": len(new), "total_s": time.perf_counter() - t0}
