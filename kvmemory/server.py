"""`kvmemory serve`: a document-QA HTTP API and an OpenAI-compatible chat server over one Memory.

    POST /v1/documents         deposit (JSON {"text", "doc_id"} or a multipart file): 202 {"job_id"}
    GET  /v1/jobs/{id}         {"status": queued|running|done|failed, "progress", "error"}
    GET  /v1/documents, DELETE /v1/documents/{doc_id}
    POST /v1/ask               {"question", top_k, selector, ...} -> answer, sources, stats (SSE with "stream")
    GET  /v1/models, POST /v1/chat/completions (OpenAI shapes, SSE streaming)
    GET/DELETE /v1/sessions/{id}
    GET  /health               (open without a key)

Chat persistence: the prompt of every request is saved as a state (its blocks content-addressed),
so a request whose messages extend a stored conversation restores the longest stored prefix
exactly and prefills only the rest (usage.prompt_tokens_details.cached_tokens); after each reply
the conversation including the reply is saved too, computed the canonical (block-chunked) way,
so the next turn restores it. Greedy replies are therefore identical whether a prefix was
restored or recomputed.

One model, many clients: model work runs on one worker thread, in arrival order; at most
`queue_size` requests wait, more get 429 with Retry-After. Deposits run on their own thread (the
Memory serialises them with the model work). Jobs and sessions are kept in STORE/serve/ and
survive a restart; an interrupted deposit resumes.
"""


import asyncio
import hmac
import ipaddress
import json
import os
import queue
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from kvmemory.errors import (DocumentNotFoundError, EmptyStoreError, InputError, KVMemoryError, StateNotFoundError,
                             StoreError, VerificationError, WindowExceededError)

SERVE_DIR = "serve"
SESSION_DOCS = "session:"          # doc ids of chat memory: session:<hash of session id>:<hash of the message>
RECALL_BLOCKS = 3                  # blocks of older turns brought back per turn when over the window
MAX_STOP = 4
CHAT_KEYS = {"model", "messages", "stream", "stream_options", "temperature", "top_p", "max_tokens",
             "max_completion_tokens", "stop", "seed", "n", "prompt_cache_key", "user", "frequency_penalty",
             "presence_penalty", "logprobs", "top_logprobs", "logit_bias", "tools", "tool_choice",
             "response_format", "parallel_tool_calls", "store", "metadata", "reasoning_effort", "modalities",
             "service_tier", "audio", "prediction", "web_search_options", "functions", "function_call",
             "verbosity", "safety_identifier"}
# accepted at their neutral value only: anything else is refused with a 400 naming the parameter
NEUTRAL = {"frequency_penalty": (0, 0.0), "presence_penalty": (0, 0.0), "logprobs": (False,), "n": (1,),
           "parallel_tool_calls": (True, False), "store": (False,), "service_tier": ("auto", "default")}
ASK_KEYS = {"question", "top_k", "selector", "max_new_tokens", "recompute", "expand", "min_relevance", "stream"}


class ApiError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _bad(param: str, message: str, code: str | None = "invalid_value") -> ApiError:
    return ApiError(400, message, param=param, code=code)


# ---------------------------------------------------------------------- persistence
class JsonFile:
    """A small JSON document on disk, replaced atomically (temp file, fsync, rename)."""

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
        tmp = self.path.with_name(f".{self.path.name}.{uuid.uuid4().hex[:8]}.tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(data, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)


class Jobs:
    """Deposit jobs, persisted; the texts wait in STORE/serve/uploads until their job is done."""

    def __init__(self, root: Path) -> None:
        self.file = JsonFile(root / "jobs.json")
        self.uploads = root / "uploads"
        self.prefix = "job-"
        self.jobs: dict[str, dict] = self.file.load()
        self.queue: "queue.Queue[str]" = queue.Queue()
        for jid, job in sorted(self.jobs.items(), key=lambda kv: kv[1]["created"]):
            if job["status"] in ("queued", "running"):       # interrupted by a restart: resume
                job["status"] = "queued"
                self.queue.put(jid)
        self.flush()

    def flush(self) -> None:
        with self.file.lock:
            self.file.save(self.jobs)

    def create(self, text: str, doc_id: str, source: str) -> dict:
        jid = self.prefix + uuid.uuid4().hex[:16]
        self.uploads.mkdir(parents=True, exist_ok=True)
        JsonFile(self.uploads / f"{jid}.json").save({"text": text})
        job = {"id": jid, "doc_id": doc_id, "source": source, "status": "queued", "created": time.time(),
               "progress": {"tokens_done": 0, "tokens_total": None}, "error": None}
        self.jobs[jid] = job
        self.flush()
        self.queue.put(jid)
        return job

    def text(self, jid: str) -> str:
        return JsonFile(self.uploads / f"{jid}.json").load()["text"]

    def public(self, job: dict) -> dict:
        return {k: job[k] for k in ("id", "doc_id", "status", "progress", "error", "created")}


class Sessions:
    """Chat sessions: session id -> the states of its turns (oldest first), persisted."""

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


# ---------------------------------------------------------------------- the model worker
class Worker:
    """Runs model work on one thread, in arrival order, with a bounded wait queue."""

    def __init__(self, queue_size: int) -> None:
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvmemory-model")
        self.queue_size = queue_size
        self.pending = 0
        self.lock = threading.Lock()

    def admit(self) -> None:
        with self.lock:
            if self.pending >= self.queue_size:
                raise ApiError(429, f"the server is busy: {self.pending} requests are waiting for the model; "
                                    "retry shortly", type_="rate_limit_error", code="queue_full",
                               headers={"Retry-After": "1"})
            self.pending += 1

    def release(self) -> None:
        with self.lock:
            self.pending -= 1

    async def run(self, fn, *args):
        """Admit, run fn(*args) on the worker thread, release. Raises ApiError 429 when full."""
        self.admit()
        try:
            return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)
        finally:
            self.release()


