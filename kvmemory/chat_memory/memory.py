"""ChatMemory: the memory of one user.

    remember(messages, session)  every finished exchange (a user message and the reply) is
                                 deposited once: its KV computed behind the user's own prelude
                                 (a prefill, no generation, no LLM extraction), its blocks
                                 indexed in the user's own indexes; visible to the next request
    recall(query, k)             the user's most relevant earlier turns (the engine of ask:
                                 MiniLM + BM25 fused), oldest first so the latest sits nearest
                                 the question (a later "I moved to Oslo" after "I live in Bergen")
    sessions(), forget(session)  what is kept; forgetting is one commit (all unselectable at
                                 once), gc then deletes the bytes

Isolation by construction: a user's turns are documents under user:<key>:, a scope that every
lookup names (kvmemory.documents.Scope), with indexes in STORE/users/<key>/; and their prelude
names the user's key, so every block of a user's turns has an id no other user's block can have
(a block another user sent with the same words is a different block, never a cache hit).
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import xxhash
from jinja2.exceptions import TemplateError

from kvmemory import prompts
from kvmemory.chat_memory.rules import (ADDITIVE, COVER, DENSE, LEXICAL, LEXICALS, MIN_RELEVANCE, NEWER,  # noqa: F401
                                        ON_TOPIC, ORDER, SUPERSEDE, TOPIC_FIRST, adds, refine)
from kvmemory.chat_memory.turns import KEEPS, said, turn_text
from kvmemory.documents import Scopes
from kvmemory.errors import InputError
from kvmemory.options import check_min_relevance, check_recompute
from kvmemory.prelude import USER_DOCS, PromptLayout, Scope
from kvmemory.runtime import Runtime

USERS_DIR = "users"
# the fraction of a window's recalled-turn tokens recomputed (CacheBlend). With the turns opening the new
# message (PLACE "message"), on two draws of 200 probes of the model's own conversations (bench_chat_recall.py,
# 2026-12-06, histories seeds 971571245 / 488028631): 0.3 -> 105 / 112 right, 0.6 -> 117 / 114, 1.0 -> 132 /
# 125, as many as quoting the same turns there (132 / 125), the first token in 0.144 s / 0.147 s against
# 0.111 s / 0.124 s at 0.3 (quoting: 0.286 s / 0.302 s). At 1.0 every recalled token is recomputed in the
# window: the KV restored is the conversation's. (Grafted after the conversation, 2026-12-05: 0.3 best;
# the scripted benchmark: 0 -> 57/200, 0.15 -> 63, 0.3 -> 71.)
RECOMPUTE = 1.0
# at RECOMPUTE 1.0, the first recalled turn's stored KV restored instead of prefilled where the window's
# opening is the one it was computed behind (a new conversation's first message; window.lead): the same
# tokens at the same positions, computed the canonical way (E1), so the window differs from the one
# prefilling them by float rounding alone (prefilled in one pass there, block by block here)
EXACT_LEAD = True


def drop_forgotten_users(store, path) -> list[str]:
    """Remove the index files of users with no turns left in the store (a forget that a crash
    interrupted leaves them behind). Needs no model: `kvmemory gc` calls it too. Returns the
    user keys removed."""
    finish_forgets(store, path)
    users = Path(path) / USERS_DIR
    if not users.is_dir():
        return []
    store.refresh()
    removed = []
    with store.write_lock():
        keys = {d[len(USER_DOCS):].split(":", 1)[0] for d in store.manifest.docs if d.startswith(USER_DOCS)}
        for d in sorted(users.iterdir()):
            if d.is_dir() and d.name not in keys:
                shutil.rmtree(d, ignore_errors=True)
                removed.append(d.name)
    return removed


CHAT_LABEL = "kvmemory:chat:"             # + user key + ":" + session key: a user's conversation states
MEMORY_LABEL = "kvmemory:chat-memory:"    # + user key: the user's chat-memory prelude


def users_state(label: str, key: str) -> bool:
    """Whether a state's label makes it the user's (a conversation of theirs, or their prelude)."""
    return label.startswith(f"{CHAT_LABEL}{key}:") or label == f"{MEMORY_LABEL}{key}"


def finish_forgets(store, path) -> list[str]:
    """An encrypted store: forget the users whose data key was destroyed (a forget a crash cut short
    after its commit point): their turns and states leave the manifest in one commit, their index
    files are removed. Needs no model. Returns the user keys finished."""
    from kvmemory.store import Change
    if store.sealer is None or store.read_only:
        return []
    store.refresh()
    m = store.manifest
    keys = {d[len(USER_DOCS):].split(":", 1)[0] for d in m.docs if d.startswith(USER_DOCS)}
    keys |= {e.label.split(":")[2] for e in m.states.values() if e.label.startswith((CHAT_LABEL, MEMORY_LABEL))}
    gone = sorted(k for k in keys if k and store.sealer.destroyed(k))
    if not gone:
        return []

    def build(s):
        docs = tuple(d for d in s.manifest.docs if any(d.startswith(f"{USER_DOCS}{k}:") for k in gone))
        states = tuple(sid for sid, e in s.manifest.states.items() if any(users_state(e.label, k) for k in gone))
        return Change(removed_docs=docs, removed_states=states)
    store.commit(build)
    with store.write_lock():
        for k in gone:
            shutil.rmtree(Path(path) / USERS_DIR / k, ignore_errors=True)
    return gone


HEADER = "What this user said in earlier conversations"
NOTE = "Notes from earlier conversations with this user"
# turns: prose ("On <day>, the user said: ...") inside a user message's opening; system: the same prose
# inside a system message of its own; messages: each turn as the chat messages it was (the user's
# words as a user message, the reply as an assistant message), computed behind a system note
LAYOUTS = ("turns", "system", "messages")

# measured: benchmarks/bench_chat_memory.py --layout (docs/guides/chat-memory.md); against "messages" on 200
# probes of the model's own conversations (bench_chat_recall.py, 2026-12-05, histories seed 1795747579):
# as KV 75 right with 7% of answers opening as a turn reads ("The user said: ..."), "messages" 66 with 0%
LAYOUT = "turns"
# what a remembered turn keeps: the user's words alone. Measured on 200 probes of conversations the model
# really had (benchmarks/bench_chat_recall.py, 2026-12-04, seed 1298385875): recalled as KV, the user's
# words alone answered 72/200 against 42/200 with the reply kept, and answers continuing remembered prose
# fell from 65.5% to 9.5% (a small model's reply is often no content, and it continues a remembered one)
KEEP = "user"
# keep a reply from opening as a remembered turn reads (kvmemory/chat_memory/guard.py; ChatMemory.guard,
# in Python replies and the server's). On since 2026-12-06: under today's recall (cut, cover, user's words)
# on two fresh draws of bench_chat_recall.py, recalled as KV, it took answers opening as a remembered
# turn from 4.5% to 0% with the same 93/200 right (histories seed 712938882), and at ~100K tokens a user
# from 5.0% to 0% at 31/60 against 32 (seed 1858085271). (Before the cut, 2026-12-05, seed 448474438, it
# cost 86 -> 79 right: off then.)
GUARD = True
# where recalled turns sit in a window (window.PLACES). "message": opening the new user message, after the
# opening the turns layout computed them behind, the question's words following; quoted as text there too.
# Measured on two draws of 200 probes of the model's own conversations (bench_chat_recall.py, 2026-12-06,
# histories seeds 971571245 / 488028631): as KV 84 / 99 right "after" the conversation -> 105 / 112; quoted
# in the system message 90 / 96 -> opening the message 132 / 125 (docs/guides/chat-memory.md)
PLACE = "message"
MAX_USER = 200


def renders_messages(tokenizer) -> bool:
    """Whether the chat template renders a user message after a system message as it is (the
    messages layout needs it; a template that folds the system prompt into the first user turn
    does not)."""
    try:
        prompts.message_ids(tokenizer, [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}])
    except (InputError, TemplateError):     # TemplateError: one that raises on its own (roles must alternate)
        return False
    return True


def default_layout(tokenizer) -> str:
    """LAYOUT where the model's chat template can render it, else "turns"."""
    return LAYOUT if LAYOUT != "messages" or renders_messages(tokenizer) else "turns"


