"""float32 against bfloat16 on the default model, side by side in one run: speed, and how far
bfloat16 lands from float32.

Three computations of the same weights:
- float32 (the default);
- bfloat16 with the model's own attention (transformers' SDPA in bf16: what kvmemory ran before
  2026-12-04's change);
- bfloat16 with its attention in float32 (kvmemory/model/half.py: what a bf16 Memory runs on CPU).

For each: the canonical prefill (256-token chunks) of --tokens fresh random tokens, tokens/s;
one sequence's decode step after windows of --windows tokens, ms/token (the model's own forward);
a batched decode step of --batch sequences over windows of --batch-window tokens
(kvmemory.batching.step, with the row scheme where the server uses one: bfloat16), ms/step; and
the next-token distribution at the prefill's last --kl-positions positions against float32's,
KL(fp32 || it) mean and max, and the share of positions whose argmax differs. Median of --reps.
JSON + PNG in --out.

    python benchmarks/bench_dtype.py --tokens 1024 --windows 256,1024,4096 --batch 8
"""

from __future__ import annotations

import argparse
import copy
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import add_common_args, describe, finish, plot, seed_of  # noqa: E402

SETTINGS = ("float32", "bfloat16, bf16 attention", "bfloat16, float32 attention")


def _ids(rng, n):
    return [rng.randrange(200, 40000) for _ in range(n)]


def models(base):
    """{setting: model} from the float32 model (copies for the bf16 ones)."""
    from kvmemory.model import half
    bf = copy.deepcopy(base).to(torch.bfloat16)
    bf_half = copy.deepcopy(base).to(torch.bfloat16)
    half.install(bf_half)
    assert half.installed(bf_half) and not half.installed(bf)
    return dict(zip(SETTINGS, (base, bf, bf_half)))


@torch.inference_mode()
def prefill(model, ids, chunk=256, keep=1):
    """The canonical chunked prefill; -> (seconds, cache, logits of the last `keep` positions)."""
    from kvmemory.kv import make_cache
    cache = make_cache(None, model.config)
    t = time.perf_counter()
    for s in range(0, len(ids), chunk):
        out = model(input_ids=torch.tensor([ids[s:s + chunk]]), past_key_values=cache, use_cache=True,
                    logits_to_keep=keep)
    return time.perf_counter() - t, cache, out.logits[0].float()


@torch.inference_mode()
def decode_ms(model, cache, n, rng):
    """ms per token of n one-token forwards after `cache` (fresh tokens; the cache is restored)."""
    from kvmemory.kv import cache_slice, make_cache
    L = cache.get_seq_length()
    t = time.perf_counter()
    for _ in range(n):
        model(input_ids=torch.tensor([[rng.randrange(200, 40000)]]), past_key_values=cache, use_cache=True)
    ms = (time.perf_counter() - t) / n * 1000
    return ms, make_cache(cache_slice(cache, 0, L), model.config)


@torch.inference_mode()
def step_ms(model, caches, n, rows, rng):
    from kvmemory import batching
    for c in caches:
        batching.reserve(c, n + 2)
    batching.step(model, caches, [rng.randrange(200, 40000) for _ in caches], rows)        # warm
    t = time.perf_counter()
    for _ in range(n):
        batching.step(model, caches, [rng.randrange(200, 40000) for _ in caches], rows)
    return (time.perf_counter() - t) / n * 1000


