"""The verified-solution library: solved problems kept as exact KV states and grafted into later
contexts as worked examples (Memory.learn / Memory.solve).

    entry   a problem, its solution (ending "Answer: X"), the extracted answer, whether a verifier
            passed it, and the state that holds its KV: the library prelude (a fixed system
            message) followed by the solved example (user: problem, assistant: solution).
    solve   the k nearest verified entries by problem text (MiniLM + FAISS inner product) are
            grafted into a window: the prelude and the first example at their stored positions
            (exact: the bytes of its state), the next examples re-rotated to follow it (as ask
            does with blocks); only the new problem is prefilled. A problem already in the
            library restores its verified state through its answer and decodes one token (end of turn).

Entries live in STORE/library/ as write-once JSON files, <state id>.verified.json or
<state id>.unverified.json, written after the state's commit (a crash in between leaves an
unreferenced state, never an entry without KV).
"""

from __future__ import annotations

import json
import re
import threading
import time
import unicodedata
from collections.abc import Callable, Collection
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from kvmemory import prompts
from kvmemory.decode import sampler
from kvmemory.options import check_recompute
from kvmemory.errors import (InputError, StateNotFoundError, StoreCorruptError, StoreExistsError,
                             VerificationError, WindowExceededError)
from kvmemory.pager.pager import FetchStats
from kvmemory.runtime import Runtime

SYSTEM = ("You solve problems step by step. Show the steps briefly, then give the final answer on its own "
          "line as 'Answer: <answer>'.")
ANSWER_MARK = "Answer:"
LIBRARY_DIR = "library"
FORMAT_VERSION = 1


@dataclass
class Entry:
    entry_id: str            # the id of the state holding its KV
    problem: str
    solution: str
    answer: str | None
    verified: bool
    verifier: str            # the verifier's name ("" when verify=None)
    n_tokens: int
    created: float = 0.0
    version: int = FORMAT_VERSION


@dataclass
class Solution:
    text: str
    answer: str | None
    verified: bool | None                      # None: no verifier was given
    sources: list[str] = field(default_factory=list)   # entry ids of the grafted examples, window order
    stats: dict = field(default_factory=dict)
    learned: Entry | None = None               # the entry this solve added to the library
    first_logits: torch.Tensor | None = field(default=None, repr=False)   # [vocab] of the first decoded token


# ------------------------------------------------------------------ answers and verifiers
_NUM = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def extract_answer(text: str) -> str | None:
    """The final answer of a solution: what follows the last 'Answer:' (first line of it), else
    the last number in the text, else None."""
    i = text.rfind(ANSWER_MARK)
    if i >= 0:
        ans = text[i + len(ANSWER_MARK):].strip().splitlines()
        if ans and ans[0].strip():
            return ans[0].strip().rstrip(".").strip()
    nums = _NUM.findall(text)
    return nums[-1] if nums else None


def normalize_answer(a: str | None) -> str:
    """Comparable form of an answer: NFKC, case-folded, spaces collapsed, surrounding quotes and
    final punctuation dropped, numbers canonical (1,000.50 -> 1000.5)."""
    if a is None:
        return ""
    s = unicodedata.normalize("NFKC", a).strip().casefold()
    s = re.sub(r"\s+", " ", s).strip(" '\"`*$").rstrip(".!,;:").strip(" '\"`*$")
    if re.fullmatch(r"-?\d[\d,]*(?:\.\d+)?", s):
        v = float(s.replace(",", ""))
        s = str(int(v)) if v == int(v) else repr(v)
    return s


def answer_is(expected) -> Callable[[str], bool]:
    """A verifier: the solution's final answer (extract_answer) is `expected`. A numeric expected
    answer is compared with the first number of the final answer ("84 jars" is 84); a text one
    must equal it or begin it up to a word boundary ("April 6, 2025" is "April 6"), after
    normalize_answer on both."""
    want = normalize_answer(str(expected))
    numeric = re.fullmatch(r"-?\d+(?:\.\d+)?", want) is not None

    def verify(solution: str) -> bool:
        got = normalize_answer(extract_answer(solution))
        if numeric:
            m = _NUM.search(got)
            return m is not None and normalize_answer(m.group(0)) == want
        return got == want or (got.startswith(want) and not got[len(want)].isalnum())
    verify.__name__ = f"answer={expected}"
    return verify


