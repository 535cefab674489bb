"""The app factory: one FastAPI app over one Memory, its exception handlers (every error in OpenAI's
shape), the API-key and body-size guard, and `serve` (uvicorn)."""

from __future__ import annotations

import hmac
import ipaddress
import logging
import threading
import time
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvmemory import __version__
from kvmemory.errors import InputError, KVMemoryError
from kvmemory.options import AskOptions
from kvmemory.server.chat import ChatService
from kvmemory.server.context import Context
from kvmemory.server.errors import DOCUMENTED, ApiError, from_exception, from_validation
from kvmemory.server import logs
from kvmemory.server.jobs import Jobs
from kvmemory.server.metrics import Metrics
from kvmemory.server.persist import SERVE_DIR, store_seal
from kvmemory.server.routes import ROUTERS
from kvmemory.server.routes.web import OPEN as WEB_PATHS
from kvmemory.server.schemas import ErrorResponse
from kvmemory.server.sessions import Sessions
from kvmemory.server.worker import Worker
from kvmemory.threads import release as release_team

ERRORS = {s: {"model": ErrorResponse, "description": "an error in OpenAI's shape"} for s in DOCUMENTED}

log = logging.getLogger("kvmemory.server")

DEFAULT_BATCH = 8                                # requests in flight, decoded together (kvmemory.batching)
# whether batched decoding's rows are reduced alike whatever the batch (create_app's invariant_rows),
# by the model's dtype, as measured (docs/concepts/precision.md; EPYC, 24 greedy replies batched vs alone):
# bfloat16 8-12 of 24 differ without, 0 with, for ~6% of one client's requests/s (a one-row product
# padded to two); float32 0 of 24 differ without, and a one-row product padded to four costs ~18%
DEFAULT_INVARIANT_ROWS = {"bfloat16": True, "float32": False}
OPEN_PATHS = ("/health",) + WEB_PATHS            # the page holds no data: it asks for the key


def _ask_rerank(n) -> int:
    """serve's --ask-rerank, held to what a request may set (AskRequest.rerank: 0..64)."""
    from kvmemory.errors import InputError
    if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= 64:
        raise InputError(f"ask_rerank is how many ranked blocks an ask re-ranks, 0..64 (0: none), got {n!r}")
    return n


def create_app(mem, *, api_key: str | None = None, queue_size: int = 32, max_body_bytes: int = 16 << 20,
               serve_dir: Path | None = None, job_prefix: str = "job-", batch: int = DEFAULT_BATCH,
               ask_rerank: int | None = None, invariant_rows: bool | None = None, dtype_reason: str = "",
               metrics: bool = True) -> FastAPI:
    """The FastAPI app over `mem` (a writable Memory). Starts the deposit thread on startup.
    serve_dir: where jobs and sessions persist (default STORE/serve; one per replica when several
    serve one store); job_prefix: how job ids start (a replica's rank, for routing); batch: how many
    requests run at once, their decoding batched (1: one at a time, decoded alone); ask_rerank: the
    re-rank of an ask that does not set one (None: Memory.ask's default); invariant_rows: the
    batched decoding's Linear products reduce every row the same way whatever the batch, so a
    greedy reply is the one the request gets served alone (kvmemory.batching.Batcher; None: on
    for a bfloat16 model, off for float32, DEFAULT_INVARIANT_ROWS; where this machine's kernels
    allow no row scheme, True raises InvariantUnavailableError and the default logs it and runs
    without); metrics: record what /metrics serves (False: serve --no-metrics, an empty /metrics)."""

    root = Path(serve_dir) if serve_dir is not None else Path(mem.path) / SERVE_DIR
    seal = store_seal(mem)                 # an encrypted store: the files beside it sealed by its key
    sessions = Sessions(root, seal)
    from kvmemory.model import invariant as invariant_ops
    default = invariant_rows is None  # by dtype; invariant mode's rows are invariant already
    if default:
        invariant_rows = not invariant_ops.installed(mem.model) and \
            DEFAULT_INVARIANT_ROWS.get(mem.geometry.dtype, False)
    try:
        worker = Worker(queue_size, mem, batch, invariant_rows)
    except invariant_ops.InvariantUnavailableError as e:
        if not default:               # asked for: refused; the dtype's default: said, and off
            raise
        log.warning("batched decoding runs without invariant rows (a greedy reply may differ from the "
                    "same request served alone): %s", e)
        worker = Worker(queue_size, mem, batch, False)
    c = Context(mem=mem, worker=worker, chat=ChatService(mem, sessions), jobs=Jobs(root, job_prefix, seal),
                sessions=sessions, max_body_bytes=max_body_bytes,
                ask_defaults=AskOptions().but(rerank=None if ask_rerank is None else _ask_rerank(ask_rerank)),
                dtype_reason=dtype_reason)
    c.chat.pending = lambda: c.worker.pending
    c.chat.released = lambda: c.worker.released_at
    c.metrics = Metrics(lambda: _live(c), enabled=metrics)
    c.jobs.on_done = c.metrics.deposited
    release_team()          # this thread's OpenMP team (the row scheme's check ran here): the model is served from others
    stop = threading.Event()

    @asynccontextmanager
    async def lifespan(app):
        def deposits():
            mem.defer_to(lambda: c.worker.pending > 0)      # a deposit gives way to requests between blocks
            c.jobs.run(mem, stop)

        def saves():                                         # replies' saves, deferred: when idle
            while not stop.wait(0.05):
                c.chat.flush()
        t = threading.Thread(target=deposits, name="kvmemory-deposits", daemon=True)
        t.start()
        f = threading.Thread(target=saves, name="kvmemory-saves", daemon=True)
        f.start()
        yield
        stop.set()
        t.join(timeout=5)
        f.join(timeout=5)
        c.chat.flush(all_=True)                              # nothing deferred is lost at shutdown
        c.worker.close()

    app = FastAPI(title="kvmemory", version=__version__, lifespan=lifespan, responses=ERRORS)
    app.state.ctx, app.state.worker = c, c.worker
    for r in ROUTERS:
        app.include_router(r)
    _handlers(app)
    _guard(app, api_key, max_body_bytes, c.metrics)
    return app


