"""BM25 after a write, side by side in one run: what a chat request pays for the turn remembered
before it, as a user's history grows.

Each size is a user's history of N windows of fresh chat turns (bench_chat_memory's generator). Then,
R times: one turn remembered (its window added to the index), then the next request's search
(a question of the benchmark's kinds, drawn afresh). Two indexes on the same turns and questions:

    rebuild    bm25s' index built anew over the corpus after every write (kvmemory's lexical index
               before 2026-12-02: add dropped the built index, the next search rebuilt it)
    in place   kvmemory.index.lexical.LexicalIndex: an inverted index updated by add, scored at
               query time (the same scores: tests/index/test_lexical.py)

And what each write costs on disk: the whole corpus file rewritten (JSON, fsynced: the path before)
against one line appended to the index's log (fsynced). Both rankings are compared (the same top
window ids).

    python benchmarks/bench_lexical.py --sizes 3000,10000,30000 --reps 20
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_chat_memory import FACTS, NEVER, filler  # noqa: E402
from common import describe, seed_of, write_json  # noqa: E402

from kvmemory.index.lexical import LexicalIndex, terms  # noqa: E402


def turn(rng: random.Random) -> str:
    return " ".join(m["content"] for m in filler(rng))


def question(rng: random.Random) -> str:
    club = f"Which club did I mention in week {rng.randint(1, 500)}?"
    return rng.choice([f[2] for f in FACTS.values()] + NEVER + [club])


class Rebuilt:
    """The old path: bm25s over the tokenized corpus, rebuilt on the first search after a change."""

    def __init__(self) -> None:
        self.docs: dict[int, list[str]] = {}
        self.bm = None

    def add(self, ids, texts) -> None:
        for i, t in zip(ids, texts):
            self.docs[i] = terms(t)
        self.bm = None

    def search(self, query: str, k: int) -> list[int]:
        import bm25s
        import numpy as np
        if self.bm is None:
            self.ids = np.fromiter(self.docs, dtype=np.int64, count=len(self.docs))
            self.bm = bm25s.BM25()
            self.bm.index([self.docs[int(i)] or [""] for i in self.ids], show_progress=False)
        q = [t for t in terms(query) if t in self.bm.vocab_dict]
        if not q:
            return []
        s = self.bm.get_scores(q)
        top = np.argpartition(-s, min(k, len(s)) - 1)[:k]
        top = top[np.lexsort((self.ids[top], -s[top]))]
        return [int(self.ids[i]) for i in top if s[i] > 0]


def run(size: int, reps: int, rng: random.Random) -> dict:
    texts = [turn(rng) for _ in range(size)]
    old, new = Rebuilt(), LexicalIndex()
    old.add(list(range(size)), texts)
    new.add(list(range(size)), texts)
    old.search("warm up", 8)
    new.search("warm up", 8)
    d = Path(tempfile.mkdtemp())
    whole, logged = d / "whole.json", d / "logged.json"
    new.save(logged)
    t_old, t_new, w_old, w_new, same = [], [], [], [], 0
    for j in range(reps):
        t, q = turn(rng), question(rng)
        s = time.perf_counter()
        old.add([size + j], [t])
        a = old.search(q, 24)
        t_old.append(time.perf_counter() - s)
        s = time.perf_counter()
        new.add([size + j], [t])
        b = [i for i, _ in new.search(q, 24)]
        t_new.append(time.perf_counter() - s)
        same += a[:8] == b[:8]
        s = time.perf_counter()
        new.save(whole)                                # the write's file, before: the whole corpus
        w_old.append(time.perf_counter() - s)
        s = time.perf_counter()
        new.append(logged, [size + j], [])             # now: one line in the log
        w_new.append(time.perf_counter() - s)
    same_after_load = LexicalIndex.load(logged).ids() == new.ids()
    med = lambda xs: 1000 * statistics.median(xs)                     # noqa: E731
    p90 = lambda xs: 1000 * sorted(xs)[int(0.9 * (len(xs) - 1))]       # noqa: E731
    return {"windows": size, "reps": reps, "rebuild_ms": {"median": med(t_old), "p90": p90(t_old)},
            "in_place_ms": {"median": med(t_new), "p90": p90(t_new)}, "speedup": med(t_old) / med(t_new),
            "same_top8": same, "save_ms": {"median": med(w_old), "p90": p90(w_old)},
            "append_ms": {"median": med(w_new), "p90": p90(w_new)}, "log_reads_back": same_after_load,
            "file_mb": whole.stat().st_size / 1e6}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="3000,10000,30000", help="windows in the user's history (a chat turn: ~1-2)")
    ap.add_argument("--reps", type=int, default=20, help="writes, each followed by a search")
    ap.add_argument("--seed", type=int, default=None, help="default: a fresh draw")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    seed = seed_of(args)
    rng = random.Random(seed)
    rows = [run(int(n), args.reps, rng) for n in args.sizes.split(",")]
    res = {"seed": seed, "machine": describe(), "rows": rows}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"lexical-{time.strftime('%Y-%m-%d')}"
    write_json(stem.with_suffix(".json"), res, seed)
    m = res["machine"]
    print(f"machine: {m['cpu']}, {m['cores']} cores; seed {seed}")
    print("| windows | write + next search: bm25s rebuilt (median / p90) | in place (median / p90) | x faster | "
          "same top 8 | a write on disk: whole file (median) | log line (median) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['windows']:,} | {r['rebuild_ms']['median']:.0f} / {r['rebuild_ms']['p90']:.0f} ms | "
              f"{r['in_place_ms']['median']:.1f} / {r['in_place_ms']['p90']:.1f} ms | x{r['speedup']:.0f} | "
              f"{r['same_top8']}/{r['reps']} | {r['save_ms']['median']:.0f} ms ({r['file_mb']:.1f} MB) | "
              f"{r['append_ms']['median']:.1f} ms |")
    _plot(rows, stem.with_suffix(".png"))
    print(f"wrote {stem}.json and .png")


def _plot(rows, path: Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot", file=sys.stderr)
        return
    x = [r["windows"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(x, [r["rebuild_ms"]["median"] for r in rows], "o-", label="bm25s rebuilt after a write")
    ax.plot(x, [r["in_place_ms"]["median"] for r in rows], "o-", label="in place (kvmemory)")
    ax.plot(x, [r["save_ms"]["median"] for r in rows], "s--", label="a write on disk: whole file")
    ax.plot(x, [r["append_ms"]["median"] for r in rows], "s--", label="a write on disk: log line (kvmemory)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("windows in the user's history")
    ax.set_ylabel("median ms")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