VERIFIERS: dict[str, Callable[[str], Callable[[str], bool]]] = {"answer": answer_is}
_REG_LOCK = threading.Lock()


def register_verifier(name: str, factory: Callable[[str], Callable[[str], bool]]) -> None:
    """Name a verifier family: verify="name:ARG" builds factory(ARG), a callable(solution) -> bool."""
    if not re.fullmatch(r"[a-z][a-z0-9_-]*", name or ""):
        raise InputError(f"a verifier name is lowercase letters, digits, - and _, got {name!r}")
    with _REG_LOCK:
        VERIFIERS[name] = factory


def resolve_verifier(verify) -> tuple[Callable[[str], bool] | None, str]:
    """(callable, name) of a verify argument: None, a callable(solution) -> bool, or "name:ARG"."""
    if verify is None:
        return None, ""
    if callable(verify):
        return verify, getattr(verify, "__name__", type(verify).__name__)
    if isinstance(verify, str) and ":" in verify:
        name, arg = verify.split(":", 1)
        if name in VERIFIERS:
            return VERIFIERS[name](arg), verify
    raise InputError(f"verify must be None, a callable(solution) -> bool or 'name:ARG' with name in "
                     f"{sorted(VERIFIERS)}, got {verify!r}")


def run_verifier(fn: Callable[[str], bool], solution: str) -> bool:
    ok = fn(solution)
    if not isinstance(ok, (bool, np.bool_)):
        raise InputError(f"a verifier must return True or False, got {ok!r}")
    return bool(ok)


def problem_key(problem: str) -> str:
    """Identity of a problem: NFKC, whitespace collapsed, case kept (case can matter in a problem)."""
    return re.sub(r"\s+", " ", unicodedata.normalize("NFKC", problem)).strip()