def sample_next(logits: torch.Tensor, temperature: float, top_p: float, gen: torch.Generator | None) -> int:
    """Greedy at temperature 0; otherwise softmax(logits / T) restricted to the top_p nucleus."""
    if temperature == 0:
        return int(logits.argmax())
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        p, idx = probs.sort(descending=True)
        keep = p.cumsum(0) - p < top_p              # always keeps the most likely token
        probs = torch.zeros_like(probs).scatter(0, idx[keep], p[keep])
        probs /= probs.sum()
    return int(torch.multinomial(probs, 1, generator=gen))


class Engine:
    """The model-side work of the server (runs on the worker thread)."""

    def __init__(self, mem, root: Path) -> None:
        self.mem = mem
        self.sessions = Sessions(root)
        self.jobs = Jobs(root)
        self.model_id = mem.model_name

    # ------------------------------------------------------------------ chat
    def prompt_ids(self, messages: list[dict]) -> list[int]:
        tok = self.mem.tokenizer
        return tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False)

    def fit(self, p: dict) -> tuple[list[int], list[dict]]:
        """The prompt's token ids. A conversation longer than the window keeps its system message
        and latest turns; its older turns are deposited as the session's documents (once each,
        content-addressed) and the blocks of them most relevant to the latest message are selected
        (the engine of ask) and quoted in the system message. Returns (ids, what was recalled)."""
        messages = p["messages"]
        ids = self.prompt_ids(messages)
        limit = self.mem.geometry.max_positions
        if len(ids) + p["max_tokens"] <= limit:
            return ids, []
        if p["session"] is None:
            raise ApiError(400, f"the conversation is {len(ids)} tokens and max_tokens {p['max_tokens']}; the "
                                f"model's window is {limit}. Name a session (prompt_cache_key) to keep older turns "
                                "in memory instead", param="messages", code="context_length_exceeded")
        n_head = next((i for i, m in enumerate(messages) if m["role"] != "system"), len(messages))
        head, rest = messages[:n_head], messages[n_head:]
        C = self.mem.block_tokens
        budget = limit - p["max_tokens"] - (RECALL_BLOCKS + 1) * C
        k = 0
        while k < len(rest) and len(self.prompt_ids(head + rest[k:])) > budget:
            k += 1
        if k >= len(rest):
            raise ApiError(400, f"the latest message alone does not fit the model's window of {limit} tokens "
                                f"with max_tokens {p['max_tokens']}", param="messages", code="context_length_exceeded")
        import xxhash
        prefix = session_prefix(p["session"])
        have = self.mem.require_store().manifest.docs
        for m in rest[:k]:
            text = f"{m['role']}: {m['content']}"
            doc_id = prefix + xxhash.xxh3_64_hexdigest(text.encode())
            if doc_id not in have and text.strip():
                self.mem.add(text, doc_id=doc_id)
        query = next((m["content"] for m in reversed(rest) if m["role"] == "user"), rest[-1]["content"])
        hits = self.mem.retrieve(query, k=RECALL_BLOCKS, doc_filter=lambda d: d.startswith(prefix)) \
            if query.strip() else []
        note = "Earlier in this conversation (excerpts):\n" + "\n".join(h["text"].strip() for h in hits)
        sys_msg = {"role": "system", "content": ((head[0]["content"] + "\n\n") if head else "") + note}
        fitted = [sys_msg] + head[1:] + rest[k:]
        ids = self.prompt_ids(fitted)
        while len(ids) + p["max_tokens"] > limit and hits:        # excerpts never push it over
            hits = hits[:-1]
            sys_msg["content"] = ((head[0]["content"] + "\n\n") if head else "") + \
                "Earlier in this conversation (excerpts):\n" + "\n".join(h["text"].strip() for h in hits)
            ids = self.prompt_ids(fitted)
        return ids, [{"doc_id": h["doc_id"], "start_token": h["start_token"], "end_token": h["end_token"],
                      "score": h["score"], "text": h["text"]} for h in hits]

    def chat(self, p: dict, emit, cancel: threading.Event) -> dict:
        """Fit the prompt, restore/compute it, decode, save the conversation. emit(text_delta) streams."""
        from kvmemory.decode import greedy
        from kvmemory.device import ids_tensor
        mem = self.mem
        with mem.exclusive():                                      # one request's model work at a time
            ids, recalled = self.fit(p)
            prefix = mem.save(ids[:-1], label="kvmemory:chat") if len(ids) > 1 else None
            cached = prefix.reused_tokens if prefix is not None else 0
            cache = prefix.cache() if prefix is not None else None
            with torch.inference_mode():
                if cache is None:
                    from kvmemory import kv as kvops
                    cache = kvops.make_cache(None, mem.model.config)
                out = mem.model(input_ids=ids_tensor(ids[-1:], mem.model), past_key_values=cache, use_cache=True)
                gen = torch.Generator().manual_seed(p["seed"]) if p["seed"] is not None else None
                stops = p["stop"]
                hold = max((len(s) for s in stops), default=1) - 1
                st = {"text": "", "emitted": 0, "finish": None}

                def on_token(new: list[int]) -> bool:
                    """Emit the text that is safe to send; True (stop) at a stop string or a cancel."""
                    text = mem.tokenizer.decode(new, skip_special_tokens=True)
                    cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
                    if cut >= 0:
                        st["text"], st["finish"] = text[:cut], "stop"
                        return True
                    st["text"] = text
                    safe = len(text) - hold
                    while safe > st["emitted"] and text[safe - 1] == "\ufffd":   # an unfinished UTF-8 character
                        safe -= 1
                    if safe > st["emitted"]:
                        emit(text[st["emitted"]:safe])
                        st["emitted"] = safe
                    if cancel.is_set():
                        st["finish"] = "cancelled"
                        return True
                    return False
                new = greedy(mem.model, cache, out.logits[0, -1], p["max_tokens"], mem.eos_ids, on_token=on_token,
                             pick=lambda x: sample_next(x, p["temperature"], p["top_p"], gen))
                text = st["text"]
                finish = st["finish"] or ("length" if len(new) == p["max_tokens"] else "stop")
                if len(text) > st["emitted"]:
                    emit(text[st["emitted"]:])
            # the conversation with its reply, computed canonically: the next turn restores it
            state = mem.save(ids + new, label="kvmemory:chat") if finish != "cancelled" else None
        if state is not None and p["session"]:
            self.sessions.record(p["session"], ([prefix.id] if prefix is not None else []) + [state.id],
                                 state.n_tokens, recalled)
        return {"text": text, "finish_reason": "stop" if finish == "cancelled" else finish, "prompt_tokens": len(ids),
                "completion_tokens": len(new), "cached_tokens": cached}

    # ------------------------------------------------------------------ ask
    def ask(self, q: dict, emit) -> dict:
        mem = self.mem
        ans = mem.ask(q["question"], top_k=q.get("top_k"), selector=q.get("selector", "text"),
                      max_new_tokens=q.get("max_new_tokens", 48), recompute=q.get("recompute"),
                      expand=q.get("expand", True), min_relevance=q.get("min_relevance"), on_token=emit,
                      doc_filter=lambda d: not d.startswith(SESSION_DOCS))      # chat memory is not a document
        from kvmemory.ask import passages
        return {"answer": ans.text, "sources": passages(mem, ans), "stats": ans.stats}

    # ------------------------------------------------------------------ solution library
    def learn(self, q: dict) -> dict:
        e = self.mem.learn(q["problem"], q["solution"], verify=None if q["answer"] is None else f"answer:{q['answer']}")
        return {"entry_id": e.entry_id, "verified": e.verified, "answer": e.answer, "n_tokens": e.n_tokens}

    def solve(self, q: dict) -> dict:
        sol = self.mem.solve(q["problem"], verify=None if q["answer"] is None else f"answer:{q['answer']}",
                             k=q["k"], attempts=q["attempts"], max_new_tokens=q["max_new_tokens"], learn=q["learn"],
                             recompute=q["recompute"])
        return {"text": sol.text, "answer": sol.answer, "verified": sol.verified, "sources": sol.sources,
                "learned": sol.learned.entry_id if sol.learned else None, "stats": sol.stats}

    # ------------------------------------------------------------------ deposits
    def run_jobs(self, stop: threading.Event) -> None:
        """The deposit thread: one job at a time, resumable."""
        while not stop.is_set():
            try:
                jid = self.jobs.queue.get(timeout=0.2)
            except queue.Empty:
                continue
            job = self.jobs.jobs[jid]
            job["status"] = "running"
            self.jobs.flush()
            progress = _JobProgress(job, self.jobs)
            try:
                if job["doc_id"] not in {d.doc_id for d in self.mem.docs()}:
                    self.mem.add(self.jobs.text(jid), doc_id=job["doc_id"], source=job["source"],
                                 progress=progress)
                job["status"] = "done"
                job["progress"]["tokens_done"] = job["progress"]["tokens_total"] or job["progress"]["tokens_done"]
                (self.jobs.uploads / f"{jid}.json").unlink(missing_ok=True)
            except Exception as e:   # noqa: BLE001 -- a failed job reports why; the server goes on
                job["status"] = "failed"
                job["error"] = f"{type(e).__name__}: {e}"
            self.jobs.flush()