def _live(c: Context) -> dict:
    """What /metrics reads at scrape time: the queue, the decode loop, the store, the pager's tiers."""
    b, store = c.worker.batcher, c.mem.store
    pager = c.mem.rt.handle.pager_if_open
    tiers = {t.name: {"hits": t.stats.hits, "misses": t.stats.misses, "evictions": t.stats.evictions,
                      "used_bytes": t.used_bytes}
             for t in ((pager.host, pager.gpu) if pager is not None else ()) if t is not None}
    return {"queue": c.worker.pending, "steps": b.steps if b is not None else 0, "rows": b.rows if b is not None else 0,
            "blocks": store.n_blocks if store is not None else 0,
            "bytes": store.disk_bytes() if store is not None else 0, "tiers": tiers}


def openapi_schema() -> dict:
    """The HTTP API's OpenAPI schema, as a served app publishes it at /openapi.json, built without a
    model or a store (the documentation site renders it: docs/reference/http.md)."""
    app = FastAPI(title="kvmemory", version=__version__, responses=ERRORS)
    for r in ROUTERS:
        app.include_router(r)
    return app.openapi()


def _answer(e: ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


def _handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(request, e: ApiError):
        return _answer(e)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, e):
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
        msg = f"no route {request.method} {request.url.path}" if e.status_code == 404 else str(e.detail)
        return _answer(ApiError(e.status_code, msg, code=code))

    @app.exception_handler(RequestValidationError)
    async def validation(request, e):
        return _answer(from_validation(list(e.errors())))

    @app.exception_handler(KVMemoryError)
    async def kvmemory_error(request, e):          # typed errors answer here, without a traceback in the log
        return _answer(from_exception(e))

    @app.exception_handler(Exception)
    async def internal(request, e):
        return _answer(from_exception(e))


def _guard(app: FastAPI, api_key: str | None, max_body_bytes: int, metrics: Metrics) -> None:
    """The API key (every path but /health) and the body size limit (413), before any route runs; every
    request counted, by its route's template, method and status, and timed to its response's start."""
    def too_large() -> JSONResponse:
        return _answer(ApiError(413, f"the request body is larger than {max_body_bytes} bytes",
                                code="request_too_large"))

    @app.middleware("http")
    async def guard(request: Request, call_next):
        if api_key is not None and request.url.path not in OPEN_PATHS:
            got = request.headers.get("authorization", "")
            if not (got.startswith("Bearer ") and hmac.compare_digest(got[7:].encode(), api_key.encode())):
                return _answer(ApiError(401, "missing or wrong API key (Authorization: Bearer ...)",
                                        code="invalid_api_key"))
        n = request.headers.get("content-length")
        if n is not None and (not n.isdigit() or int(n) > max_body_bytes):
            return too_large()
        if n is None and request.method in ("POST", "PUT", "PATCH") and len(await request.body()) > max_body_bytes:
            return too_large()                     # a chunked body: counted once read
        return await call_next(request)

    # added last, so outermost: a 401 or a 413 from the guard is counted and logged too, with its id
    @app.middleware("http")
    async def count(request: Request, call_next):
        t0 = time.perf_counter()
        rid = logs.request_id(request.headers.get(logs.HEADER))
        token = logs.REQUEST_ID.set(rid)
        try:
            response = await call_next(request)
            seconds = time.perf_counter() - t0
            route = request.scope.get("route")
            metrics.request(getattr(route, "path", "unmatched"), request.method, response.status_code, seconds)
            logs.log_access(request.method, request.url.path, response.status_code, seconds,
                            request.client.host if request.client else None)
            response.headers[logs.HEADER] = rid
            return response
        finally:
            logs.REQUEST_ID.reset(token)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_exposure(host: str, api_key: str | None) -> None:
    """Only loopback may be served without an API key."""
    if not is_loopback(host) and not api_key:
        raise InputError(f"refusing to listen on {host} without an API key: pass --api-key-file or set "
                         "KVMEMORY_API_KEY (only loopback may be served without one)")


def serve(store, host: str = "127.0.0.1", port: int = 8000, model=None, api_key: str | None = None,
          queue_size: int = 32, max_body_bytes: int = 16 << 20, batch: int = DEFAULT_BATCH,
          invariant: bool | None = None, ask_rerank: int | None = None, dtype: str | None = None,
          invariant_rows: bool | None = None, log_level: str = "info", log_format: str = "text",
          device: str | None = None, dtype_reason: str = "", metrics: bool = True) -> None:
    """Open (or create) the store and serve it until interrupted (invariant, dtype, device: Memory's;
    dtype_reason: why it computes in its dtype, said in /health;
    invariant_rows: create_app's; log_level, log_format: kvmemory.server.logs)."""
    import uvicorn

    from kvmemory.memory import Memory
    check_exposure(host, api_key)
    logs.configure(log_level, log_format)
    mem = Memory(store, model=model, invariant=invariant, dtype=dtype, device=device)
    uvicorn.run(create_app(mem, api_key=api_key, queue_size=queue_size, max_body_bytes=max_body_bytes, batch=batch,
                           ask_rerank=ask_rerank, invariant_rows=invariant_rows, dtype_reason=dtype_reason,
                           metrics=metrics),
                host=host, port=port, log_config=None, log_level=log_level)
