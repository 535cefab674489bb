"""Invariant mode against the default kernels, side by side in one run on the default model.

For each mode (the same weights; the invariant one a copy with kvmemory.model.invariant installed):
- exactness: a fresh prompt's KV and last logits prefilled as one pass and in 256-token chunks
  (the canonical way), and a greedy reply decoded alone and in a batch of --batch (torch.equal);
- prefill: the canonical chunked prefill (256-token chunks) of --tokens fresh tokens, tokens/s;
  and one pass over the same tokens (default kernels: the README's "chunked = one pass" claim);
- decode: --decode greedy tokens after a 1,024-token prompt, tokens/s, one sequence and a batch
  of --batch (kvmemory.batching.step).
Median of --reps. JSON + PNG in --out.

    python benchmarks/bench_invariant.py --tokens 4096 --decode 32 --batch 8
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import add_common_args, describe, finish, plot, seed_of  # noqa: E402


def _ids(rng, n):
    return [rng.randrange(200, 40000) for _ in range(n)]


@torch.inference_mode()
def prefill(model, ids, chunk):
    from kvmemory.kv import cache_slice, make_cache
    cache = make_cache(None, model.config)
    t = time.perf_counter()
    for s in range(0, len(ids), chunk):
        out = model(input_ids=torch.tensor([ids[s:s + chunk]]), past_key_values=cache, use_cache=True,
                    logits_to_keep=1)
    dt = time.perf_counter() - t
    kv = cache_slice(cache, 0, len(ids))
    return dt, kv, out.logits[0, -1], cache


@torch.inference_mode()
def decode(model, caches, logits, n):
    """n greedy steps for every cache at once (one: the model's own forward). Returns (s, tokens)."""
    from kvmemory import batching
    toks = [[int(lg.argmax())] for lg in logits]
    t = time.perf_counter()
    for _ in range(n - 1):
        out = batching.step(model, caches, [tk[-1] for tk in toks])
        for tk, lg in zip(toks, out):
            tk.append(int(lg.argmax()))
    return time.perf_counter() - t, toks


def run_mode(model, args, seed):
    rng = random.Random(seed)
    ids = _ids(rng, args.tokens)
    res = {}
    one = [prefill(model, ids, len(ids)) for _ in range(args.reps)]
    chunked = [prefill(model, ids, 256) for _ in range(args.reps)]
    res["prefill_one_pass_tok_s"] = len(ids) / statistics.median(r[0] for r in one)
    res["prefill_chunked_tok_s"] = len(ids) / statistics.median(r[0] for r in chunked)
    res["chunked_equals_one_pass"] = bool(torch.equal(one[0][1], chunked[0][1]) and
                                         torch.equal(one[0][2], chunked[0][2]))
    res["chunked_max_abs_diff"] = float((one[0][1] - chunked[0][1]).abs().max())
    prompts = [_ids(rng, 1024 - 37 * i) for i in range(args.batch)]
    alone, starts = [], []
    for p in prompts:
        _, _, lg, c = prefill(model, p, 256)
        starts.append((lg, c))
    t_alone = []
    for lg, c in starts:
        c2 = copy.deepcopy(c)
        dt, toks = decode(model, [c2], [lg], args.decode)
        t_alone.append(dt)
        alone.append(toks[0])
    caches = [copy.deepcopy(c) for _, c in starts]
    dt_b, together = decode(model, caches, [lg for lg, _ in starts], args.decode)
    res["decode_alone_tok_s"] = (args.decode - 1) / statistics.median(t_alone)
    res["decode_batch_tok_s"] = args.batch * (args.decode - 1) / dt_b
    res["batched_replies_differ"] = sum(a != b for a, b in zip(alone, together))
    res["batch"] = args.batch
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=4096, help="fresh tokens prefilled (one pass and chunked)")
    ap.add_argument("--decode", type=int, default=32, help="greedy tokens decoded a sequence")
    ap.add_argument("--batch", type=int, default=8, help="sequences decoded together")
    ap.add_argument("--reps", type=int, default=3)
    add_common_args(ap)
    ap.add_argument("--tag", default="")
    ap.add_argument("--modes", default="default,invariant", help="default, invariant, or both (the ratios need both)")
    args = ap.parse_args()
    seed = seed_of(args)
    from kvmemory.model import invariant, load_model
    from kvmemory.config import RuntimeConfig
    model, _, _ = load_model(None, cache_dir=RuntimeConfig().resolved_cache_dir())
    wanted = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not wanted or set(wanted) - {"default", "invariant"}:
        ap.error(f"--modes: default and/or invariant, got {args.modes!r}")
    install_s = None
    models = {"default": model}
    if "invariant" in wanted:
        models["invariant"] = copy.deepcopy(model)
        t = time.perf_counter()
        invariant.install(models["invariant"])     # includes the machine check (invariant.check)
        install_s = time.perf_counter() - t
    modes = {}
    for name in wanted:
        modes[name] = run_mode(models[name], args, seed)
        print(name, json.dumps(modes[name]), flush=True)
    d, i = modes.get("default"), modes.get("invariant")
    ratios = {k: i[k] / d[k] for k in ("prefill_one_pass_tok_s", "prefill_chunked_tok_s", "decode_alone_tok_s",
                                      "decode_batch_tok_s")} if d and i else {}
    res = {"install_s": install_s, "modes": modes, "invariant_over_default": ratios,
           "chunked_over_one_pass": {k: v["prefill_chunked_tok_s"] / v["prefill_one_pass_tok_s"]
                                     for k, v in modes.items()}}
    out = finish(res, seed, args, "invariant" + (f"-{args.tag}" if args.tag else ""))
    if ratios:
        print("invariant / default throughput: " + ", ".join(f"{k} x{v:.2f}" for k, v in ratios.items()))
    print("chunked / one pass: " + ", ".join(f"{k} x{v:.2f}" for k, v in res["chunked_over_one_pass"].items()))
    if not ratios:
        return 0
    keys = list(ratios)
    machine = describe()

    def draw(fig):
        ax = fig.subplots()
        xs = range(len(keys))
        ax.bar([x - 0.2 for x in xs], [d[k] for k in keys], 0.4, label="default kernels")
        ax.bar([x + 0.2 for x in xs], [i[k] for k in keys], 0.4, label="invariant")
        ax.set_xticks(list(xs), [k.replace("_tok_s", "").replace("_", " ") for k in keys], fontsize=8)
        ax.set_ylabel("tokens / s")
        ax.set_title(f"invariant vs default kernels ({machine['cpu']}, {machine['torch_threads']} threads)")
        ax.legend()
    plot(out, draw, size=(8, 4))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
