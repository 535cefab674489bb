"""`kvmemory serve STORE --ray [ADDRESS] --replicas N`: the HTTP server of kvmemory.server as N
Ray Serve replicas reading one store, with chat sessions routed to the replica that holds them.

    client -> Ray Serve proxy -> Router (ingress) --handle--> Replica 0..N-1 (a Memory + the FastAPI app each)

Each replica runs the same FastAPI app as `kvmemory serve` over its own Memory on the shared
store (its own model, host-RAM tier and, on S3, disk tier); replica i is its own Ray Serve
deployment (kvmemory-replica-i, restarted by Serve if it dies). The Router reads the request's
session (the `x-session-id` header, or `prompt_cache_key` / `user` in a chat request's body, or
the id in /v1/sessions/ID) and sends every request of a session to the same replica, chosen by
rendezvous hashing of the session id over the replicas: the replica whose host RAM already holds
the session's KV. Should that replica fail the call, the next one in the session's order serves
it (restoring the session's states from the store: slower, the same answer). Deposit jobs are
numbered per replica (job-r<rank>-...) and their polls go to that replica. Requests without a
session are spread round-robin.

(Ray Serve's own model multiplexing was tried for this and did not keep a session on one replica
here: routing information reaches the router asynchronously, so a session's second request often
went to the other replica. Hashing is deterministic.)

Responses carry `x-kvmemory-replica: <rank>`. Jobs and session records persist per replica
(STORE work dir/serve/replica-<rank>/), the store itself is shared.
"""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

from kvmemory.errors import InputError, MissingDependencyError

_JOB = re.compile(r"^/v1/jobs/job-r(\d+)-")
_SESSION_PATH = re.compile(r"^/v1/sessions/([^/]+)$")
_HOP = {"host", "content-length", "transfer-encoding", "connection", "keep-alive"}


def _serve():
    try:
        import ray
        from ray import serve
    except ImportError:
        raise MissingDependencyError("--ray needs Ray Serve: pip install 'kvmemory[ray]'") from None
    return ray, serve


def route_key(method: str, path: str, headers: dict, body: bytes) -> str:
    """The multiplexed-model id a request is routed by: "session:<id>", "rank:<n>" or "" (any replica)."""
    m = _JOB.match(path)
    if m:
        return f"rank:{int(m.group(1))}"
    sid = headers.get("x-session-id")
    m = _SESSION_PATH.match(path)
    if m:
        sid = m.group(1)
    if sid is None and path == "/v1/chat/completions" and body:
        try:
            data = json.loads(body)
            if isinstance(data, dict):
                sid = data.get("prompt_cache_key") or data.get("user")
        except (ValueError, UnicodeDecodeError):
            pass                                    # the replica answers 400 for it
    return f"session:{sid}" if isinstance(sid, str) and sid else ""


async def _call_asgi(app, method: str, path: str, query: str, headers: list, body: bytes):
    """Run one HTTP request through an ASGI app in this process; yields (status, headers) first,
    then the body as it is sent (server-sent events stream through)."""
    q: asyncio.Queue = asyncio.Queue()
    sent = False

    async def receive():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.Event().wait()                # the client never disconnects first

    async def send(msg):
        await q.put(msg)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": query.encode(), "root_path": "",
             "headers": [(k.encode("latin-1"), v.encode("latin-1")) for k, v in headers],
             "client": ("127.0.0.1", 0), "server": ("kvmemory-replica", 80)}
    task = asyncio.create_task(app(scope, receive, send))
    try:
        while True:
            getter = asyncio.ensure_future(q.get())
            done, _ = await asyncio.wait({getter, task}, return_when=asyncio.FIRST_COMPLETED)
            if getter not in done:
                getter.cancel()
                task.result()                       # raises what the app raised
                return
            msg = getter.result()
            if msg["type"] == "http.response.start":
                yield ("start", msg["status"], [(k.decode("latin-1"), v.decode("latin-1"))
                                                for k, v in msg.get("headers", [])])
            elif msg["type"] == "http.response.body":
                if msg.get("body"):
                    yield msg["body"]
                if not msg.get("more_body", False):
                    return
    finally:
        if not task.done():
            task.cancel()


def order(key: str, n: int) -> list[int]:
    """Replicas in the order a routing key prefers them (rendezvous hashing): stable for a key, spread
    evenly over keys, and when a replica is removed only its keys move."""
    import xxhash

    return sorted(range(n), key=lambda i: xxhash.xxh3_64_intdigest(f"{i}:{key}".encode()), reverse=True)


