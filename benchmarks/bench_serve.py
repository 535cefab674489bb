"""`kvmemory serve` under load: N concurrent clients mixing chat turns and asks for a fixed time.

A real uvicorn on 127.0.0.1 with the real default model; clients are httpx async clients. For each
concurrency (default 1, 8, 32): requests/s, p50/p99 latency, status counts (429 is the bounded
queue saying "busy"; anything else non-200 is an error). Then TTFT (time to the first streamed
token) of a ~4K-token conversation recomputed (a new conversation) vs restored (the same
conversation again: its prefix comes back from the store).

    python benchmarks/bench_serve.py --seconds 60 --clients 1,8,32
"""

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

WORDS = ("harbour ferry lighthouse keeper gull market tide rope anchor lantern fog pier captain cargo "
         "island bell net storm dawn brass scale ledger").split()


def text(rng, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def start(mem, queue_size: int):
    import uvicorn

    from kvmemory.server import create_app
    app = create_app(mem, queue_size=queue_size)
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    t = threading.Thread(target=srv.run, daemon=True)
    t.start()
    while not srv.started:
        time.sleep(0.05)
    return srv, t, f"http://127.0.0.1:{srv.servers[0].sockets[0].getsockname()[1]}"


async def load(url: str, model: str, clients: int, seconds: float, rng: random.Random) -> dict:
    import httpx
    lat, status = [], {}
    stop = time.monotonic() + seconds

    async def client(k: int):
        r = random.Random(rng.randrange(2**31) + k)
        history = [{"role": "system", "content": "You are brief. " + text(r, 40)}]
        async with httpx.AsyncClient(base_url=url, timeout=600) as c:
            while time.monotonic() < stop:
                t = time.perf_counter()
                if r.random() < 0.5:
                    history.append({"role": "user", "content": text(r, 12) + "?"})
                    resp = await c.post("/v1/chat/completions", json={
                        "model": model, "messages": history, "temperature": 0, "max_tokens": 8,
                        "prompt_cache_key": f"bench-{k}"})
                    if resp.status_code == 200:
                        history.append({"role": "assistant", "content": resp.json()["choices"][0]["message"]["content"]})
                    else:
                        history.pop()
                else:
                    resp = await c.post("/v1/ask", json={"question": f"What does the {r.choice(WORDS)} do?",
                                                         "max_new_tokens": 8})
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
            "status": {str(k): v for k, v in sorted(status.items())},
            "errors": sum(v for k, v in status.items() if k not in (200, 429))}


def ttft(url: str, model: str, messages: list) -> tuple[float, int]:
    import httpx
    t = time.perf_counter()
    first = None
    cached = 0
    with httpx.stream("POST", url + "/v1/chat/completions", timeout=900, json={
            "model": model, "messages": messages, "temperature": 0, "max_tokens": 8, "stream": True,
            "stream_options": {"include_usage": True}}) as s:
        for line in s.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            obj = json.loads(line[6:])
            if obj["choices"] and obj["choices"][0]["delta"].get("content") and first is None:
                first = time.perf_counter() - t
            if obj.get("usage"):
                cached = obj["usage"]["prompt_tokens_details"]["cached_tokens"]
    return (first if first is not None else time.perf_counter() - t), cached


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", default="1,8,32")
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--conversation-tokens", type=int, default=4096)
    ap.add_argument("--queue", type=int, default=16)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--out", default=None, help="default benchmarks/results/serve-DATE.json")
    args = ap.parse_args()
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**31)
    rng = random.Random(seed)
    import kvmemory
    from benchmarks.machine import describe
    with tempfile.TemporaryDirectory(prefix="kvm-serve-") as tmp:
        mem = kvmemory.Memory(Path(tmp) / "s.kvm")
        mem.add(". ".join(f"The {rng.choice(WORDS)} of pier {i} is kept by {rng.choice(WORDS)}" for i in range(150)),
                doc_id="harbour")
        srv, t, url = start(mem, args.queue)
        rows = [asyncio.run(load(url, mem.model_name, int(c), args.seconds, rng)) for c in args.clients.split(",")]
        for r in rows:
            print(f"  {r['clients']} clients: {r['requests_per_s']:.2f} req/s, p50 {r['p50_s']}, status {r['status']}",
                  file=sys.stderr)
        # TTFT: a conversation of ~N tokens, recomputed (new) then restored (the same again)
        convo = [{"role": "system", "content": text(rng, int(args.conversation_tokens * 0.9))},
                 {"role": "user", "content": "Summarise the log in one line."}]
        recomputed, c0 = ttft(url, mem.model_name, convo)
        restored, c1 = ttft(url, mem.model_name, convo)
        srv.should_exit = True
        t.join(timeout=30)
        n_tokens = len(mem.tokenizer.apply_chat_template(convo, tokenize=True, add_generation_prompt=True,
                                                         return_dict=False))
        mem.close()
    res = {"benchmark": "serve", "date": time.strftime("%Y-%m-%d"), "seed": seed, "machine": describe(),
           "seconds_per_level": args.seconds, "rows": rows,
           "ttft": {"conversation_tokens": n_tokens, "recomputed_s": recomputed, "restored_s": restored,
                    "cached_tokens_restored": c1, "cached_tokens_recomputed": c0,
                    "speedup": recomputed / restored}}
    out = Path(args.out or Path(__file__).parent / "results" / f"serve-{time.strftime('%Y-%m-%d')}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1))
    print("| clients | req/s | p50 s | p99 s | 200 | 429 | errors |\n|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['clients']} | {r['requests_per_s']:.2f} | {r['p50_s'] or 0:.2f} | {r['p99_s'] or 0:.2f} | "
              f"{r['status'].get('200', 0)} | {r['status'].get('429', 0)} | {r['errors']} |")
    tt = res["ttft"]
    print(f"\nTTFT of a {tt['conversation_tokens']}-token conversation: recomputed {recomputed:.2f} s, restored "
          f"{restored:.2f} s ({tt['speedup']:.0f}x; {c1} tokens restored)")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.5))
        a.plot([r["clients"] for r in rows], [r["requests_per_s"] for r in rows], "o-")
        a.set(xlabel="concurrent clients", ylabel="requests/s", xscale="log", title="throughput")
        b.bar(["recomputed", "restored"], [recomputed, restored])
        b.set(ylabel="seconds", title=f"TTFT, {tt['conversation_tokens']}-token conversation")
        fig.tight_layout()
        fig.savefig(out.with_suffix(".png"), dpi=110)
    except ImportError:
        pass
    return 1 if any(r["errors"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
