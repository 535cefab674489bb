"""Memory: the public entry point, a thin facade. It opens (or creates) a store, loads the model
whose KV it holds, and wires the rooms that do the work:

    states.py     save / load / resolve / forget / verify with recompute
    documents.py  deposit, index, remove; ask.py and retrieve.py: select, graft, answer
    library.py    the verified-solution library (learn / solve)
    decode.py     the decode loop; prompts.py: every chat-template prompt
"""

from __future__ import annotations

import functools
import os

import torch

from kvmemory import kv as kvops, prompts
from kvmemory.config import RuntimeConfig, StoreConfig, from_env
from kvmemory.decode import greedy
from kvmemory.device import ids_tensor
from kvmemory.errors import InputError
from kvmemory.model import fingerprint, geometry, load_model
from kvmemory.model import half, invariant as invariant_ops
from kvmemory.opening import open_or_create
from kvmemory.options import AskOptions
from kvmemory.progress import bar as _bar
from kvmemory.runtime import MAKE_WAY_S, Runtime, StoreHandle
from kvmemory.states import State, StateInfo, States
from kvmemory.store import BlockStore
from kvmemory.store.info import describe
from kvmemory.store.location import locate
from kvmemory.threads import ModelLock, release as release_team

__all__ = ["MAKE_WAY_S", "Memory", "State", "StateInfo"]


def _locked(method):
    """Run a Memory method under the Memory's lock: one operation at a time per Memory."""
    @functools.wraps(method)
    def run(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)
    return run


