"""The model worker: requests run on `batch` threads (more than `queue_size` admitted get 429 with
Retry-After); their model work is ordered by the Memory's lock, and their decoding is batched: the
sequences of every request in flight decode together in one loop (kvmemory.batching.Batcher), so a
request prepares its window (restore, graft, prefill) while others decode. batch=1: one request
at a time, decoded alone (no batcher). Streamed work sends its text deltas to the client as
server-sent events while it runs."""

from __future__ import annotations

import asyncio
import contextvars
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from kvmemory.server.errors import ApiError
from kvmemory.threads import release as release_team


def _released(fn, *args):
    """fn(*args) on a pool thread, whose OpenMP team (if its work started one outside the Memory's
    lock) is released after: no idle team beside the threads serving (kvmemory/threads.py)."""
    try:
        return fn(*args)
    finally:
        release_team()


class Worker:
    def __init__(self, queue_size: int, mem=None, batch: int = 1, invariant_rows: bool = False) -> None:
        if batch < 1:
            raise ValueError(f"batch must be >= 1, got {batch}")
        self.batcher = None
        init = None
        if batch > 1 and mem is not None:
            from kvmemory.batching import Batcher, serving
            self.batcher = Batcher(mem.model, mem.exclusive(), max_batch=batch, invariant_rows=invariant_rows)
            init = lambda: serving(self.batcher)        # noqa: E731
        self.pool = ThreadPoolExecutor(max_workers=batch if self.batcher is not None else 1,
                                       thread_name_prefix="kvmemory-model", initializer=init)
        self.queue_size = queue_size
        self.pending = 0
        self.released_at = time.monotonic()     # when a request last left (the chat's deferred saves wait for quiet)
        self.lock = threading.Lock()

    def admit(self) -> None:
        with self.lock:
            if self.pending >= self.queue_size:
                raise ApiError(429, f"the server is busy: {self.pending} requests are waiting for the model; "
                                    "retry shortly", type_="rate_limit_error", code="queue_full",
                               headers={"Retry-After": "1"})
            self.pending += 1

    def close(self) -> None:
        if self.batcher is not None:
            self.batcher.close()

    def release(self) -> None:
        with self.lock:
            self.pending -= 1
            self.released_at = time.monotonic()

    async def run(self, fn, *args):
        """Admit, run fn(*args) on the worker thread, release. Raises ApiError 429 when full."""
        self.admit()
        try:
            # the request's context (its id, for every log line) goes with it to the worker thread
            ctx = contextvars.copy_context()
            return await asyncio.get_running_loop().run_in_executor(self.pool, ctx.run, _released, fn, *args)
        finally:
            self.release()

    def stream(self, fn, make_events):
        """Run fn(emit, cancel) on the worker; the response streams the SSE chunks that
        make_events(kind, payload) makes of each ("delta", text), then ("done", result) or
        ("error", exception). A client that goes away sets `cancel`."""
        from fastapi.responses import StreamingResponse

        self.admit()
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        cancel = threading.Event()

        def emit(text: str) -> bool:
            loop.call_soon_threadsafe(q.put_nowait, ("delta", text))
            return cancel.is_set()

        def run():
            try:
                res = fn(emit, cancel)
                loop.call_soon_threadsafe(q.put_nowait, ("done", res))
            except Exception as e:   # noqa: BLE001 -- reported in the stream
                loop.call_soon_threadsafe(q.put_nowait, ("error", e))
            finally:
                release_team()
                self.release()        # whatever became of the client

        loop.run_in_executor(self.pool, contextvars.copy_context().run, run)

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


def sse(obj) -> bytes:
    """One server-sent event: `data: <json>` (or a bare string such as [DONE])."""
    return f"data: {json.dumps(obj) if not isinstance(obj, str) else obj}\n\n".encode()