class _JobProgress:
    """The progress object Memory.add drives (total, update(n)); persisted every few seconds."""

    def __init__(self, job: dict, jobs: Jobs) -> None:
        self.job, self.jobs, self.last = job, jobs, 0.0
        self._total = None

    @property
    def total(self):
        return self._total

    @total.setter
    def total(self, n) -> None:
        self._total = n
        self.job["progress"]["tokens_total"] = n

    def refresh(self) -> None:
        pass

    def update(self, n: int) -> None:
        self.job["progress"]["tokens_done"] += int(n)
        if time.monotonic() - self.last > 2.0:
            self.last = time.monotonic()
            self.jobs.flush()


# ---------------------------------------------------------------------- request parsing
def parse_chat(body: dict, engine: Engine, headers) -> dict:
    unknown = sorted(set(body) - CHAT_KEYS)
    if unknown:
        raise _bad(unknown[0], f"unrecognized request argument: {unknown[0]}", "unknown_parameter")
    for k, allowed in NEUTRAL.items():
        if k in body and body[k] is not None and body[k] not in allowed:
            raise _bad(k, f"{k}={body[k]!r} is not supported by this server (supported: {list(allowed)})",
                       "unsupported_parameter")
    for k in ("top_logprobs", "logit_bias", "tools", "tool_choice", "response_format", "audio", "prediction",
              "web_search_options", "functions", "function_call", "modalities", "reasoning_effort", "verbosity"):
        if body.get(k) not in (None, [], {}):
            raise _bad(k, f"{k} is not supported by this server", "unsupported_parameter")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _bad("model", "model is required: a string (GET /v1/models lists it)", "missing_required_parameter")
    if model not in (engine.model_id, "kvmemory"):
        raise ApiError(404, f"the model {model!r} does not exist; this server serves {engine.model_id!r}",
                       param="model", code="model_not_found")
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise _bad("messages", "messages must be a non-empty array", "missing_required_parameter")
    messages = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or m.get("role") not in ("system", "developer", "user", "assistant"):
            raise _bad(f"messages[{i}].role", "each message needs a role: system, developer, user or assistant")
        c = m.get("content")
        if isinstance(c, list):
            if not all(isinstance(x, dict) and x.get("type") == "text" and isinstance(x.get("text"), str) for x in c):
                raise _bad(f"messages[{i}].content", "only text content parts are supported")
            c = "".join(x["text"] for x in c)
        if not isinstance(c, str):
            raise _bad(f"messages[{i}].content", "content must be a string or an array of text parts")
        messages.append({"role": "system" if m["role"] == "developer" else m["role"], "content": c})
    temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0, low_open=True)
    mt = body.get("max_completion_tokens", body.get("max_tokens"))
    if mt is None:
        mt = 256
    if isinstance(mt, bool) or not isinstance(mt, int) or mt < 1:
        raise _bad("max_tokens", f"max_tokens must be an integer >= 1, got {mt!r}")
    stop = body.get("stop")
    stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or len(stop) > MAX_STOP or not all(isinstance(s, str) and s for s in stop):
        raise _bad("stop", f"stop must be a non-empty string or an array of at most {MAX_STOP} of them")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise _bad("seed", f"seed must be an integer, got {seed!r}")
    so = body.get("stream_options")
    if so is not None and (not isinstance(so, dict) or set(so) - {"include_usage", "include_obfuscation"}):
        raise _bad("stream_options", "stream_options supports include_usage only")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise _bad("stream", "stream must be a boolean")
    if so is not None and not stream:
        raise _bad("stream_options", "stream_options is only allowed with stream: true")
    session = body.get("prompt_cache_key") or headers.get("x-session-id") or body.get("user")
    if session is not None:
        _check_id(session, "prompt_cache_key")
    return {"model": model, "messages": messages, "temperature": temperature, "top_p": top_p, "max_tokens": mt,
            "stop": stop, "seed": seed, "stream": stream,
            "include_usage": bool((so or {}).get("include_usage")), "session": session}