def kl(p_logits, q_logits):
    lp, lq = torch.log_softmax(p_logits, -1), torch.log_softmax(q_logits, -1)
    return (lp.exp() * (lp - lq)).sum(-1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=1024, help="prefill length (fresh random tokens)")
    ap.add_argument("--windows", default="256,1024,4096", help="window lengths of the decode steps")
    ap.add_argument("--decode", type=int, default=24, help="decode steps timed per window")
    ap.add_argument("--batch", type=int, default=8, help="sequences of the batched step")
    ap.add_argument("--batch-window", type=int, default=300, help="window length of each batched sequence")
    ap.add_argument("--kl-positions", type=int, default=256, help="positions compared with float32")
    ap.add_argument("--reps", type=int, default=3)
    add_common_args(ap, out=False)
    ap.add_argument("--out", type=Path, default=None, help="the JSON file (default benchmarks/results/dtype-DATE.json)")
    args = ap.parse_args()
    seed = seed_of(args)
    rng = random.Random(seed)
    from kvmemory.config import RuntimeConfig, from_env
    from kvmemory.model import default_model_dir, load_model
    from kvmemory.model.invariant import InvariantUnavailableError, choose
    cache_dir = from_env(RuntimeConfig).resolved_cache_dir()
    base, _, _ = load_model(default_model_dir(cache_dir), cache_dir=cache_dir)
    windows = [int(w) for w in args.windows.split(",")]
    ids = _ids(rng, max([args.tokens] + windows))
    batch_ids = [_ids(rng, args.batch_window) for _ in range(args.batch)]
    res = {name: {"decode_ms": {}} for name in SETTINGS}
    ms = models(base)
    keep = min(args.kl_positions, args.tokens)
    times = {name: [] for name in SETTINGS}
    logits = {}
    for _ in range(args.reps):              # the settings in turn, rep after rep: a slow spell hits them alike
        for name, model in ms.items():
            dt, _, logits[name] = prefill(model, ids[:args.tokens], keep=keep)
            times[name].append(dt)
    ref = logits[SETTINGS[0]]
    for name in SETTINGS:
        r = res[name]
        r["prefill_tokens_per_s"] = args.tokens / statistics.median(times[name])
        if name != SETTINGS[0]:
            d = kl(ref, logits[name])
            r["kl_vs_float32_mean"], r["kl_vs_float32_max"] = float(d.mean()), float(d.max())
            r["argmax_differs_share"] = float((ref.argmax(-1) != logits[name].argmax(-1)).float().mean())
    for w in windows:
        caches = {name: prefill(model, ids[:w])[1] for name, model in ms.items()}
        got = {name: [] for name in SETTINGS}
        for _ in range(args.reps):
            for name, model in ms.items():
                m, caches[name] = decode_ms(model, caches[name], args.decode, rng)
                got[name].append(m)
        for name in SETTINGS:
            res[name]["decode_ms"][w] = statistics.median(got[name])
    rows, caches, steps = {}, {}, {name: [] for name in SETTINGS}
    for name, model in ms.items():
        try:
            rows[name] = choose(model) if model.dtype == torch.bfloat16 else None
        except InvariantUnavailableError:
            rows[name] = None
        caches[name] = [prefill(model, b)[1] for b in batch_ids]
        res[name]["batch_rows_invariant"] = rows[name] is not None
    for _ in range(args.reps):
        for name, model in ms.items():
            steps[name].append(step_ms(model, caches[name], args.decode, rows[name], rng))
    for name in SETTINGS:
        r = res[name]
        r["step_ms"] = statistics.median(steps[name])
        print(f"{name}: prefill {r['prefill_tokens_per_s']:.0f} tok/s; decode ms/token "
              + ", ".join(f"{w}: {m:.1f}" for w, m in r["decode_ms"].items())
              + f"; a step of {args.batch} x {args.batch_window}: {r['step_ms']:.1f} ms", flush=True)
    out = finish({"results": res}, seed, args, "dtype", args.out)
    print("\n| | prefill tok/s | " + " | ".join(f"decode ms/token, {w} keys" for w in windows)
          + f" | step of {args.batch} (ms) | KL vs fp32 mean / max | argmax differs |")
    print("|---" * (5 + len(windows)) + "|")
    for name, r in res.items():
        print(f"| {name} | {r['prefill_tokens_per_s']:.0f} | " + " | ".join(f"{r['decode_ms'][w]:.1f}" for w in windows)
              + f" | {r['step_ms']:.1f} | "
              + (f"{r['kl_vs_float32_mean']:.2g} / {r['kl_vs_float32_max']:.2g} | {r['argmax_differs_share']:.1%} |"
                 if "kl_vs_float32_mean" in r else "(reference) | |"))
    def draw(fig):
        a1, a2 = fig.subplots(1, 2)
        for name, r in res.items():
            a1.plot(windows, [r["decode_ms"][w] for w in windows], marker="o", label=name)
        a1.set_xlabel("window (keys)")
        a1.set_ylabel("ms per decoded token (one sequence)")
        a1.set_xscale("log", base=2)
        a1.legend()
        a2.bar(range(len(res)), [r["prefill_tokens_per_s"] for r in res.values()])
        a2.set_xticks(range(len(res)), [n.replace(", ", "\n") for n in res], fontsize=8)
        a2.set_ylabel("prefill tokens/s (256-token chunks)")
        fig.suptitle(f"default model, {describe()['cpu']}, {torch.get_num_threads()} threads, seed {seed}")
    plot(out, draw, size=(11, 4), dpi=100)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
