"""Does a commit cost the same in a big store as in an empty one?

Builds a store of --tokens synthetic tokens the way `Memory.add` fills one: documents of
--doc-segments segments, each segment (4 blocks of 256 tokens) one commit behind a shared
prelude state, then one commit for the document's entry. Times every commit, and reports the
mean time of the last 1% of segment commits over the first 1% (target: <= 1.2), plus the time to
open the store and to describe it (`kvmemory info`) at the end against the start.

KV bytes are synthetic (random) in the geometry of --geometry: "tiny" (2 layers, 2 KV heads,
head_dim 16: 64 KB blocks, so per-commit overheads dominate: the hard case for this ratio) or
"default" (the default model's 30 layers, 3 KV heads, 64: 11.8 MB blocks; 1M tokens is 48 GB).

    python benchmarks/bench_commit_cost.py --tokens 1048576
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import add_common_args, finish, plot, seed_of  # noqa: E402

GEOMETRY = {"tiny": (2, 2, 16), "default": (30, 3, 64)}   # layers, kv_heads, head_dim


def build(root: Path, tokens: int, geometry: str, doc_segments: int, rng: np.random.Generator,
          progress: bool = True) -> dict:
    from kvmemory import hashing
    from kvmemory.store.manifest import DocEntry, Manifest, StateEntry
    from kvmemory.store import BlockStore, Change, NewBlock
    from kvmemory.store.info import describe

    L, H, D = GEOMETRY[geometry]
    C, S, seg_blocks = 256, 4, 4
    fp = "kvm1-bench-commit-cost"
    store = BlockStore.create(root, Manifest(fingerprint=fp, block_tokens=C, shard_blocks=S, codec="none",
                                             kv_dtype="float32",
                                             model={"name": "synthetic", "layers": L, "kv_heads": H, "head_dim": D,
                                                    "max_positions": 8192}))

    def next_row(s) -> int:
        return s.next_row if hasattr(s, "next_row") else s.manifest.n_blocks   # also runs on the old layout

    base = rng.standard_normal((L, 2, H, C, D), dtype=np.float32)
    prelude_tokens = rng.integers(0, 49152, 100).tolist()
    pid = hashing.chain_ids(fp, prelude_tokens, C)[0]

    def prelude(s):
        kv = base[:, :, :, :100].copy()
        return Change([NewBlock(pid, -1, np.array(prelude_tokens), np.arange(100), kv)],
                      {pid.hex(): StateEntry(last_row=next_row(s), n_tokens=100)})
    store.commit(prelude)
    prelude_row = store.row_of(pid)
    seg_times, doc_times = [], []
    t_open0 = _time(lambda: BlockStore.open(root))
    t_info0 = _time(lambda: describe(BlockStore.open(root)))
    n_segments = tokens // (seg_blocks * C)
    bar = None
    if progress and sys.stderr.isatty():
        from tqdm import tqdm
        bar = tqdm(total=n_segments, desc="segments", unit="seg")
    doc_rows: list[int] = []
    serial = 0
    for seg in range(n_segments):
        toks = rng.integers(0, 49152, seg_blocks * C).tolist()
        ids = hashing.chain_ids(fp, toks, C, parent=pid, start=100)
        blocks = []
        for i, bid in enumerate(ids):
            kv = base.copy()
            kv[0, 0, 0, 0, 0] = serial                       # distinct bytes
            serial += 1
            blocks.append((bid, toks[i * C:(i + 1) * C], np.arange(100 + i * C, 100 + (i + 1) * C), kv))
        rows: list[int] = []

        def build_seg(s):
            new, parent = [], prelude_row
            rows.clear()
            for bid, t, pos, kv in blocks:
                row = next_row(s) + len(new)
                new.append(NewBlock(bid, parent, np.array(t), pos, kv))
                rows.append(row)
                parent = row
            return Change(new)
        t = time.perf_counter()
        store.commit(build_seg)
        seg_times.append(time.perf_counter() - t)
        doc_rows += rows
        if (seg + 1) % doc_segments == 0 or seg == n_segments - 1:
            entry = DocEntry(rows=list(doc_rows), n_tokens=len(doc_rows) * C, segments=doc_segments)
            name = f"doc{seg}"
            t = time.perf_counter()
            store.commit(lambda s: Change(docs={name: entry}))
            doc_times.append(time.perf_counter() - t)
            doc_rows = []
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    k = max(1, len(seg_times) // 100)
    first, last = statistics.mean(seg_times[:k]), statistics.mean(seg_times[-k:])
    return {"tokens": n_segments * seg_blocks * C, "geometry": geometry, "block_bytes": base.nbytes,
            "segment_commits": len(seg_times), "doc_commits": len(doc_times), "one_percent": k,
            "first_1pct_ms": first * 1e3, "last_1pct_ms": last * 1e3, "ratio_last_over_first": last / first,
            "median_ms": statistics.median(seg_times) * 1e3,
            "doc_commit_first_ms": doc_times[0] * 1e3, "doc_commit_last_ms": doc_times[-1] * 1e3,
            "open_ms_empty": t_open0 * 1e3, "open_ms_full": _time(lambda: BlockStore.open(root)) * 1e3,
            "info_ms_empty": t_info0 * 1e3, "info_ms_full": _time(lambda: describe(BlockStore.open(root))) * 1e3,
            "segment_ms_all": [round(x * 1e3, 3) for x in seg_times]}


def _time(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=1 << 20)
    ap.add_argument("--geometry", choices=sorted(GEOMETRY), default="tiny")
    ap.add_argument("--doc-segments", type=int, default=8, help="segments per document (default 8)")
    add_common_args(ap)
    ap.add_argument("--dir", default=None, help="where to build the store (default: a temp dir)")
    ap.add_argument("--json", type=Path, default=None, help="the JSON file (default --out/commit-cost-DATE.json)")
    args = ap.parse_args()
    seed = seed_of(args)
    with tempfile.TemporaryDirectory(prefix="kvm-commit-", dir=args.dir) as tmp:
        res = build(Path(tmp) / "s.kvm", args.tokens, args.geometry, args.doc_segments, np.random.default_rng(seed))
    out = finish(res, seed, args, "commit-cost", args.json)

    def draw(fig):
        ax = fig.subplots()
        ax.plot(res["segment_ms_all"], ".", ms=2)
        ax.set_xlabel("segment commit #")
        ax.set_ylabel("ms")
        ax.set_title(f"commit time over a {res['tokens']:,}-token build ({args.geometry} geometry)")
    plot(out, draw, size=(7, 3.5))
    print(f"| tokens | geometry | segment commits | first 1% ms | last 1% ms | ratio | open empty/full ms | "
          f"info empty/full ms |\n|---|---|---|---|---|---|---|---|\n| {res['tokens']:,} | {args.geometry} | "
          f"{res['segment_commits']} | {res['first_1pct_ms']:.1f} | {res['last_1pct_ms']:.1f} | "
          f"{res['ratio_last_over_first']:.2f} | {res['open_ms_empty']:.0f} / {res['open_ms_full']:.0f} | "
          f"{res['info_ms_empty']:.0f} / {res['info_ms_full']:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