def parse_ask(body: dict) -> dict:
    unknown = sorted(set(body) - ASK_KEYS)
    if unknown:
        raise _bad(unknown[0], f"unrecognized request argument: {unknown[0]}", "unknown_parameter")
    q = body.get("question")
    if not isinstance(q, str) or not q.strip():
        raise _bad("question", "question must be a non-empty string", "missing_required_parameter")
    if len(q) > 8000:
        raise _bad("question", f"question is {len(q)} characters; the limit is 8000")
    out = {"question": q, "stream": body.get("stream", False)}
    if not isinstance(out["stream"], bool):
        raise _bad("stream", "stream must be a boolean")
    for k, kind in (("top_k", int), ("max_new_tokens", int), ("recompute", float), ("min_relevance", float),
                    ("expand", bool), ("selector", str)):
        if k in body and body[k] is not None:
            v = body[k]
            ok = isinstance(v, bool) if kind is bool else isinstance(v, str) if kind is str else \
                (isinstance(v, (int, float)) and not isinstance(v, bool) and (kind is float or isinstance(v, int)))
            if not ok:
                raise _bad(k, f"{k} must be {kind.__name__}, got {v!r}")
            out[k] = v
    if out.get("max_new_tokens", 48) > 512 or out.get("top_k", 2) > 64:
        raise _bad("max_new_tokens" if out.get("max_new_tokens", 48) > 512 else "top_k",
                   "max_new_tokens is at most 512 and top_k at most 64")
    return out


