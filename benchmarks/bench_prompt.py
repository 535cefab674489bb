"""Prompt layout for document QA: which words around the excerpts let the model answer best.

The model is given only the gold passage (the 256-token block(s) of a fresh haystack that hold
the needle, cut on block boundaries exactly as a deposit cuts them), so this measures the
model's ceiling under each layout, with no selection or grafting in the way. Fresh needles
of the four shapes of bench_qa.py every run; every layout answers the same questions.

    python benchmarks/bench_prompt.py --questions 60
"""

from __future__ import annotations

import argparse
import random
import sys
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_qa import correct, greedy, needle_blocks, token_offsets, wilson  # noqa: E402
from haystack import SHAPES, haystack, make_questions  # noqa: E402
from common import seed_of, write_json  # noqa: E402

from kvmemory.documents import Prelude, PromptLayout, text_ids  # noqa: E402

LAYOUTS = {
    "default": PromptLayout(),
    "answer-prefix": PromptLayout(answer_prefix="The answer is"),
    "exact-words": PromptLayout(system="You are a helpful assistant. Answer the question with the exact words "
                                       "from the document excerpts."),
    "read-then-ask": PromptLayout(system="You are a helpful assistant.",
                                  intro="Read these excerpts from a document.\n\n",
                                  question="\n\nUsing only the excerpts above, answer: {q}"),
    "separators": PromptLayout(intro="Document excerpts:\n---\n", question="\n---\nQuestion: {q}"),
    "question-only": PromptLayout(system="You are a helpful assistant.", intro="", question="\n\n{q}"),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--questions", type=int, default=60)
    ap.add_argument("--per-doc", type=int, default=8)
    ap.add_argument("--doc-tokens", type=int, default=3000)
    ap.add_argument("--max-new-tokens", type=int, default=20)
    ap.add_argument("--layouts", default=",".join(LAYOUTS))
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--tag", default="")
    args = ap.parse_args()
    seed = seed_of(args)
    rng = random.Random(seed)
    from kvmemory.config import RuntimeConfig, from_env
    from kvmemory.model import load_model
    model, tok, _ = load_model(None, cache_dir=from_env(RuntimeConfig).resolved_cache_dir())
    names = args.layouts.split(",")
    preludes = {n: Prelude(tok, LAYOUTS[n]) for n in names}
    res = {n: [] for n in names}
    shapes: list[str] = []
    C = 256
    left = args.questions
    while left > 0:
        qs = make_questions(rng, min(args.per_doc, left))
        left -= len(qs)
        text = haystack(rng, tok, args.doc_tokens, qs)
        ids = text_ids(tok, text)
        offsets = token_offsets(tok, text, ids)
        for q in qs:
            blocks = sorted(set().union(*(needle_blocks(tok, text, ids, nd, C, offsets) for nd in q.needles)))
            gold = [t for b in blocks for t in ids[b * C:(b + 1) * C]]
            shapes.append(q.shape)
            line = []
            for n, pre in preludes.items():
                reply, _, _ = greedy(model, tok, pre.ids + gold + pre.question_ids(q.question), args.max_new_tokens)
                res[n].append(correct(reply, q.answers))
                line.append(f"{n}={'ok' if res[n][-1] else 'x'}")
            print(f"  {q.shape:8} {'/'.join(q.answers):>16}: " + "  ".join(line), file=sys.stderr, flush=True)
    n = len(shapes)
    table = {}
    print(f"\nprompt layouts, model given the gold passage only; {n} questions, seed {seed}")
    print(f"{'layout':>14} {'accuracy':>8} {'95% CI':>11} " + " ".join(f"{s:>8}" for s in SHAPES))
    for name, oks in res.items():
        k = sum(oks)
        by = {s: sum(o for o, sh in zip(oks, shapes) if sh == s) / max(1, shapes.count(s)) for s in SHAPES}
        table[name] = {"accuracy": k / n, "ci95": wilson(k, n), "by_shape": by, "layout": LAYOUTS[name].__dict__}
        lo, hi = wilson(k, n)
        print(f"{name:>14} {k / n:8.0%} {lo:5.0%}-{hi:4.0%} " + " ".join(f"{by[s]:8.0%}" for s in SHAPES))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d") + (f"-{args.tag}" if args.tag else "")
    write_json(out / f"prompt-{stamp}.json", {"benchmark": "prompt", "questions": n, "layouts": table}, seed)
    print(f"wrote {out}/prompt-{stamp}.json")


if __name__ == "__main__":
    main()