class Replica:
    """One Memory and the FastAPI app over it."""

    def __init__(self, rank: int, store: str, model, api_key, queue_size: int, max_body_bytes: int,
                 storage_options, batch: int | None = None, invariant: bool | None = None,
                 ask_rerank: int | None = None, dtype: str | None = None,
                 invariant_rows: bool | None = None, device: str | None = None) -> None:
        from kvmemory.memory import Memory
        from kvmemory.server.app import DEFAULT_BATCH, create_app
        from kvmemory.server.persist import SERVE_DIR

        self.rank = int(rank)
        kw = {"storage_options": storage_options} if storage_options else {}
        self.mem = Memory(store, model=model, invariant=invariant, dtype=dtype, device=device, **kw)
        self.app = create_app(self.mem, api_key=api_key, queue_size=queue_size, max_body_bytes=max_body_bytes,
                              serve_dir=Path(self.mem.path) / SERVE_DIR / f"replica-{self.rank}",
                              job_prefix=f"job-r{self.rank}-", batch=DEFAULT_BATCH if batch is None else batch,
                              ask_rerank=ask_rerank, invariant_rows=invariant_rows)
        self._life = None

    async def _start(self) -> None:
        if self._life is None:
            self._life = self.app.router.lifespan_context(self.app)
            await self._life.__aenter__()          # the deposit thread

    async def ping(self) -> int:
        await self._start()
        return self.rank

    async def relay(self, method: str, path: str, query: str, headers: list, body: bytes):
        await self._start()
        async for part in _call_asgi(self.app, method, path, query, headers, body):
            if isinstance(part, tuple):
                yield (part[1], part[2] + [("x-kvmemory-replica", str(self.rank))])
            else:
                yield part


class Router:
    """The ingress: forwards each HTTP request to a replica chosen by its session."""

    def __init__(self, *replicas) -> None:
        self.replicas = list(replicas)
        self.next = 0

    def candidates(self, key: str) -> list[int]:
        n = len(self.replicas)
        if key.startswith("rank:"):
            r = int(key[5:])
            return [r] + [i for i in range(n) if i != r] if r < n else list(range(n))
        if key:
            return order(key, n)
        self.next = (self.next + 1) % n
        return [(self.next + i) % n for i in range(n)]

    async def __call__(self, request):
        from starlette.responses import StreamingResponse

        body = await request.body()
        headers = [(k, v) for k, v in request.headers.items() if k.lower() not in _HOP]
        key = route_key(request.method, request.url.path, {k.lower(): v for k, v in headers}, body)
        last = None
        for i in self.candidates(key):
            gen = self.replicas[i].options(stream=True).relay.remote(
                request.method, request.url.path, request.url.query, headers, body)
            try:
                status, out_headers = await gen.__anext__()
                break
            except Exception as e:                   # the replica is down: the next in this key's order
                last = e
        else:
            raise last

        async def rest():
            async for chunk in gen:
                yield chunk
        hdrs = {k: v for k, v in out_headers if k.lower() not in _HOP}
        return StreamingResponse(rest(), status_code=status, headers=hdrs)


def build(store, replicas: int = 2, model=None, api_key: str | None = None, queue_size: int = 32,
          max_body_bytes: int = 16 << 20, storage_options: dict | None = None, num_cpus: float = 1,
          num_gpus: float | None = None, batch: int | None = None, invariant: bool | None = None,
          ask_rerank: int | None = None, dtype: str | None = None, invariant_rows: bool | None = None,
          device: str | None = None):
    """The Ray Serve application (Router over `replicas` Replica copies)."""
    ray, serve = _serve()
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
        raise InputError(f"replicas must be an integer >= 1, got {replicas!r}")
    if num_gpus is None:
        num_gpus = 1 if ray.is_initialized() and ray.cluster_resources().get("GPU", 0) >= replicas else 0
    model = None if model is None else str(model)
    reps = [serve.deployment(Replica, name=f"kvmemory-replica-{i}", num_replicas=1,
                             ray_actor_options={"num_cpus": num_cpus, "num_gpus": num_gpus},
                             max_ongoing_requests=queue_size + 8).bind(i, str(store), model, api_key, queue_size,
                                                                        max_body_bytes, storage_options, batch,
                                                                        invariant, ask_rerank, dtype,
                                                                        invariant_rows, device)
            for i in range(replicas)]
    front = serve.deployment(Router, name="kvmemory-router", num_replicas=1, ray_actor_options={"num_cpus": 0})
    return front.bind(*reps)


def serve_ray(store, host: str = "127.0.0.1", port: int = 8000, replicas: int = 2, address: str | None = None,
              model=None, api_key: str | None = None, queue_size: int = 32, max_body_bytes: int = 16 << 20,
              storage_options: dict | None = None, blocking: bool = True, batch: int | None = None,
              invariant: bool | None = None, ask_rerank: int | None = None, dtype: str | None = None,
              invariant_rows: bool | None = None, device: str | None = None):
    """Start (or join) a Ray cluster, run the application on host:port; blocks until interrupted
    unless blocking=False (then returns the Router's handle)."""
    from kvmemory.server.app import check_exposure

    check_exposure(host, api_key)
    ray, serve = _serve()
    if not ray.is_initialized():
        ray.init(address=address, log_to_driver=False, include_dashboard=False)
    serve.start(http_options={"host": host, "port": port})
    app = build(store, replicas, model, api_key, queue_size, max_body_bytes, storage_options, batch=batch,
                invariant=invariant, ask_rerank=ask_rerank, dtype=dtype, invariant_rows=invariant_rows,
                device=device)
    handle = serve.run(app, name="kvmemory", route_prefix="/")
    for i in range(replicas):                       # every replica up: model loaded, deposit thread started
        serve.get_deployment_handle(f"kvmemory-replica-{i}", app_name="kvmemory").ping.remote().result()
    if blocking:
        import time

        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            serve.shutdown()
    return handle
