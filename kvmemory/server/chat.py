"""The chat service behind POST /v1/chat/completions: fit a conversation to the window, restore its
stored prefix, decode, and save the conversation with its reply. A conversation longer than the
window keeps its system message and latest turns; its older turns go to the session's memory (or,
with a user, the user's) and the most relevant come back grafted as KV (server/memory_chat.py).

Persistence: the prompt of every request is saved as a state (its blocks content-addressed; up to
its last whole forward of the store's canonical prefill, ChatService.saved_part), so a request
whose messages extend a stored conversation restores the longest stored prefix exactly and
prefills only the rest (usage.prompt_tokens_details.cached_tokens); the conversation including
the reply is saved too, up to its last whole forward (what a turn that extends it can restore),
computed the canonical (block-chunked) way: after the response, once the server is idle, or
within the session's next turn (ChatService).
Greedy replies are therefore identical whether a prefix was restored or recomputed."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import replace

import torch

from kvmemory import kv as kvops, prompts
from kvmemory.chat_memory.guard import Guard
from kvmemory.chat_memory.window import RECALL_TURNS
from kvmemory.decode import Logprobs, TextStream, greedy, sampler
from kvmemory.errors import InputError
from kvmemory.grammar import Grammars
from kvmemory.model import invariant
from kvmemory.server.errors import ApiError
from kvmemory.server.memory_chat import Prepared, memory_window, remember, session_memory, session_record
from kvmemory.server.params import DEFAULT_MAX_TOKENS, ChatParams, params_of  # noqa: F401 (the service's view)
from kvmemory.server.sessions import Sessions

log = logging.getLogger("kvmemory.server")

IDLE_GRACE_S = 0.5        # a deferred save runs after the server has been idle this long
MAX_DEFERRED = 256        # deferred saves listed at most (one a session; those of requests without one dropped past it)
ANON = "\x00request:"     # the key of a request without a session in `later` (no session id starts so)


class ChatService:
    """pending() -> how many requests the server has admitted (set by the app). A request without a
    user saves its prompt's whole prefill forwards before it decodes (`saved_part`); the save of
    the conversation with its reply is deferred (`later`), so the response does not wait for it:
    it runs once the server has been idle for IDLE_GRACE_S (`flush`; a person reading the reply
    gives it that time), or, in a session, is folded into the session's next turn when that
    turn's prompt holds the reply (its prompt is saved anyway: computed once instead of twice), or
    is dropped when the session's next turn does not extend it (a client that trimmed or edited
    its history: no turn of the session continues that conversation any more). At shutdown every
    deferred save runs."""

    def __init__(self, mem, sessions: Sessions) -> None:
        self.mem = mem
        self.sessions = sessions
        self.pending = lambda: 0
        self.later: dict[str, tuple] = {}          # session record -> (p, w, new): the reply's save, deferred
        self.released = lambda: float("-inf")      # when a request last left the server (set by the app)
        self.dropped = 0                           # deferred saves made moot (a session's next turn) or dropped
        self.failed = 0                            # deferred saves that raised (logged)
        self._anon = 0
        self._grammars: Grammars | None = None

    def ids(self, messages: list[dict]) -> list[int]:
        return prompts.chat_ids(self.mem.tokenizer, messages)

    def keep_latest(self, p: ChatParams, room: int, from_user: bool = False) -> tuple[list, list, int]:
        """(system messages, the rest, k): head + rest[k:] is the longest tail of the conversation
        that fits `room` tokens (from_user: starting at a user turn); ApiError when not even the
        latest message fits."""
        messages = p.messages
        n_head = next((i for i, m in enumerate(messages) if m["role"] != "system"), len(messages))
        head, rest = messages[:n_head], messages[n_head:]
        k = 0
        while k < len(rest) and len(self.ids(head + rest[k:])) > room:
            k += 1
        while from_user and k < len(rest) and rest[k]["role"] != "user":
            k += 1
        if k >= len(rest):
            raise ApiError(400, f"the latest message alone does not fit the model's window of "
                                f"{self.mem.geometry.max_positions} tokens with max_tokens {p.max_tokens}",
                           param="messages", code="context_length_exceeded")
        return head, rest, k

    def fit_with_memory(self, p: ChatParams) -> tuple[list[dict], list[dict]]:
        """(the messages that fit the window with room for recall, the older exchanges dropped): the
        system message(s) and the latest turns are kept; the dropped ones go to the memory first."""
        mem = self.mem
        room = mem.geometry.max_positions - p.max_tokens - RECALL_TURNS * mem.block_tokens
        if len(self.ids(p.messages)) <= room:
            return p.messages, []
        head, rest, k = self.keep_latest(p, room, from_user=True)
        return head + rest[k:], rest[:k]

    def grammars(self) -> Grammars:
        """The tokenizer converted for constrained decoding, once (about a second)."""
        if self._grammars is None:
            self._grammars = Grammars(self.mem.tokenizer, self.mem.model.get_input_embeddings().num_embeddings)
        return self._grammars

    def check_schema(self, p: ChatParams) -> None:
        """response_format's schema compiles (before the request waits for the model): ApiError naming it."""
        if p.schema is not None:
            try:
                self.grammars().matcher(p.schema)
            except InputError as e:
                raise ApiError(400, str(e), param="response_format") from None

    def check_prompt(self, p: ChatParams) -> None:
        """A text completion's prompt and max_tokens fit the window (a text prompt has no older turns
        to keep in memory): ApiError otherwise."""
        n, limit = len(p.prompt_ids or ()), self.mem.geometry.max_positions
        if n + p.max_tokens > limit:
            raise ApiError(400, f"the prompt is {n} tokens and max_tokens {p.max_tokens}; the model's window is "
                                f"{limit}", param="prompt", code="context_length_exceeded")

    def overflows(self, p: ChatParams, ids: list[int] | None = None) -> bool:
        """Whether the conversation (ids: its tokens, if already known) and its reply exceed the
        window: then its older turns go to the session's memory (session_memory) and come back as
        KV. Without a session: ApiError."""
        n, limit = len(self.ids(p.messages) if ids is None else ids), self.mem.geometry.max_positions
        if n + p.max_tokens <= limit:
            return False
        if p.session is None:
            raise ApiError(400, f"the conversation is {n} tokens and max_tokens {p.max_tokens}; the "
                                f"model's window is {limit}. Name a session (prompt_cache_key) to keep older turns "
                                "in memory instead", param="messages", code="context_length_exceeded")
        return True

    def saved_part(self, n: int) -> int:
        """How many of a prompt's n tokens are saved (restored, or computed canonically) before it
        decodes: its whole forwards of the store's prefill (prefill_tokens; block_tokens by default),
        the part a later turn can restore. The rest (fewer than prefill_tokens, and the last token)
        is the decoding's first rows (greedy's feed): in a batcher, rows of a step the others'
        decoding runs anyway instead of forwards of its own, and no commit when the saved part did
        not grow. A function of n and the store only, so a prompt is computed the same way whether
        its prefix was restored or recomputed, sent again or after a restart (alone: the same reply,
        bit for bit). In invariant mode a later turn restores a partial forward too: all but the
        last token are saved."""
        return self.restorable(n - 1) if n > 1 else 0

    def restorable(self, n: int) -> int:
        """How many of a conversation's first n tokens a later turn that extends it restores from
        the store: its whole forwards of the store's prefill (a partial forward's KV is not the
        canonical block's, so only a state of exactly those tokens would find it); in invariant
        mode all n."""
        if invariant.installed(self.mem.model):
            return n
        q = self.mem.require_store().manifest.chunk_tokens
        return n // q * q

    def _prepare(self, p: ChatParams, ids: list[int]) -> Prepared:
        """Without a user, a conversation (its tokens: ids) that fits the window: its prefix restored
        (or computed) and saved up to `saved_part`; the rest is fed to the decoding."""
        mem = self.mem
        mem.require_store().require_exact()     # a compact store takes no conversation (409), short ones too
        cut = self.saved_part(len(ids))
        prefix = mem.save(ids[:cut], label="kvmemory:chat") if cut else None
        cache = prefix.cache() if prefix is not None else kvops.make_cache(None, mem.model.config)
        return Prepared(ids, cache, None, prefix.reused_tokens if prefix is not None else 0,
                        [prefix.id] if prefix is not None else [], [], None,
                        feed=ids[cut:] if len(ids) - cut > 1 else ids[-1])

    def complete(self, p: ChatParams, emit, cancel: threading.Event) -> dict:
        """Fit the prompt, restore/compute it (with a user: graft what its memory recalls), decode,
        save the conversation (and remember the exchange). emit(text_delta) streams."""
        mem = self.mem
        t0, first = time.perf_counter(), []

        def took(t) -> bool:
            if not first:
                first.append(time.perf_counter() - t0)
            return stream(t) or cancel.is_set()
        with mem.exclusive():                                      # one request's model work at a time
            with torch.inference_mode():
                ids = p.prompt_ids if p.prompt_ids is not None else None if p.user is not None \
                    else self.ids(p.messages)
                if p.session is not None:
                    self._fold(session_record(p), ids)
                if p.user is not None:
                    w = memory_window(mem, p, mem.chat_memory(p.user), *self.fit_with_memory(p))
                elif self.overflows(p, ids):                       # its older turns: the session's memory
                    w = memory_window(mem, p, session_memory(mem, p.session), *self.fit_with_memory(p))
                else:
                    w = self._prepare(p, ids)
                stream = TextStream(mem.tokenizer, p.stop, emit)
                pick = self._pick(p, w, 0)
                # more choices (n > 1): each from a copy of the window, its own seed, decoded beside this one
                others = self._others(p, w) if p.n > 1 else None
                new = greedy(mem.model, w.cache, w.logits, p.max_tokens, mem.eos_ids,
                             on_token=took,
                             pick=pick, feed=w.feed)
                text = stream.finish(new)
                extra = others() if others is not None else []
            cancelled = stream.halted or cancel.is_set()
            finish = "stop" if stream.stopped or len(new) < p.max_tokens else "length"
            if not cancelled and p.user is None and w.label is None:
                # the turn recorded now; its save when idle, with the next turn, or not at all (_fold)
                self._finish(p, w, new, text, save=False)
                self._defer(session_record(p) if p.session else None, (p, replace(w, cache=None, logits=None), new))
            elif not cancelled:
                self._finish(p, w, new, text)
        lp = pick.content(mem.tokenizer, len(new)) if isinstance(pick, Logprobs) else None
        choices = [{"text": text, "finish_reason": finish, "logprobs": lp}] + [c for c, _ in extra]
        return {"text": text, "finish_reason": finish, "prompt_tokens": w.window or len(w.ids),
                "completion_tokens": len(new) + sum(n for _, n in extra), "cached_tokens": w.cached,
                "kvmemory": w.memory, "ttft_s": first[0] if first else None, "logprobs": lp, "choices": choices}

    def _pick(self, p: ChatParams, w: Prepared, i: int):
        """Choice i's pick: its sampler (seed + i), constrained to the schema, guarded where remembered turns
        were recalled (ChatMemory.guard), recording logprobs, as asked."""
        pick = sampler(p.temperature, p.top_p, None if p.seed is None else p.seed + i, **p.sampling,
                       **({"prompt": w.ids} if "repetition_penalty" in p.sampling else {}))
        if p.schema is not None:
            pick = self.grammars().constrain(pick, p.schema)
        if w.guard:                    # turns were recalled: the reply does not open as one reads (guard.py)
            pick = Guard(self.mem.tokenizer, pick)
        if p.logprobs is not None:
            pick = Logprobs(pick, p.logprobs)
        return pick

    def _others(self, p: ChatParams, w: Prepared):
        """Choices 1..n-1 started now, each on a thread of its own from a copy of the window (before the
        first choice's decoding writes it): in a batcher they join the shared decode loop beside choice 0;
        alone they decode one after the other once joined. Returns join() -> [(choice, tokens)]."""
        import threading as th

        from kvmemory import batching
        mem, b = self.mem, batching.current()
        n_ctx = w.cache.get_seq_length()
        copies = [kvops.make_cache(kvops.cache_slice(w.cache, 0, n_ctx) if n_ctx else None, mem.model.config)
                  for _ in range(p.n - 1)]
        out: list = [None] * (p.n - 1)

        def decode(i: int) -> None:
            if b is not None:
                batching.serving(b)
            try:
                pick = self._pick(p, w, i + 1)
                s = TextStream(mem.tokenizer, p.stop)
                new = greedy(mem.model, copies[i], w.logits, p.max_tokens, mem.eos_ids, on_token=s, pick=pick,
                             feed=w.feed)
                text = s.finish(new)
                lp = pick.content(mem.tokenizer, len(new)) if isinstance(pick, Logprobs) else None
                out[i] = ({"text": text, "finish_reason": "stop" if s.stopped or len(new) < p.max_tokens else "length",
                           "logprobs": lp}, len(new))
            except BaseException as e:     # noqa: BLE001 -- raised again on the request's thread
                out[i] = e
        if b is None:
            def one_by_one():
                for i in range(p.n - 1):
                    decode(i)
                return _results(out)
            return one_by_one
        threads = [th.Thread(target=decode, args=(i,), daemon=True) for i in range(p.n - 1)]
        for t in threads:
            t.start()

        def join():
            # the request's hold on the Memory's lock let go while it waits: the decode loop takes it for
            # every step, and a choice still decoding after choice 0 has finished needs those steps
            with batching.let_go(mem.exclusive()):
                for t in threads:
                    t.join()
            return _results(out)
        return join

    def _finish(self, p: ChatParams, w: Prepared, new: list[int], text: str | None, save: bool = True) -> None:
        """After a reply: the conversation with it saved, computed canonically (without what was
        recalled), so the next turn restores it; the exchange remembered (with a user); the session's
        record. save=False: the turn recorded without that save (deferred: `_saved` adds it)."""
        mem = self.mem
        with mem.exclusive(), torch.inference_mode():
            state = mem.save(w.ids + new, label=w.label or "kvmemory:chat", owner=w.owner) \
                if save else None
            if p.user is not None:
                remember(mem, p, text)
        if p.session:
            self.sessions.record(session_record(p), w.states + ([state.id] if state is not None else []),
                                 state.n_tokens if state is not None else len(w.ids) + len(new), w.recalled,
                                 user=p.user)

    def _defer(self, key: str | None, job: tuple) -> None:
        """List a request's deferred save (key: its session's record; None: a request without a
        session, whose save no next turn folds). At most MAX_DEFERRED wait: past that the oldest of
        a request without a session is dropped (a cache of what a next request would compute)."""
        if key is None:
            self._anon += 1
            key = f"{ANON}{self._anon}"
        self.later[key] = job
        while len(self.later) > MAX_DEFERRED:
            old = next((k for k in self.later if k.startswith(ANON)), None)
            if old is None or self.later.pop(old, None) is None:
                break
            self.dropped += 1

    def _saved(self, key: str, job: tuple) -> None:
        """A deferred save run (under the Memory's lock, so a session being forgotten sees its
        state) and added to the turn's record: the conversation with its reply up to what a later
        turn restores (`restorable`), nothing when that is no more than its prompt saved (a partial
        last forward would be a row no continuing turn reads: 12 MB for a 256-token block of the
        default model)."""
        p, w, new = job
        conv = w.ids + new
        cut = self.restorable(len(conv))
        if cut <= self.saved_part(len(w.ids)):
            return
        state = self.mem.save(conv[:cut], label="kvmemory:chat")
        if p.session:
            self.sessions.add_state(key, state.id)

    def _fold(self, key: str, ids: list[int] | None) -> None:
        """A session's deferred save before its next turn (ids: that turn's prompt), which makes it
        moot either way: where the prompt extends the conversation with the reply, this turn saves
        it; where it does not (the client trimmed or edited its history), no turn of the session
        continues that conversation. The session's record is kept in both cases. A turn whose
        prompt is not known here (ids None: a user's memory window) runs the save now."""
        job = self.later.pop(key, None)
        if job is None:
            return
        if ids is None:
            with self.mem.exclusive(), torch.inference_mode():
                self._saved(key, job)
            return
        done = job[1].ids + job[2]
        if not (ids[:len(done)] == done and len(ids) > len(done)):
            self.dropped += 1

    def take(self, key: str):
        """A session's deferred save, removed (its session is being forgotten), or None (dict.pop is
        atomic: no lock, so the event loop never waits for the model)."""
        return self.later.pop(key, None)

    def idle(self) -> bool:
        """Nothing admitted, and nothing finished for IDLE_GRACE_S: a deferred save may run."""
        return self.pending() == 0 and time.monotonic() - self.released() >= IDLE_GRACE_S

    def flush(self, all_: bool = False) -> int:
        """Run the deferred saves while the server is idle (all_: every one, as at shutdown). Returns
        how many ran."""
        n = 0
        while self.later and (all_ or self.idle()):
            with self.mem.exclusive():
                if not self.later:
                    break
                key = next(iter(self.later))
                try:
                    with torch.inference_mode():
                        self._saved(key, self.later[key])
                except Exception as e:       # noqa: BLE001 -- a cache's save: reported, never fatal
                    self.failed += 1
                    log.warning("a deferred save of %s failed (the next turn computes its tokens): %s: %s",
                                "a request" if key.startswith(ANON) else f"session {key!r}", type(e).__name__, e)
                self.later.pop(key, None)         # last: while it is listed, its save is not done
            n += 1
        return n


def _results(out: list) -> list:
    for r in out:
        if isinstance(r, BaseException):
            raise r
    return out