class Memory:
    """A KV memory store bound to one model.

    Memory(path) opens the store at `path` or creates it (an empty or missing directory),
    with the embedded default model. `model` may be a local transformers directory, a .gguf file
    (dequantized to float32 once, cached), a Hugging Face Hub id in the local cache (never
    downloaded), a loaded model (with `tokenizer=`) or a (model, tokenizer) tuple; one the engine
    cannot keep exact (kvmemory/model/families.py) raises ModelLoadError with the reason. `device`:
    "cpu", "cuda", "cuda:N", "auto" (default env KVMEMORY_DEVICE, else cpu). Opening a store
    written by a model with another fingerprint raises ModelMismatchError. A store whose
    directory is not writable, or `read_only=True`, opens read-only: writes raise
    StoreReadOnlyError. Use as a context manager or call close().

    segment_blocks: blocks per deposit segment for add() (default 4: 1,024 tokens).

    invariant: compute with the invariant kernels (kvmemory/model/invariant.py; default: env
    KVMEMORY_INVARIANT, else off): every output row reduced the same way whatever the chunking, the
    batch or the thread count, so a restored state continues bit for bit like one plain forward
    pass, and batched decoding like decoding alone. Installed into the model in place (a loaded
    model passed in is changed). The mode is part of the fingerprint: a store is written by one
    mode only, and opening it with the other raises ModelMismatchError.

    dtype: what a model loaded from disk computes in, a torch dtype or its name (default: env
    KVMEMORY_DTYPE, else float32); torch.bfloat16 is ~2.5x faster to prefill and ~1.8x to decode
    the default model on a CPU with AVX-512 BF16, and its KV takes half the bytes
    (docs/concepts/precision.md). Part of the fingerprint, like the mode: a store's blocks are exact against its own
    dtype's computation, and a store of another dtype raises ModelMismatchError. A loaded model
    passed in computes in its own dtype (a different `dtype` raises InputError).

    `path` may be an object-store location, "s3://bucket/prefix": the store lives there (any
    S3-compatible service; endpoint, credentials and region from the AWS_* environment
    variables or `storage_options`), with the same digest checks and atomic commits; a local
    working directory (`work_dir`, default under the user cache directory) holds its disk
    cache tier (a byte budget: `store_cache_bytes`, env KVMEMORY_STORE_CACHE_BYTES) and the
    derived selection indexes.

    A Memory may be shared between threads: its operations run one at a time (the model and the
    store's caches are not reentrant); other processes may read and write the same store.
    """

    def __init__(self, path, model=None, *, tokenizer=None, store_config: StoreConfig | None = None,
                 read_only: bool = False, lock_timeout_s: float | None = None, cache_dir=None,
                 dtype: torch.dtype | None = None, segment_blocks: int | None = None,
                 storage_options: dict | None = None, work_dir=None, store_cache_bytes: int | None = None,
                 invariant: bool | None = None, device: str | None = None, encrypt: bool | None = None,
                 keys=None) -> None:
        if segment_blocks is not None and (isinstance(segment_blocks, bool) or not isinstance(segment_blocks, int)
                                           or segment_blocks < 1):
            raise InputError(f"segment_blocks must be an integer >= 1, got {segment_blocks!r}")
        self._lock = ModelLock()          # its holder is the only thread with an OpenMP team (kvmemory/threads.py)
        if isinstance(dtype, torch.dtype):
            dtype = str(dtype).removeprefix("torch.")  # type: ignore[assignment]
        if dtype is not None and not isinstance(dtype, str):
            raise InputError(f"dtype must be a torch dtype or its name, got {dtype!r}")
        self.runtime = from_env(RuntimeConfig, lock_timeout_s=lock_timeout_s, cache_dir=cache_dir,
                                store_cache_bytes=store_cache_bytes, invariant=invariant, dtype=dtype,
                                device=device)
        # where the store is, before the model loads: a bad path or URL fails in milliseconds
        loc = locate(path, must_exist=read_only, storage_options=storage_options, work_dir=work_dir)
        self.location, self.path = loc.name, loc.root
        if loc.remote:
            self.path.mkdir(parents=True, exist_ok=True)
        elif loc.exists and not read_only and not os.access(self.path, os.W_OK):
            read_only = True
        want = self.runtime.dtype
        self.model, self.tokenizer, self.model_name = load_model(
            model, tokenizer=tokenizer, cache_dir=self.runtime.resolved_cache_dir(),
            dtype=getattr(torch, want) if want else None, device=self.runtime.device)
        if dtype is not None and (got := geometry(self.model).dtype) != dtype:
            raise InputError(f"dtype={dtype} was asked for, but the model passed in computes in {got}: "
                             f"convert it (model.to(torch.{dtype})) or leave dtype out")
        if self.runtime.invariant:
            invariant_ops.install(self.model)
        else:
            half.install(self.model)      # a bf16/fp16 model on CPU: its attention in float32 (fast, exact)
        self.geometry = geometry(self.model)
        self.fingerprint = fingerprint(self.model)
        store = open_or_create(loc, self.model, self.model_name, self.geometry, self.fingerprint, self.runtime,
                               read_only, store_config, encrypt, keys)
        self.fingerprint = store.manifest.fingerprint     # the model's, or derived (a prefill_tokens store)
        kv_dtype = getattr(torch, self.geometry.dtype)
        handle = StoreHandle(store, self.location, kv_dtype, self.runtime, self.model.device)
        self.states_room = States(handle.require, self.model, self.tokenizer, self.fingerprint, self.geometry,
                                  kv_dtype, self.location)
        self.rt = Runtime(model=self.model, tokenizer=self.tokenizer, geometry=self.geometry, kv_dtype=kv_dtype,
                          fingerprint=self.fingerprint, location=self.location, path=self.path, config=self.runtime,
                          lock=self._lock, handle=handle, states=self.states_room)
        self._documents = None
        self._library = None
        self._scopes = None
        self._segment_blocks = segment_blocks
        release_team()                    # the loading thread's OpenMP team (a server serves from others)

    # ------------------------------------------------------------------ lifecycle
    @_locked
    def close(self) -> None:
        self.rt.handle.close()
        self._scopes = None
        self._documents = None
        self._library = None

    def __enter__(self) -> "Memory":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def store(self) -> BlockStore | None:
        """The open BlockStore (None once closed)."""
        return self.rt.handle.store

    @property
    def pager(self):
        """The tiered pager (host RAM LRU, GPU pool when the model is on CUDA) over this store."""
        with self._lock:
            return self.rt.pager

    def exclusive(self):
        """The Memory's lock (re-entrant): hold it to run several operations, or direct use of
        self.model, with no other thread's operation in between."""
        return self._lock

    def defer_to(self, busy) -> None:
        """Make the calling thread's deposits give way: between two blocks, while busy() is true
        (other work waits for the model: the server's requests), the deposit lets go of the model
        and waits, at most MAKE_WAY_S a block, so a question asked during a long deposit waits for
        one block, not the document. busy=None: this thread deposits without pausing."""
        self.rt.deferral.set(busy)

    def make_way(self) -> float:
        """A deposit's pause point (between blocks): see defer_to. Returns the seconds it waited."""
        return self.rt.make_way()

    def forget_blocks(self, rows) -> None:
        """Drop rows from the pager's caches (after their document was removed)."""
        self.rt.forget_blocks(rows)

    @property
    def kv_dtype(self) -> torch.dtype:
        """The torch dtype of this model's KV (and of the store's blocks)."""
        return self.rt.kv_dtype

    @property
    def eos_ids(self) -> set[int]:
        """Token ids that end a generated answer."""
        return self.rt.eos_ids

    @property
    def documents(self):
        with self._lock:
            return self._documents_unlocked()

    def _documents_unlocked(self):
        if self._documents is None:
            from kvmemory.documents import SEGMENT_BLOCKS, Documents
            self._documents = Documents(self.rt, segment_blocks=self._segment_blocks or SEGMENT_BLOCKS)
        return self._documents

    # ------------------------------------------------------------------ documents
    @_locked
    def add(self, text, doc_id: str | None = None, progress: bool = False, source: str = ""):
        """Deposit a long document: prefill it once (segment by segment), store its blocks, index them.

        text: str or UTF-8 bytes. doc_id: defaults to a hash of the text's tokens. Returns DocInfo.
        Atomic: the document becomes visible only once complete; a re-run resumes an interrupted add.
        progress: True for a tqdm bar on a terminal, or an object with a `total` attribute and
        `update(n_tokens)` that the deposit drives.
        """
        self.require_store()
        if not isinstance(progress, bool) and progress is not None:
            return self.documents.add(text, doc_id, source=source, progress=progress)
        bar = _bar(progress, desc=f"add {doc_id or source or 'document'}")
        try:
            return self.documents.add(text, doc_id, source=source, progress=bar)
        finally:
            if bar is not None:
                bar.close()

    @_locked
    def add_files(self, paths, progress: bool = False) -> list:
        """Deposit files; each file's name is its doc id. Checks every file before adding any."""
        from kvmemory.documents import read_files
        paths, blobs = read_files(paths)
        for p in paths:
            if p.name in self.require_store().manifest.docs:
                raise InputError(f"document {p.name!r} already exists; remove it first")
        return [self.add(b, doc_id=p.name, progress=progress, source=str(p)) for p, b in zip(paths, blobs)]

    @_locked
    def ask(self, question: str, options: AskOptions | None = None, *, on_token=None, doc_filter=None, **changes):
        """Answer a question from the deposited documents. Returns Answer(text, sources, stats).

        Ranks blocks (MiniLM windows + BM25 fused by reciprocal rank, by default), re-ranks the
        contenders by the question's likelihood over their stored KV, grafts the best into a
        fixed-size window in document order, each with the blocks before it in its deposit segment,
        and decodes greedily. `options` (kvmemory.AskOptions, default AskOptions()) says how; keyword
        `changes` override single options (ask(q, top_k=3, rerank=0)); every option and its default
        is documented on AskOptions. With the model on CUDA, blocks are gathered by the
        gather_blocks kernel and, without recompute, attention runs kvmemory's window_attention op.
        on_token(text_delta), if given, receives the answer as it is decoded (streaming); returning
        True from it stops the decoding there. doc_filter(doc_id) -> bool, if given, limits
        selection to the documents it accepts.
        """
        from kvmemory.ask import ask
        opts = (options or AskOptions()).but(**changes)
        return ask(self.rt, self.documents, question, opts, on_token=on_token, doc_filter=doc_filter)

    def passages(self, answer) -> list[dict]:
        """What an Answer grafted, as text: one dict per run of answer.sources (doc_id, start_token,
        end_token, score, text), window order."""
        from kvmemory.ask import passages
        return passages(self.rt, answer)

    @_locked
    def retrieve(self, question: str, k: int = 4, selector: str = "text", doc_filter=None) -> list[dict]:
        """The blocks ask(rerank=0) would select, without generating: [{doc_id, start_token,
        end_token, score, text}] best first (score: the selector's, higher is better). ask's
        default re-rank re-orders the first `rerank` of this ranking with the model."""
        from kvmemory.retrieve import rank_blocks
        if not isinstance(question, str) or not question.strip():
            raise InputError("the question is empty")
        if not isinstance(k, int) or k < 1:
            raise InputError(f"k must be an integer >= 1, got {k!r}")
        store = self.require_store()
        store.refresh()
        docs = self.documents
        ranked = rank_blocks(self.rt, docs, question, selector, n=k, doc_filter=doc_filter)
        live = docs.live_map()
        meta = store.block_meta([h.row for h in ranked])
        C = store.manifest.block_tokens
        out = []
        for i, h in enumerate(ranked):
            n = int(meta["n_tokens"][i])
            doc_id, _, j = live[h.row]
            out.append({"doc_id": doc_id, "start_token": j * C, "end_token": j * C + n, "score": h.score,
                        "text": self.tokenizer.decode([int(t) for t in meta["tokens"][i][:n]])})
        return out

    @_locked
    def docs(self) -> list:
        """Deposited documents, oldest first (DocInfo: doc_id, n_tokens, blocks, segments, source, created)."""
        return self.documents.docs()

    @_locked
    def remove(self, doc_id: str) -> None:
        """Remove a document and its vectors (its blocks stay on disk, unreferenced)."""
        self.documents.remove(doc_id)

    @_locked
    def reindex(self, selector: str | None = None, progress: bool = False) -> None:
        """Rebuild the selection indexes from the store (they are derived data): those `selector`
        needs, or all of them."""
        from kvmemory.index import NEEDS, SELECTORS
        if selector is not None and selector not in SELECTORS:
            raise InputError(f"selector must be one of {SELECTORS}, got {selector!r}")
        kinds = set(NEEDS[selector]) if selector else {"dense", "bm25", "keys"}
        for what in sorted({"keys" if k == "keys" else "text" for k in kinds}):
            bar = _bar(progress, desc=f"reindex {what}", total=len(self.documents.live_rows()), unit="block")
            try:
                self.documents.rebuild(what, progress=bar)
            finally:
                if bar is not None:
                    bar.close()

    @property
    def block_tokens(self) -> int:
        return self.require_store().manifest.block_tokens

    @property
    def prefill_tokens(self) -> int:
        """Tokens per forward of the canonical prefill (StoreConfig.prefill_tokens; block_tokens unless
        the store was made with less)."""
        return self.require_store().manifest.chunk_tokens

    def require_store(self) -> BlockStore:
        """The open BlockStore; StoreError once this Memory is closed."""
        return self.rt.store()

    # ------------------------------------------------------------------ states (kvmemory/states.py)
    def tokenize(self, text_or_ids) -> list[int]:
        """Token ids of a prompt: str (UTF-8 text), bytes (must decode as UTF-8) or a list of ids."""
        return self.states_room.tokenize(text_or_ids)

    @_locked
    def save(self, text_or_ids, label: str = "", owner: str | None = None) -> State:
        """Compute (or reuse) the KV of a prompt and commit it as a state. Returns the State.

        Blocks already in the store (equal prefixes) are read back, verified, and not
        recomputed. owner, if given, salts the state's chain and keys its id: its blocks are the
        owner's own, never found by another owner's equal prefix (no cache hit, no shorter commit)
        and never finding theirs. The commit is atomic: a crash leaves the store at its previous
        commit.
        """
        return self.states_room.save(text_or_ids, label, owner)

    @_locked
    def resolve(self, state_id: str) -> str:
        """Full id of a committed state given its id or a unique prefix of >= 8 hex digits."""
        return self.states_room.resolve(state_id)

    @_locked
    def load(self, state_id: str) -> State:
        """Verified read of a committed state: every block digest-checked, ids re-derived."""
        return self.states_room.load(state_id)

    @_locked
    def forget_states(self, state_ids) -> int:
        """Remove states from the store's list (their blocks stay until gc, and are kept while another
        state or a document uses them). Unknown ids are skipped. Returns how many were removed."""
        return self.states_room.forget_states(state_ids)

    @_locked
    def states(self) -> list[StateInfo]:
        return self.states_room.states()

    @torch.inference_mode()
    @_locked
    def compact(self, dest, encoding: str = "fp16", progress=None):
        """Write a compact copy of this (exact) store at `dest`, a new local directory: every block
        encoded ("fp16", the default, or "bf16": half the bytes of fp32 KV), its error against the exact block
        measured and kept with it (kvmemory/compact.py). Returns a CompactReport. The copy opens
        like any store; every graft from it reports its error, and it takes no new blocks."""
        from kvmemory.compact import compact
        return compact(self.rt, dest, encoding, progress)

    @_locked
    def verify(self, recompute: bool = False, progress=None) -> list[tuple[int, str]]:
        """E1 (and with recompute=True, E2) over every committed block. Returns [(row, reason)]."""
        return self.states_room.verify(recompute, progress)

    @_locked
    def audit(self, samples: int = 8, seed: int | None = None, progress=None):
        """E3 on `samples` random states of the store (kvmemory/audit.py): restored vs recomputed the
        canonical way, bit for bit (and vs one plain pass in invariant mode). Returns (seed, rows)."""
        from kvmemory.audit import audit
        return audit(self.rt, samples, seed, progress)

    # ------------------------------------------------------------------ generation
    def chat_turn(self, text: str) -> str:
        """The chat-template text of one user turn followed by the assistant's opening."""
        return prompts.turn_text(self.tokenizer, text)

    def system_prompt(self, text: str) -> str:
        """The chat-template text of a system prompt: save() it, then generate(..., chat=True)."""
        return prompts.system_text(self.tokenizer, text)

    @torch.inference_mode()
    @_locked
    def generate(self, state, prompt, max_new_tokens: int = 64, chat: bool = False) -> str:
        """Greedy continuation of a state (State or id) after `prompt` (text or token ids).

        chat=True wraps prompt as a user turn of the model's chat template.
        """
        if max_new_tokens < 1:
            raise InputError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        st = state if isinstance(state, State) else self.load(state)
        ids = self.tokenize(self.chat_turn(prompt) if chat and isinstance(prompt, str) else prompt)
        self.states_room.check_window(st.n_tokens + len(ids) + max_new_tokens, "state + prompt + max_new_tokens")
        cache = st.cache()
        logits = kvops.last_logits(self.model, ids_tensor(ids, self.model), cache)
        new = greedy(self.model, cache, logits, max_new_tokens, self.eos_ids)
        return self.tokenizer.decode(new, skip_special_tokens=True)

    # ------------------------------------------------------------------ chat memory
    def chat_memory(self, user: str, layout: str | None = None, recompute: float | None = None,
                    keep: str | None = None):
        """The memory of one user of a chat assistant (kvmemory.chat_memory.ChatMemory): remember, recall,
        reply, sessions, forget, its turns in a namespace of their own. recompute: the fraction of the recalled
        turns' tokens recomputed in each window; keep: what of an exchange is remembered; layout: "turns"
        (prose), "system" or "messages" (the chat messages it was) (defaults: kvmemory.chat_memory.memory)."""
        from kvmemory.chat_memory import ChatMemory
        return ChatMemory(self.rt, self.scopes, user, layout, recompute=recompute, keep=keep)

    @property
    def scopes(self):
        """The Documents of chat users' scopes (kvmemory.documents.Scopes), the last USER_SCOPES loaded."""
        with self._lock:
            if self._scopes is None:
                from kvmemory.documents import Scopes
                self._scopes = Scopes(self.rt, lambda: self.documents.embedder)
            return self._scopes

    def drop_user_documents(self, scope) -> None:
        """Unload a user's indexes (they load again on the user's next request)."""
        self.scopes.drop(scope)

    # ------------------------------------------------------------------ verified-solution library
    @property
    def library(self):
        """The Library of solved examples (kvmemory.library), created on first use."""
        if self._library is None:
            from kvmemory.library import Library
            self._library = Library(self.rt)
        return self._library

    @_locked
    def learn(self, problem: str, solution: str, verify=None):
        """Deposit a solved example: checks `solution` with `verify` (a callable(solution) -> bool,
        or "answer:X": its final answer must be X) and stores it only if it passes, as a state
        (library prelude + problem + solution) indexed by its problem text. Returns the Entry.
        A failing solution raises VerificationError and stores nothing; verify=None (explicit)
        stores it marked unverified, and solve() never grafts unverified entries. A solution without
        an "Answer:" line is stored with one appended (its extracted final answer)."""
        return self.library.learn(problem, solution, verify)

    @_locked
    def solve(self, problem: str, verify=None, k: int = 3, attempts: int = 1, max_new_tokens: int = 256,
              temperature: float = 0.7, seed: int = 0, examples_as: str = "kv", learn: bool = True,
              reuse: bool = True, recompute: float = 0.0):
        """Solve a problem with the k nearest verified solutions grafted as worked examples.

        Returns Solution(text, answer, verified, sources, stats). The first example sits at its stored
        positions (its exact state); the others are re-rotated to follow it; only the problem is
        prefilled. recompute=r (0 < r <= 1) recomputes the fraction r of the examples' tokens whose
        K/V deviate most from the examples seen together (as `ask` does; 1.0 = the examples
        re-prefilled as text); examples after the first were computed alone, so without it they do
        not see each other. A problem already in the library restores its verified state through
        the solution's last token and decodes one token (stats["repeated"]; the answer is the
        stored verified one, stats["answer_from"] == "library"). With `verify`, up
        to `attempts` answers are drawn (the first greedy, then sampled at `temperature`, seeded)
        until one verifies, and a verified one is learned (learn=True). examples_as="text" re-prefills the same examples as text (baseline);
        reuse=False never answers from a stored solution of the same problem."""
        from kvmemory.library import solve
        return solve(self.rt, self.library, problem, verify=verify, k=k, attempts=attempts,
                     max_new_tokens=max_new_tokens, temperature=temperature, seed=seed, examples_as=examples_as,
                     learn=learn, reuse=reuse, recompute=recompute)

    # ------------------------------------------------------------------ maintenance
    @_locked
    def gc(self, grace_s: float = 3600.0):
        """Reclaim the disk space of blocks no state or document uses any more (after remove()).

        Blocks committed in the last grace_s seconds are kept (a document being added by another
        process commits its blocks before the document). Safe against concurrent readers and a
        crash mid-way. Returns GcReport(blocks_freed, bytes_freed, files_removed, files_rewritten)."""
        if not isinstance(grace_s, (int, float)) or grace_s < 0:
            raise InputError(f"grace_s must be a number of seconds >= 0, got {grace_s!r}")
        store = self.require_store()
        report = store.gc(float(grace_s))
        self.forget_blocks(store.manifest.freed)
        self._drop_forgotten_users()
        return report

    def _drop_forgotten_users(self) -> None:
        """Index files of users with no turns left (a forget a crash interrupted leaves them)."""
        from kvmemory.chat_memory.memory import drop_forgotten_users
        drop_forgotten_users(self.require_store(), self.require_store().root)

    @_locked
    def info(self, with_states: bool = False) -> dict:
        """Model, fingerprint, states, blocks, KV bytes, bytes on disk, compression ratio."""
        store = self.require_store()
        store.refresh()
        return describe(store, with_states)