def _text_field(body: dict, k: str, limit: int = 20000) -> str:
    v = body.get(k)
    if not isinstance(v, str) or not v.strip():
        raise _bad(k, f"{k} must be a non-empty string", "missing_required_parameter")
    if len(v) > limit:
        raise _bad(k, f"{k} is {len(v)} characters; the limit is {limit}")
    return v


def _expected_answer(body: dict) -> str | None:
    v = body.get("answer")
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (str, int, float)) or not str(v).strip():
        raise _bad("answer", "answer (the expected final answer) must be a non-empty string or a number")
    return str(v)


def parse_learn(body: dict) -> dict:
    unknown = sorted(set(body) - {"problem", "solution", "answer", "unverified"})
    if unknown:
        raise _bad(unknown[0], f"unrecognized request argument: {unknown[0]}", "unknown_parameter")
    q = {"problem": _text_field(body, "problem"), "solution": _text_field(body, "solution"),
         "answer": _expected_answer(body)}
    unverified = body.get("unverified", False)
    if not isinstance(unverified, bool):
        raise _bad("unverified", "unverified must be a boolean")
    if q["answer"] is None and not unverified:
        raise _bad("answer", "give the expected answer to verify the solution against, or unverified: true",
                   "missing_required_parameter")
    return q


def parse_solve(body: dict) -> dict:
    unknown = sorted(set(body) - {"problem", "answer", "k", "attempts", "max_new_tokens", "learn", "recompute"})
    if unknown:
        raise _bad(unknown[0], f"unrecognized request argument: {unknown[0]}", "unknown_parameter")
    q = {"problem": _text_field(body, "problem", 8000), "answer": _expected_answer(body)}
    for k, default, lo, hi in (("k", 3, 0, 16), ("attempts", 1, 1, 16), ("max_new_tokens", 256, 1, 512)):
        v = body.get(k, default)
        if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
            raise _bad(k, f"{k} must be an integer in [{lo}, {hi}], got {v!r}")
        q[k] = v
    q["learn"] = body.get("learn", True)
    if not isinstance(q["learn"], bool):
        raise _bad("learn", "learn must be a boolean")
    q["recompute"] = _number(body, "recompute", 0.0, 0.0, 1.0)
    return q


def _number(body: dict, k: str, default: float, lo: float, hi: float, low_open: bool = False) -> float:
    v = body.get(k)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not (lo < v <= hi if low_open else lo <= v <= hi):
        raise _bad(k, f"{k} must be a number in {'(' if low_open else '['}{lo}, {hi}], got {v!r}")
    return float(v)