# ------------------------------------------------------------------ the library
class Library:
    """The solved examples of one Memory (its store's library/ directory)."""

    def __init__(self, rt: Runtime) -> None:
        self.rt = rt
        self.dir = LIBRARY_DIR                        # under the store: a directory or an object-store prefix
        self._entries: dict[str, Entry] = {}
        self._vecs: dict[str, np.ndarray] = {}
        self._index: tuple | None = None             # (entry ids, faiss index) of the last verified pool
        self._prelude: list[int] | None = None
        # verified states of recently used entries, in host RAM (a quarter of the pager's budget):
        # an entry's state is immutable (its id is the hash of its tokens), so a copy read and
        # digest-checked once serves every later solve without another store round trip
        from kvmemory.pager.lru import LRUTier
        self.states = LRUTier("library", rt.config.host_cache_bytes // 4)

    # ---- prompt pieces (token ids)
    @property
    def prelude_ids(self) -> list[int]:
        if self._prelude is None:
            self._prelude = self.rt.tokenize(prompts.system_text(self.rt.tokenizer, SYSTEM))
        return self._prelude

    def turn_ids(self, problem: str, solution: str | None = None) -> list[int]:
        """The tokens of one solved example after the prelude (user turn + assistant's solution and
        end of turn), or with solution None the user turn and the assistant's opening."""
        return self.rt.tokenize(prompts.turn_text(self.rt.tokenizer, problem, solution, system=SYSTEM))

    # ---- entries
    def refresh(self) -> None:
        """Read entries written since the last refresh (by this or another process). An entry's
        file is <state id>.verified.json or <state id>.unverified.json, each written once; where
        both exist (learned unverified, later verified) the verified one counts."""
        files = self.rt.store().files
        for name in files.list(self.dir):
            if not name.endswith(".json"):
                continue
            sid, _, kind = name.removesuffix(".json").partition(".")
            if kind not in ("verified", "unverified"):
                continue
            have = self._entries.get(sid)
            if have is not None and (have.verified or kind == "unverified"):
                continue
            p = f"{files.describe()}/{self.dir}/{name}"
            try:
                e = Entry(**json.loads(files.read(f"{self.dir}/{name}")))
            except (ValueError, TypeError) as exc:
                raise StoreCorruptError(f"library entry {p} cannot be read: {exc}") from None
            if e.entry_id != sid or e.verified != (kind == "verified"):
                raise StoreCorruptError(f"library entry {p} does not match its name")
            self._entries[sid] = e

    def entries(self, refresh: bool = True) -> list[Entry]:
        if refresh:
            self.refresh()
        return sorted(self._entries.values(), key=lambda e: (e.created, e.entry_id))

    def find(self, problem: str, refresh: bool = True) -> Entry | None:
        """The verified entry of this exact problem (normalised whitespace), newest first."""
        key = problem_key(problem)
        hits = [e for e in self.entries(refresh) if e.verified and problem_key(e.problem) == key]
        return hits[-1] if hits else None

    def learn(self, problem: str, solution: str, verify=None) -> Entry:
        for name, v in (("problem", problem), ("solution", solution)):
            if not isinstance(v, str) or not v.strip():
                raise InputError(f"the {name} must be non-empty text")
        fn, vname = resolve_verifier(verify)
        answer = extract_answer(solution)
        if ANSWER_MARK not in solution and answer is not None:
            # the stored form always ends with its answer line: a repeated problem is answered by
            # restoring the state up to it, and worked examples show the format
            solution = f"{solution.rstrip()}\n{ANSWER_MARK} {answer}"
        verified = False
        if fn is not None:
            if not run_verifier(fn, solution):
                raise VerificationError(f"the solution fails its verifier {vname}; nothing was stored")
            verified = True
        ids = self.prelude_ids + self.turn_ids(problem, solution)
        st = self.rt.save(ids, label=f"library: {problem_key(problem)[:60]}")
        self.refresh()
        if st.id in self._entries:                       # the same problem and solution, learned before
            old = self._entries[st.id]
            if old.verified or not verified:
                return old
        e = Entry(st.id, problem, solution, extract_answer(solution), verified, vname, len(ids), time.time())
        key = f"{self.dir}/{st.id}.{'verified' if verified else 'unverified'}.json"
        try:
            self.rt.store().files.create(key, json.dumps(asdict(e), sort_keys=True).encode())
        except StoreExistsError:                         # a concurrent learn of the same entry
            self.refresh()
            return self._entries[st.id]
        self._entries[e.entry_id] = e
        return e

    # ---- selection
    def _vector(self, e: Entry) -> np.ndarray:
        v = self._vecs.get(e.entry_id)
        if v is None:
            from kvmemory.index.embedder import shared_embedder
            v = self._vecs[e.entry_id] = shared_embedder().embed([e.problem])[0]
        return v

    def nearest(self, problem: str, k: int, exclude: Collection[str] = frozenset(),
                refresh: bool = True) -> list[tuple[Entry, float]]:
        """The k verified entries whose problems are nearest to `problem` (cosine of MiniLM
        embeddings, exact search with FAISS), best first."""
        import faiss

        from kvmemory.index.embedder import shared_embedder
        pool = [e for e in self.entries(refresh) if e.verified and e.entry_id not in exclude]
        if not pool or k < 1:
            return []
        key = tuple(e.entry_id for e in pool)
        if self._index is None or self._index[0] != key:
            index = faiss.IndexFlatIP(384)
            index.add(np.stack([self._vector(e) for e in pool]).astype(np.float32))
            self._index = (key, index)
        q = shared_embedder().embed([problem]).astype(np.float32)
        scores, idx = self._index[1].search(q, min(k, len(pool)))
        return [(pool[int(i)], float(s)) for s, i in zip(scores[0], idx[0]) if i >= 0]

    # ---- the window of worked examples
    def state(self, entry_id: str):
        """The verified state of an entry: from the host-RAM tier, or a verified read of the store
        (then kept). A state that was forgotten from the store is not served from RAM either."""
        st = self.states.get(entry_id)
        if st is None or entry_id not in self.rt.store().manifest.states:
            st = self.rt.load(entry_id)
            self.states.put(entry_id, st, st.kv.numel() * st.kv.element_size())
        return st

    def window_kv(self, chosen: list[Entry]) -> tuple[torch.Tensor, list[int], int, FetchStats]:
        """KV of prelude + the chosen examples in order: [L, 2, H, T, D], their token ids, how many
        leading tokens are exact (the first example's state, at its own positions), and where the
        blocks came from. Each example's blocks come through the pager (verified, kept in its host
        tier); the examples after the first are re-rotated to follow the one before (graft.assemble)."""
        from kvmemory.graft import assemble, chain_pieces
        store = self.rt.store()
        P = len(self.prelude_ids)
        C = store.manifest.block_tokens
        pieces: list = []
        ids: list[int] = []
        exact = 0
        chains = []
        for e in chosen:
            entry = store.manifest.states.get(e.entry_id)
            if entry is None:
                raise StateNotFoundError(f"library entry {e.entry_id}: its state is no longer in the store")
            chains.append(store.chain(entry.last_row))
        meta = store.verified_meta([r for rows in chains for r in rows])     # one verified read for all
        at = 0
        for i, (e, rows) in enumerate(zip(chosen, chains)):
            n = [int(x) for x in meta["n_tokens"][at:at + len(rows)]]
            toks = [int(t) for k, row in zip(n, meta["tokens"][at:at + len(rows)]) for t in row[:k]]
            at += len(rows)
            if toks[:P] != self.prelude_ids:
                raise StoreCorruptError(f"library entry {e.entry_id} does not start with the library prelude")
            start = 0 if i == 0 else P
            pieces += chain_pieces(rows, n, C, start, len(ids))
            ids += toks[start:]
            if i == 0:
                exact = len(toks)
        g = self.rt.geometry
        head = torch.empty((g.layers, 2, g.kv_heads, 0, g.head_dim), dtype=self.rt.kv_dtype)
        kv, fetch = assemble(self.rt, head, pieces)
        return kv, ids, exact, fetch


# ------------------------------------------------------------------ solve
@torch.inference_mode()
def solve(rt: Runtime, lib: Library, problem: str, verify=None, k: int = 3, attempts: int = 1, max_new_tokens: int = 256,
          temperature: float = 0.7, seed: int = 0, examples_as: str = "kv", learn: bool = True,
          reuse: bool = True, recompute: float = 0.0) -> Solution:
    from kvmemory import graft, kv as kvops
    from kvmemory.decode import greedy
    from kvmemory.device import ids_tensor, to_model

    if not isinstance(problem, str) or not problem.strip():
        raise InputError("the problem is empty")
    for name, v in (("k", k), ("attempts", attempts), ("max_new_tokens", max_new_tokens)):
        if not isinstance(v, int) or isinstance(v, bool) or v < (0 if name == "k" else 1):
            raise InputError(f"{name} must be an integer >= {0 if name == 'k' else 1}, got {v!r}")
    if not isinstance(temperature, (int, float)) or temperature <= 0:
        raise InputError(f"temperature must be > 0, got {temperature!r}")
    if examples_as not in ("kv", "text"):
        raise InputError(f"examples_as must be 'kv' or 'text', got {examples_as!r}")
    check_recompute(recompute)
    fn, vname = resolve_verifier(verify)
    t0 = time.perf_counter()
    model = rt.model

    # ---- a problem already solved: restore its verified state through the answer line, feed its
    # last token, decode one token (the model, at the end of its own verified solution, should end
    # the turn). The answer is the stored verified one: nothing is recomputed.
    lib.refresh()                                  # once per solve (on S3 a LIST): find and nearest use it
    ram0 = lib.states.stats.hits
    hit = lib.find(problem, refresh=False) if reuse else None
    if hit is not None:
        st = lib.state(hit.entry_id)
        P_turn = len(lib.prelude_ids) + len(lib.turn_ids(hit.problem, None))
        ends = [i for i in range(P_turn, st.n_tokens) if st.token_ids[i] in rt.eos_ids]
        cut = (ends[0] if ends else st.n_tokens) - 1           # the last token of the solution
        if cut > P_turn:
            # views of the verified state (copy=False): the model's updates concatenate, never write in place
            cache = kvops.make_cache(to_model(st.kv[:, :, :, :cut], model), model.config, copy=False)
            logits = kvops.last_logits(model, ids_tensor(st.token_ids[cut:cut + 1], model), cache)
            ttft = time.perf_counter() - t0
            nxt = int(logits.argmax())
            text = hit.solution
            ok = run_verifier(fn, text) if fn is not None else None
            if ok is not False:
                return Solution(text, extract_answer(text), ok if fn is not None else hit.verified, [hit.entry_id], {
                    "repeated": True, "answer_from": "library", "model_ends_turn": nxt in rt.eos_ids,
                    "tokens_restored": cut, "tokens_prefilled": 1, "tokens_decoded": 1, "tokens_exact": cut,
                    "states_from_ram": lib.states.stats.hits - ram0,
                    "attempts": 1, "examples": 1, "verifier": vname,
                    "timings_s": {"ttft": ttft, "total": time.perf_counter() - t0}},
                    first_logits=logits.float().cpu())

    # ---- worked examples: the k nearest verified solutions, best last (nearest the problem)
    q_ids = lib.turn_ids(problem, None)
    room = rt.geometry.max_positions - len(q_ids) - max_new_tokens
    if len(lib.prelude_ids) > room:
        raise WindowExceededError(f"the problem is {len(q_ids)} tokens; with the prelude and {max_new_tokens} "
                                  f"answer tokens it does not fit the model's window")
    chosen = [e for e, _ in lib.nearest(problem, k, refresh=False)][::-1]
    while chosen and len(lib.prelude_ids) + sum(e.n_tokens - len(lib.prelude_ids) for e in chosen) > room:
        chosen = chosen[1:]                                        # drop the farthest first
    t = time.perf_counter()
    kv, fetch = None, None
    if chosen and examples_as == "kv":
        kv, ctx_ids, exact, fetch = lib.window_kv(chosen)
        restored, rerotated = len(ctx_ids), len(ctx_ids) - exact
        prefill = q_ids
    else:
        ctx_ids = list(lib.prelude_ids)                 # the same tokens as text: nothing read from the store
        for e in chosen:
            ctx_ids += lib.turn_ids(e.problem, e.solution)
        restored, rerotated, exact = 0, 0, 0
        prefill = ctx_ids + q_ids
    graft_s = time.perf_counter() - t
    # the examples after the first never saw each other: recompute=r recomputes the tokens that
    # deviate most; else the problem is prefilled the canonical way over the window as it stands
    # (a fresh tensor of its own: the cache may start as views of it)
    tail = graft.prefill_tail(rt, kv, prefill, recompute=recompute if rerotated > 0 else 0.0,
                              ctx_ids=lambda: ctx_ids, exact_tokens=exact, copy=False, chunked=True)
    cache, recomputed = tail.cache, tail.recomputed
    logits = tail.logits
    assert logits is not None                          # not a batched tail: the prefill's own logits
    ttft = time.perf_counter() - t0
    # every attempt starts from the same prefilled KV (a copy; the first may use it in place)
    snapshot = kvops.cache_slice(cache, 0, restored + len(prefill)) if attempts > 1 else None
    decoded, text, ok, learned = 0, "", None, None
    for a in range(attempts):
        run_cache = cache if a == 0 and snapshot is None else kvops.make_cache(snapshot, model.config)
        pick = None if a == 0 else sampler(float(temperature), seed=seed + a)
        new = greedy(model, run_cache, logits, max_new_tokens, rt.eos_ids, pick=pick)
        decoded += len(new)
        text = rt.tokenizer.decode(new, skip_special_tokens=True).strip()
        if fn is None:
            break
        ok = bool(text) and run_verifier(fn, text)          # an empty answer is never verified
        if ok:
            break
    learn_skipped = None
    if ok and learn:
        if rt.store().read_only:
            learn_skipped = "the store is read-only"
        else:
            learned = lib.learn(problem, text, fn)
    return Solution(text, extract_answer(text), ok, [e.entry_id for e in chosen], {
        "repeated": False, "examples": len(chosen), "examples_as": examples_as, "attempts": a + 1,
        "tokens_restored": restored, "tokens_exact": exact, "tokens_rerotated": rerotated,
        "states_from_ram": lib.states.stats.hits - ram0,
        "blocks_from": {"gpu": fetch.from_gpu, "host": fetch.from_host, "disk": fetch.from_disk} if fetch else None,
        "tokens_recomputed": recomputed,
        "tokens_prefilled": len(prefill), "tokens_decoded": decoded, "verifier": vname, "learn_skipped": learn_skipped,
        "timings_s": {"graft": graft_s, "ttft": ttft, "total": time.perf_counter() - t0}}, learned,
        logits.float().cpu())