def _day(when: float) -> str:
    """The date a remembered turn carries (questions of time need it): UTC, YYYY-MM-DD."""
    return time.strftime("%Y-%m-%d", time.gmtime(when))


def user_key(user: str) -> str:
    """A user's key in the store (a hash: user names never appear in file or doc names)."""
    if not isinstance(user, str) or not user or len(user) > MAX_USER or not user.isprintable():
        raise InputError(f"a user is a non-empty string of at most {MAX_USER} printable characters, got {user!r}")
    return xxhash.xxh3_128_hexdigest(("kvmemory-user:" + user).encode())[:12]     # 48 bits


def session_memory_key(session: str) -> str:
    """The key of the memory of a session without a user (its own older turns): hashed in a domain
    of its own, so it is no user's key."""
    return xxhash.xxh3_128_hexdigest(("kvmemory-session-memory:" + session).encode())[:12]


def session_key(session: str) -> str:
    return xxhash.xxh3_64_hexdigest(("kvmemory-session:" + session).encode())


@dataclass(frozen=True)
class Recall:
    """One recalled turn: where it is (doc id, token span), whence (session, turn, time), how relevant."""
    doc_id: str
    session: str
    turn: int
    time: float
    score: float
    rows: tuple[int, ...]          # its blocks, in order
    n_tokens: int
    text: str                      # as prose: "On <day>, the user said: ...\n" (what quoting shows)
    messages: tuple[dict, ...] = ()   # the messages layout: the turn's chat messages