def _check_id(value, what: str) -> str:
    from kvmemory.documents import valid_id
    if not valid_id(value):
        raise _bad(what, f"{what} must be a non-empty string of at most 200 printable characters")
    return value


# ---------------------------------------------------------------------- the app
def create_app(mem, *, api_key: str | None = None, queue_size: int = 32, max_body_bytes: int = 16 << 20,
               serve_dir: Path | None = None, job_prefix: str = "job-"):
    """The FastAPI app over `mem` (a writable Memory). Starts the deposit thread on startup.
    serve_dir: where jobs and sessions persist (default STORE/serve; one per replica when several
    serve one store); job_prefix: how job ids start (a replica's rank, for routing)."""
    from contextlib import asynccontextmanager

    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, StreamingResponse
    from starlette.exceptions import HTTPException as StarletteHTTPException

    root = Path(serve_dir) if serve_dir is not None else Path(mem.path) / SERVE_DIR
    engine = Engine(mem, root)
    engine.jobs.prefix = job_prefix
    worker = Worker(queue_size)
    stop = threading.Event()

    @asynccontextmanager
    async def lifespan(app):
        t = threading.Thread(target=engine.run_jobs, args=(stop,), name="kvmemory-deposits", daemon=True)
        t.start()
        yield
        stop.set()
        t.join(timeout=5)

    ERR = {"description": "an error in OpenAI's shape", "content": {"application/json": {"schema": {
        "type": "object", "properties": {"error": {"type": "object", "properties": {
            "message": {"type": "string"}, "type": {"type": "string"}, "param": {"type": ["string", "null"]},
            "code": {"type": ["string", "null"]}}}}}}}}
    common = {s: ERR for s in (400, 401, 404, 405, 413, 422, 429, 500)}
    app = FastAPI(title="kvmemory", version=_version(), lifespan=lifespan, responses=common)
    app.state.engine, app.state.worker = engine, worker

    def error(e: ApiError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(ApiError)
    async def _api_error(request, e: ApiError):
        return error(e)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, e):
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
        msg = f"no route {request.method} {request.url.path}" if e.status_code == 404 else str(e.detail)
        return error(ApiError(e.status_code, msg, code=code))

    @app.exception_handler(RequestValidationError)
    async def _validation(request, e):
        first = e.errors()[0] if e.errors() else {}
        loc = ".".join(str(x) for x in first.get("loc", ()) if x != "body") or None
        return error(ApiError(400, f"invalid request: {first.get('msg', e)}", param=loc))

    @app.exception_handler(Exception)
    async def _internal(request, e):
        if isinstance(e, KVMemoryError):
            return error(_from_kvmemory(e))
        return error(ApiError(500, f"internal error: {type(e).__name__}", type_="server_error"))

    @app.middleware("http")
    async def guard(request: Request, call_next):
        if api_key is not None and request.url.path not in ("/health",):
            got = request.headers.get("authorization", "")
            if not (got.startswith("Bearer ") and hmac.compare_digest(got[7:].encode(), api_key.encode())):
                return error(ApiError(401, "missing or wrong API key (Authorization: Bearer ...)",
                                      code="invalid_api_key"))
        n = request.headers.get("content-length")
        if n is not None and (not n.isdigit() or int(n) > max_body_bytes):
            return error(ApiError(413, f"the request body is larger than {max_body_bytes} bytes",
                                  code="request_too_large"))
        return await call_next(request)

    async def read_json(request: Request) -> dict:
        raw = await request.body()
        if len(raw) > max_body_bytes:
            raise ApiError(413, f"the request body is larger than {max_body_bytes} bytes", code="request_too_large")
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise ApiError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from None
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object", code="invalid_json")
        return body

    def sse(obj) -> bytes:
        return f"data: {json.dumps(obj) if not isinstance(obj, str) else obj}\n\n".encode()

    async def stream_from_worker(fn, make_events):
        """Run fn(emit, cancel) on the worker; yield SSE made by make_events(kind, payload)."""
        worker.admit()
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        cancel = threading.Event()

        def emit(text: str) -> None:
            loop.call_soon_threadsafe(q.put_nowait, ("delta", text))

        def run():
            try:
                res = fn(emit, cancel)
                loop.call_soon_threadsafe(q.put_nowait, ("done", res))
            except Exception as e:   # noqa: BLE001 -- reported in the stream
                loop.call_soon_threadsafe(q.put_nowait, ("error", e))
            finally:
                worker.release()        # whatever became of the client

        loop.run_in_executor(worker.pool, run)

        async def gen():
            try:
                while True:
                    kind, payload = await q.get()
                    for chunk in make_events(kind, payload):
                        yield chunk
                    if kind in ("done", "error"):
                        break
            finally:
                cancel.set()                    # a client that went away frees its slot at the next token
        return StreamingResponse(gen(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    # ------------------------------------------------------------------ routes
    @app.get("/health")
    async def health():
        return {"status": "ok", "model": engine.model_id, "queue": worker.pending}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": engine.model_id, "object": "model", "created": 0,
                                            "owned_by": "kvmemory"}]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        p = parse_chat(await read_json(request), engine, request.headers)
        if p["session"] is None:                  # no session to keep older turns in: refuse now, not mid-stream
            engine.fit(p)
        cid, created = "chatcmpl-" + uuid.uuid4().hex[:24], int(time.time())
        fp = "kvm-" + mem.fingerprint[-12:]

        def usage(r):
            return {"prompt_tokens": r["prompt_tokens"], "completion_tokens": r["completion_tokens"],
                    "total_tokens": r["prompt_tokens"] + r["completion_tokens"],
                    "prompt_tokens_details": {"cached_tokens": r["cached_tokens"]}}
        if not p["stream"]:
            r = await worker.run(engine.chat, p, lambda _: None, threading.Event())
            return {"id": cid, "object": "chat.completion", "created": created, "model": engine.model_id,
                    "system_fingerprint": fp, "usage": usage(r),
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": r["text"], "refusal": None},
                                 "finish_reason": r["finish_reason"], "logprobs": None}]}

        def chunk(delta: dict, finish=None, usage_=None, choices=True) -> bytes:
            obj = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": engine.model_id,
                   "system_fingerprint": fp,
                   "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}] if choices
                   else []}
            if p["include_usage"]:
                obj["usage"] = usage_
            return sse(obj)

        first = [True]

        def events(kind, payload):
            if first[0] and kind != "error":
                first[0] = False
                yield chunk({"role": "assistant", "content": ""})
            if kind == "delta":
                yield chunk({"content": payload})
            elif kind == "done":
                yield chunk({}, finish=payload["finish_reason"])
                if p["include_usage"]:
                    yield chunk({}, usage_=usage(payload), choices=False)
                yield sse("[DONE]")
            else:
                yield sse(_from_exception(payload).body())
                yield sse("[DONE]")
        return await stream_from_worker(lambda emit, cancel: engine.chat(p, emit, cancel), events)

    @app.post("/v1/learn")
    async def learn(request: Request):
        return await worker.run(engine.learn, parse_learn(await read_json(request)))

    @app.post("/v1/solve")
    async def solve(request: Request):
        return await worker.run(engine.solve, parse_solve(await read_json(request)))

    @app.post("/v1/ask")
    async def ask(request: Request):
        q = parse_ask(await read_json(request))
        if not q["stream"]:
            return await worker.run(engine.ask, q, None)

        def events(kind, payload):
            if kind == "delta":
                yield sse({"type": "delta", "text": payload})
            elif kind == "done":
                yield sse({"type": "final", **payload})
                yield sse("[DONE]")
            else:
                yield sse(_from_exception(payload).body())
                yield sse("[DONE]")
        return await stream_from_worker(lambda emit, cancel: engine.ask(q, emit), events)

    @app.post("/v1/documents", status_code=202)
    async def add_document(request: Request):
        from kvmemory.documents import check_doc_id, decode_text
        ctype = request.headers.get("content-type", "")
        if ctype.startswith("multipart/form-data"):
            form = await request.form()
            f = form.get("file")
            if f is None or not hasattr(f, "read"):
                raise _bad("file", "a multipart upload needs a file field named 'file'", "missing_required_parameter")
            data = await f.read()
            if len(data) > max_body_bytes:
                raise ApiError(413, f"the file is larger than {max_body_bytes} bytes", code="request_too_large")
            doc_id = form.get("doc_id") or Path(f.filename or "").name or None
            source = f.filename or ""
        else:
            body = await read_json(request)
            extra = sorted(set(body) - {"text", "doc_id"})
            if extra:
                raise _bad(extra[0], f"unrecognized request argument: {extra[0]}", "unknown_parameter")
            data, doc_id, source = body.get("text"), body.get("doc_id"), ""
            if not isinstance(data, str):
                raise _bad("text", "text must be a string", "missing_required_parameter")
        try:
            text = decode_text(data, source or "text")
            if doc_id is None:
                import xxhash
                doc_id = "doc-" + xxhash.xxh3_64_hexdigest(text.encode())
            check_doc_id(doc_id)
            if doc_id.startswith(SESSION_DOCS):
                raise InputError(f"document ids starting with {SESSION_DOCS!r} are reserved for chat sessions")
        except InputError as e:
            raise _bad("doc_id" if "document id" in str(e) else "text", str(e)) from None
        if doc_id in mem.require_store().manifest.docs or any(
                j["doc_id"] == doc_id and j["status"] in ("queued", "running") for j in engine.jobs.jobs.values()):
            raise ApiError(409, f"document {doc_id!r} already exists or is being added; DELETE it first",
                           param="doc_id", code="conflict")
        job = engine.jobs.create(text, doc_id, source)
        return {"job_id": job["id"], "doc_id": doc_id, "status": job["status"]}

    @app.get("/v1/jobs/{job_id}")
    async def get_job(job_id: str):
        job = engine.jobs.jobs.get(job_id)
        if job is None:
            raise ApiError(404, f"no job {job_id!r}", param="job_id", code="not_found")
        return engine.jobs.public(job)

    @app.get("/v1/documents")
    async def list_documents():
        store = mem.require_store()          # the store, not the Memory: answers while a deposit runs
        store.refresh()
        docs = sorted(((k, d) for k, d in store.manifest.docs.items() if not k.startswith(SESSION_DOCS)),
                      key=lambda kv: kv[1].created)
        return {"object": "list", "data": [{"doc_id": k, "n_tokens": d.n_tokens, "blocks": len(d.rows),
                                            "source": d.source, "created": d.created} for k, d in docs]}

    @app.delete("/v1/documents/{doc_id}")
    async def delete_document(doc_id: str):
        await worker.run(mem.remove, _check_id(doc_id, "doc_id"))
        return {"doc_id": doc_id, "deleted": True}

    @app.get("/v1/sessions/{session_id}")
    async def get_session(session_id: str):
        s = engine.sessions.data.get(_check_id(session_id, "session_id"))
        if s is None:
            raise ApiError(404, f"no session {session_id!r}", param="session_id", code="not_found")
        return s

    @app.delete("/v1/sessions/{session_id}")
    async def delete_session(session_id: str):
        s = engine.sessions.forget(_check_id(session_id, "session_id"))
        if s is None:
            raise ApiError(404, f"no session {session_id!r}", param="session_id", code="not_found")
        prefix = session_prefix(session_id)

        def forget():
            mem.forget_states(s["states"])
            gone = [d for d in mem.require_store().manifest.docs if d.startswith(prefix)]
            for d in gone:
                mem.remove(d)
            return len(gone)
        n_docs = await worker.run(forget)
        return {"id": session_id, "deleted": True, "states": len(s["states"]), "documents": n_docs}

    return app


