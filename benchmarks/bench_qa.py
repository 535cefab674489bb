"""QA over stores larger than the window: needle-in-a-haystack and multi-fact questions.

Each size gets a fresh random haystack (shuffled real prose) with fresh needles of three
shapes (magic number, pass key, a fact about a person) at random depths; every needle is
asked about. Side by side in one run, on the same questions:
  full      the whole document in the prompt (only where it fits the model's window)
  rag       text RAG: the blocks kvmemory selected (text selector), their text re-prefilled
  kvm-text  kvmemory: the same blocks grafted from the store (MiniLM selector)
  kvm-keys  kvmemory with the model-internal key selector
Reports accuracy (answer string in the reply), selection recall (needle inside a selected
block), time to first token and tokens prefilled per question; writes JSON and a PNG.

    python benchmarks/bench_qa.py --sizes 6000,32768,131072 --needles 9
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch  # noqa: E402
from haystack import haystack, make_needles  # noqa: E402
from machine import describe  # noqa: E402

import kvmemory  # noqa: E402
from kvmemory import kv as kvops  # noqa: E402


@torch.inference_mode()
def greedy(mem, ids: list[int], max_new: int) -> tuple[str, float]:
    """Prefill ids (block-chunked) and decode greedily; returns (text, time to first token)."""
    t = time.perf_counter()
    cache = kvops.make_cache(None, mem.model.config)
    logits = None
    for s in range(0, len(ids), 512):
        logits = mem.model(input_ids=torch.tensor([ids[s:s + 512]]), past_key_values=cache).logits[0, -1]
    ttft = time.perf_counter() - t
    eos = kvmemory.memory._eos_ids(mem.tokenizer, mem.model)
    out = []
    nxt = int(logits.argmax())
    for _ in range(max_new):
        if nxt in eos:
            break
        out.append(nxt)
        nxt = int(mem.model(input_ids=torch.tensor([[nxt]]), past_key_values=cache).logits[0, -1].argmax())
    return mem.tokenizer.decode(out, skip_special_tokens=True), ttft


def correct(reply: str, answer: str) -> bool:
    return answer.lower() in reply.lower()


def run_size(model, size: int, args, rng: random.Random, work: Path) -> dict:
    tok = model[1]
    needles = make_needles(rng, args.needles)
    text = haystack(rng, tok, size, needles)
    mem = kvmemory.Memory(work / f"qa-{size}.kvm", model=model, segment_blocks=args.segment_blocks)
    doc_ids = tok(text, add_special_tokens=False)["input_ids"]
    t = time.perf_counter()
    mem.add(text, doc_id="haystack", progress=True)
    deposit_s = time.perf_counter() - t
    pre = mem.documents.prelude
    fits = len(pre.ids) + len(doc_ids) + 64 + args.max_new_tokens <= mem.geometry.max_positions
    methods = (["full"] if fits else []) + ["rag", "kvm-text", "kvm-keys"]
    res = {m: {"correct": 0, "recall": 0, "ttft": [], "prefilled": [], "restored": []} for m in methods}
    examples = []
    for nd in needles:
        answers = {}
        for sel in ("text", "keys"):
            a = mem.ask(nd.question, top_k=args.top_k, selector=sel, max_new_tokens=args.max_new_tokens)
            picked = "".join(tok.decode(doc_ids[s:e]) for _, s, e, _ in a.sources)
            r = res[f"kvm-{sel}"]
            r["correct"] += correct(a.text, nd.answer)
            r["recall"] += nd.answer in picked
            r["ttft"].append(a.stats["timings_s"]["ttft"])
            r["prefilled"].append(a.stats["tokens_prefilled"])
            r["restored"].append(a.stats["tokens_restored"])
            answers[f"kvm-{sel}"] = (a.text, a.sources)
        # text RAG over exactly the blocks the text selector grafted, in the same order
        srcs = answers["kvm-text"][1]
        rag_text = "".join(tok.decode(doc_ids[s:e]) for _, s, e, _ in srcs)
        ids = pre.ids + tok(rag_text, add_special_tokens=False)["input_ids"] + pre.question_ids(nd.question)
        t = time.perf_counter()
        reply, ttft = greedy(mem, ids, args.max_new_tokens)
        r = res["rag"]
        r["correct"] += correct(reply, nd.answer)
        r["recall"] += nd.answer in rag_text
        r["ttft"].append(ttft)
        r["prefilled"].append(len(ids))
        r["restored"].append(0)
        answers["rag"] = (reply, None)
        if fits:
            ids = pre.ids + doc_ids + pre.question_ids(nd.question)
            reply, ttft = greedy(mem, ids, args.max_new_tokens)
            r = res["full"]
            r["correct"] += correct(reply, nd.answer)
            r["recall"] += 1
            r["ttft"].append(ttft)
            r["prefilled"].append(len(ids))
            r["restored"].append(0)
            answers["full"] = (reply, None)
        examples.append({"shape": nd.shape, "question": nd.question, "answer": nd.answer,
                         "replies": {m: v[0] for m, v in answers.items()}})
        print(f"  [{size}] {nd.shape:8} {nd.answer:>10}: " +
              "  ".join(f"{m}={'ok' if correct(v[0], nd.answer) else 'x'}" for m, v in answers.items()),
              file=sys.stderr)
    n = len(needles)
    out = {"size": size, "doc_tokens": len(doc_ids), "deposit_s": deposit_s, "questions": n,
           "window": mem.geometry.max_positions, "x_window": len(doc_ids) / mem.geometry.max_positions,
           "methods": {m: {"accuracy": r["correct"] / n, "recall": r["recall"] / n,
                           "ttft_median_s": statistics.median(r["ttft"]),
                           "prefilled_median": statistics.median(r["prefilled"]),
                           "restored_median": statistics.median(r["restored"])} for m, r in res.items()},
           "examples": examples}
    mem.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="6000,32768,131072")
    ap.add_argument("--needles", type=int, default=9)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--segment-blocks", type=int, default=None)
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--seed", type=int, default=None, help="default: a fresh random seed (printed)")
    ap.add_argument("--dir", default=None)
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--tag", default="")
    args = ap.parse_args()
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**31)
    rng = random.Random(seed)
    work = Path(tempfile.mkdtemp(prefix="bench-qa-", dir=args.dir))
    from kvmemory.config import RuntimeConfig, from_env
    from kvmemory.model import load_model
    model, tok, _ = load_model(None, cache_dir=from_env(RuntimeConfig).resolved_cache_dir())
    rows = [run_size((model, tok), int(s), args, rng, work) for s in args.sizes.split(",")]
    machine = describe()
    from kvmemory.documents import SEGMENT_BLOCKS
    result = {"benchmark": "qa", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "seed": seed,
              "machine": machine, "top_k": args.top_k, "segment_blocks": args.segment_blocks or SEGMENT_BLOCKS,
              "rows": rows}
    print(f"\nQA — SmolLM2-135M-Instruct fp32, top_k={args.top_k}, segment_blocks={result['segment_blocks']}, "
          f"seed {seed}; {machine['cpu']}, {machine['cores']} cores")
    print(f"{'doc tokens':>10} {'x win':>6} {'method':>9} {'accuracy':>8} {'recall':>6} {'TTFT s':>7} "
          f"{'prefilled':>9} {'restored':>8}")
    for r in rows:
        for m, v in r["methods"].items():
            print(f"{r['doc_tokens']:10d} {r['x_window']:6.1f} {m:>9} {v['accuracy']:8.0%} {v['recall']:6.0%} "
                  f"{v['ttft_median_s']:7.2f} {v['prefilled_median']:9.0f} {v['restored_median']:8.0f}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d") + (f"-{args.tag}" if args.tag else "")
    (out / f"qa-{stamp}.json").write_text(json.dumps(result, indent=1))
    _plot(rows, out / f"qa-{stamp}.png")
    print(f"wrote {out}/qa-{stamp}.json and .png")
    import shutil
    shutil.rmtree(work, ignore_errors=True)


def _plot(rows, path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    methods = sorted({m for r in rows for m in r["methods"]})
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for m in methods:
        xs = [r["doc_tokens"] for r in rows if m in r["methods"]]
        a.plot(xs, [r["methods"][m]["accuracy"] for r in rows if m in r["methods"]], "o-", label=m)
        b.plot(xs, [r["methods"][m]["ttft_median_s"] for r in rows if m in r["methods"]], "o-", label=m)
    a.set(xscale="log", xlabel="document tokens", ylabel="accuracy", ylim=(-0.05, 1.05), title="QA accuracy")
    b.set(xscale="log", yscale="log", xlabel="document tokens", ylabel="seconds", title="time to first token")
    a.legend()
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