@dataclass(frozen=True)
class Forgotten:
    turns: int
    states: int


class ChatMemory:
    """layout: how recalled turns sit in a window (kvmemory/chat_memory/window.py), and so what their
    blocks were computed behind; one per store (LAYOUTS)."""

    def __init__(self, rt: Runtime, scopes: Scopes, user: str, layout: str | None = None, key: str | None = None,
                 recompute: float | None = None, keep: str | None = None) -> None:
        self.rt, self.scopes, self.user = rt, scopes, user
        self.key = user_key(user) if key is None else key
        self.layout = default_layout(rt.tokenizer) if layout is None else layout
        if self.layout not in LAYOUTS:
            raise InputError(f"layout must be one of {LAYOUTS}, got {layout!r}")
        if self.layout == "messages" and not renders_messages(rt.tokenizer):
            raise InputError("layout 'messages' needs a chat template that renders a user message after a "
                             "system message as it is; this model's does not (use 'turns')")
        # what of an exchange remember() keeps (kvmemory/chat_memory/turns.py)
        self.keep = KEEP if keep is None else keep
        if self.keep not in KEEPS:
            raise InputError(f"keep must be one of {KEEPS}, got {keep!r}")
        self.prefix = f"{USER_DOCS}{self.key}:"
        mark = "\u0000KVMEMORY-TURNS\u0000"
        if self.layout == "messages":
            # after a system note naming the user's key (the salt of every block), as chat messages;
            # grafted alone, right after the conversation (the new message follows them)
            head, self.foot_text = prompts.system_text(rt.tokenizer, f"{NOTE} (memory {self.key})."), ""
        elif self.layout == "system":
            # inside a system message of their own, as the window shows them: its opening (naming the
            # user's key: the salt of every block) before them, its end after
            head, self.foot_text = prompts.system_around(rt.tokenizer, f"{HEADER} (memory {self.key}):\n" + mark,
                                                         mark)
        else:
            # in a user message opening a new conversation, as a first message with no system message of
            # the client's reads (the template's default system prompt, if any): the turn recalled first
            # into such a message sits where it was computed, its stored KV restored as it is
            # (window.lead; EXACT_LEAD). The blocks are the user's own: the chain is salted by its key.
            # (Before 2026-12-07 a system note naming the key: those turns are prefilled, as any turn the
            # window's opening is not the one it was computed behind.)
            head, self.foot_text = prompts.first_opening(rt.tokenizer, mark), ""
        # what sits around the recalled turns in a window: the prelude they were computed behind,
        # grafted as KV with them (no prefill), and a text prefilled after them
        self.graft_head = self.layout == "system"
        # where recalled turns go (PLACE): "message" opening the new user message (the turns layout), "after"
        # the conversation (quoted: in the system message), "system" inside its system message (a first message)
        self.place = PLACE
        # keep a reply (Python's and the server's) from opening as a remembered turn reads (GUARD; guard.py)
        self.guard = GUARD
        # the order of the recalled turns in the window (ORDER: "time" or "relevance", the best last)
        self.order = ORDER
        # a turn recalled after the most relevant one needs min_relevance x its BM25 score (MIN_RELEVANCE)
        self.min_relevance = MIN_RELEVANCE
        # with the cut, a turn below it that holds a word of the question no kept turn holds comes still
        # (COVER; kvmemory.retrieve.relevant's held)
        self.cover = COVER
        # after the most relevant turn, only turns holding a content word of the question (ON_TOPIC)
        self.on_topic = ON_TOPIC
        # with on_topic, a best turn holding no content word of the question gives way to the best that does
        self.topic_first = TOPIC_FIRST
        # what BM25 ranks for a question (LEXICAL): "held", the turns holding a content word of it; "content",
        # on its content words alone; "all", every turn on all its words
        self.lexical = LEXICAL
        # a turn said after the best one, holding a word of the question it holds, comes under the cut (its update)
        self.newer = NEWER
        # of kept turns holding the same words of the question, the newest alone (SUPERSEDE)
        self.supersede = SUPERSEDE
        # with supersede, a statement adding to what was told ("I also speak German") kept beside it (ADDITIVE)
        self.additive = ADDITIVE
        # the dense ranking's best turn kept too, room permitting (DENSE)
        self.dense = DENSE
        # the fraction of the grafted turns' tokens recomputed in the window (CacheBlend-style,
        # kvmemory/blend.py): the turns were computed behind the user's prelude, not after this
        # conversation; the tokens whose K/V deviate most are recomputed attending to it (RECOMPUTE)
        # (at 1.0 the turns' tokens are prefilled, no blend: every model; below it, 0 for a model the blend
        # cannot reproduce, kvmemory.blend.supported: its turns graft as they are)
        from kvmemory.blend import supported
        if recompute is None:
            recompute = RECOMPUTE if RECOMPUTE >= 1.0 or supported(rt.model) is None else 0.0
        self.recompute = recompute
        check_recompute(self.recompute)
        # the first recalled turn restored where it sits as computed (EXACT_LEAD)
        self.exact_lead = EXACT_LEAD
        self.scope = Scope(prefix=self.prefix, index_dir=f"{USERS_DIR}/{self.key}/index", layout=PromptLayout(),
                           label=f"{MEMORY_LABEL}{self.key}", head=head, owner=self.key)

    @property
    def docs(self):
        return self.scopes.get(self.scope)

    # ------------------------------------------------------------------ writes
    def remember(self, messages: list[dict], session: str, when: float | None = None) -> list[str]:
        """Deposit every finished exchange of `messages` ([{"role", "content"}]: a user message
        followed by the assistant's reply) not already kept for this session. Returns the doc ids
        of the turns stored now."""
        if not isinstance(session, str) or not session:
            raise InputError("remember needs the session the turns belong to")
        when = time.time() if when is None else float(when)
        have = self.rt.store().manifest.docs
        added, n = [], 0
        for i in range(len(messages) - 1):
            u, a = messages[i], messages[i + 1]
            if u.get("role") != "user" or a.get("role") != "assistant":
                continue
            n += 1
            # the date is part of what is kept: questions of time ("which came first?") need it
            text = turn_text(self.keep, _day(when), u["content"], a["content"])
            # the exchange's words name it (not its date): a conversation resent on another day is kept once
            words = f"{u['content']}\u0000{a['content']}"
            doc_id = f"{self.prefix}{session_key(session)}:{xxhash.xxh3_64_hexdigest(words.encode())}"
            if doc_id in have or not text.strip():
                continue
            meta: dict = {"session": session, "turn": n, "time": when}
            ids = None
            if self.layout == "messages":
                kept = [u] if self.keep == "user" else [u, a]
                ids, spans = prompts.message_ids(self.rt.tokenizer, kept)
                meta["spans"] = spans         # token offsets of each message's words (no words in the manifest)
            with self.rt.lock:
                self.docs.add(text, doc_id, source=json.dumps(meta), ids=ids)
            added.append(doc_id)
        return added

    # ------------------------------------------------------------------ reads
    def turns(self, session: str | None = None) -> list[dict]:
        """The kept turns (oldest first): doc id, session, turn, time, tokens."""
        out = []
        for d in self.docs.docs():
            meta = json.loads(d.source)
            if session is None or meta["session"] == session:
                out.append({"doc_id": d.doc_id, **{k: v for k, v in meta.items() if k != "spans"},
                            "n_tokens": d.n_tokens, "blocks": d.blocks})
        return out

    def sessions(self) -> list[dict]:
        """Sessions with kept turns: id, turns, tokens, first and last time."""
        by: dict[str, dict] = {}
        for t in self.turns():
            s = by.setdefault(t["session"], {"id": t["session"], "turns": 0, "tokens": 0, "first": t["time"],
                                             "last": t["time"]})
            s["turns"] += 1
            s["tokens"] += t["n_tokens"]
            s["first"], s["last"] = min(s["first"], t["time"]), max(s["last"], t["time"])
        return sorted(by.values(), key=lambda s: s["first"])

    def recall(self, query: str, k: int = 3, exclude_session: str | None = None) -> list[Recall]:
        """The k turns most relevant to `query` (never of `exclude_session`: the session asking has
        them in its own prompt), oldest first."""
        from kvmemory.index.lexical import content_terms, content_words
        from kvmemory.retrieve import rank_blocks, relevant
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise InputError(f"k must be an integer >= 1, got {k!r}")
        check_min_relevance(self.min_relevance, of="turn")
        if self.lexical not in LEXICALS:
            raise InputError(f"lexical must be one of {LEXICALS}, got {self.lexical!r}")
        if not isinstance(query, str) or not query.strip():
            return []
        store = self.rt.store()
        store.refresh()
        docs = self.docs
        if not docs.live_map():
            return []
        skip = f"{self.prefix}{session_key(exclude_session)}:" if exclude_session else None
        asked = content_terms(query)
        words = content_words(query) if self.lexical == "content" else ""
        ranked = rank_blocks(self.rt, docs, query, "text", n=4 * k,
                             doc_filter=(lambda d: not d.startswith(skip)) if skip else None,
                             lexical=words or None, need=asked if self.lexical == "held" and asked else None)
        live, firsts = docs.live_map(), {}
        for h in ranked:                  # each turn by its best block; the cut is ask's, turn for block
            firsts.setdefault(live[h.row][0], h)
        out = []

        terms: dict[int, set] = {}

        def held(h):                      # the question's content terms in the turn's best block (COVER)
            if h.row not in terms:
                text = self.rt.tokenizer.decode(store.token_ids([h.row]), skip_special_tokens=True)
                terms[h.row] = asked & content_terms(text)
            return terms[h.row]
        cands = list(firsts.values())
        if self.on_topic and self.topic_first and asked and cands and not held(cands[0]):
            # the best turn holds no content word of the question ("What is a haiku?" for "What is my flat
            # number?", on "what"): the best one that does leads, and the cut is against it
            on = next((h for h in cands if held(h)), None)
            if on is not None:
                cands = [on] + [h for h in cands if h is not on]
        kept = relevant(cands, k, self.min_relevance, held if self.cover else None)
        if self.on_topic and asked:       # after the best, only a turn holding a content word of the question
            kept = kept[:1] + [h for h in kept[1:] if held(h)]
        top = None
        if self.dense and asked:          # the dense ranking's best turn (DENSE)
            top = next(iter(rank_blocks(self.rt, docs, query, "dense", n=1,
                                        doc_filter=(lambda d: not d.startswith(skip)) if skip else None)), None)

        metas: dict[str, dict] = {}
        texts: dict[str, tuple[str, tuple[dict, ...]]] = {}

        def meta_of(doc_id):              # each turn's manifest record parsed once, its text decoded once
            if doc_id not in metas:
                metas[doc_id] = json.loads(store.manifest.docs[doc_id].source)
            return metas[doc_id]

        def text_of(doc_id):
            if doc_id not in texts:
                texts[doc_id] = self._turn(store.manifest.docs[doc_id].rows, meta_of(doc_id))
            return texts[doc_id]

        def when(h):
            meta = meta_of(live[h.row][0])
            return meta["time"], meta["turn"]

        def words(h):                     # the user's words of h's turn
            return said(text_of(live[h.row][0])[0])
        # a turn asking something (supersede), a turn adding to what was told (additive)
        kept = refine(kept, cands, k, held, lambda h: live[h.row][0], when, self.newer and bool(asked),
                      self.supersede and bool(asked), top, lambda h: "?" in words(h),
                      (lambda h: adds(words(h))) if self.additive else None)
        for h in kept:
            doc_id = live[h.row][0]
            entry, meta = store.manifest.docs[doc_id], meta_of(doc_id)
            text, msgs = text_of(doc_id)
            out.append(Recall(doc_id, meta["session"], meta["turn"], meta["time"], h.score, tuple(entry.rows),
                              entry.n_tokens, text, msgs))
        return sorted(out, key=lambda r: (r.time, r.turn))

    def _turn(self, rows, meta: dict) -> tuple[str, tuple[dict, ...]]:
        """A kept turn's prose text and (a messages-layout turn) its chat messages, from its tokens."""
        ids = self.rt.store().token_ids(rows)
        dec = self.rt.tokenizer.decode
        if "spans" not in meta:
            return dec(ids, skip_special_tokens=True), ()
        words = [dec(ids[a:b]) for a, b in meta["spans"]]
        msgs = tuple({"role": r, "content": w} for r, w in zip(("user", "assistant"), words))
        keep, reply = ("user", "") if len(words) == 1 else ("exchange", words[1])
        return turn_text(keep, _day(meta["time"]), words[0], reply), msgs

    def reply(self, messages: list[dict], session: str | None = None, max_new_tokens: int = 64, as_: str = "kv",
              k: int = 3, remember: bool = True):
        """A greedy reply to `messages` (ending with the user's message) with this user's earlier turns
        recalled: as="kv" grafts them after the conversation's exact prefix, "text" quotes them in the
        system message (the text-memory baseline), "none" recalls nothing. Remembers the exchange
        under `session` (remember=True). Returns (text, stats)."""
        from kvmemory.chat_memory.window import reply
        return reply(self.rt, self, messages, session, max_new_tokens, as_, k, remember)

    def state_label(self, session: str | None) -> str:
        """The label of the states a chat of this user saves (its conversations): forget finds them by it."""
        return f"{CHAT_LABEL}{self.key}:{session_key(session or '')}"

    # ------------------------------------------------------------------ forgetting
    def forget(self, session: str | None = None) -> "Forgotten":
        """Make the user's turns (of one session, or all) unselectable at once, with the states of
        those sessions' conversations: one commit removes them all (a crash before it: none; the
        next forget finishes it); their rows leave the user's indexes (or, should a crash come
        first, at the indexes' next load); `gc` then deletes their bytes. Forgetting everything also
        removes the user's index files (gc removes those of a user with no turns left).

        In an encrypted store forgetting everything first destroys the user's data key (the commit
        point: from then on no copy of the store can decrypt their turns, states or indexes); a
        crash after it is finished by the next open (finish_forgets)."""
        store = self.rt.store()
        store.refresh()
        want = self.prefix if session is None else f"{self.prefix}{session_key(session)}:"
        ids = [d for d in store.manifest.docs if d.startswith(want)]
        states = [s for s, e in store.manifest.states.items()
                  if (users_state(e.label, self.key) if session is None else e.label == self.state_label(session))]
        if session is None and store.sealer is not None:
            rows = [r for d in ids for r in store.manifest.docs[d].rows]
            rows += [r for s in states for r in store.chain(store.manifest.states[s].last_row)]
            store.sealer.destroy(self.key)           # the commit point
            finish_forgets(store, self.rt.path)      # the manifest and index files (no index is read)
            self.rt.forget_blocks(rows)              # this process's decrypted copies (the pager's tiers)
            self.scopes.drop(self.scope)
            return Forgotten(len(ids), len(states))
        n = self.docs.remove_all(ids, states=states)
        if session is None:
            with store.write_lock():
                shutil.rmtree(self.rt.path / USERS_DIR / self.key, ignore_errors=True)
            self.scopes.drop(self.scope)
        return Forgotten(n, len(states))