def session_prefix(session_id: str) -> str:
    """Doc id prefix of a session's memory: its id hashed, so no session's prefix is another's."""
    import xxhash
    return f"{SESSION_DOCS}{xxhash.xxh3_64_hexdigest(session_id.encode())}:"


def _from_kvmemory(e: KVMemoryError) -> ApiError:
    if isinstance(e, (DocumentNotFoundError, StateNotFoundError)):
        return ApiError(404, str(e), code="not_found")
    if isinstance(e, EmptyStoreError):
        return ApiError(409, str(e), code="no_documents")
    if isinstance(e, VerificationError):
        return ApiError(422, str(e), code="verification_failed")
    if isinstance(e, WindowExceededError):
        return ApiError(400, str(e), code="context_length_exceeded")
    if isinstance(e, InputError):
        return ApiError(400, str(e), code="invalid_value")
    return ApiError(500, f"{type(e).__name__}: {e}", type_="server_error")


def _from_exception(e: Exception) -> ApiError:
    if isinstance(e, ApiError):
        return e
    if isinstance(e, KVMemoryError):
        return _from_kvmemory(e)
    return ApiError(500, f"internal error: {type(e).__name__}", type_="server_error")


def _version() -> str:
    from kvmemory import __version__
    return __version__


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def serve(store, host: str = "127.0.0.1", port: int = 8000, model=None, api_key: str | None = None,
          queue_size: int = 32, max_body_bytes: int = 16 << 20) -> None:
    """Open (or create) the store and serve it until interrupted."""
    import uvicorn

    from kvmemory.memory import Memory
    if not is_loopback(host) and not api_key:
        raise InputError(f"refusing to listen on {host} without an API key: pass --api-key-file or set "
                         "KVMEMORY_API_KEY (only loopback may be served without one)")
    mem = Memory(store, model=model)
    app = create_app(mem, api_key=api_key, queue_size=queue_size, max_body_bytes=max_body_bytes)
    uvicorn.run(app, host=host, port=port, log_level="warning")
