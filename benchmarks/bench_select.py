"""Selection recall at scale: does the ranking put the needle's block in the top k?

Selection does not read KV, so this measures it on stores far larger than a CPU can prefill
in a session: the haystack is tokenized and cut into blocks exactly as a deposit cuts it
(C = 256 tokens), each block is cut into windows and indexed exactly as Documents does
(index/windows.py, MiniLM, BM25), and fresh questions of bench_qa.py's four shapes are
ranked with each selector (a fifth of them about the haystack's real prose). The key selector needs the blocks' KV: it is measured by
bench_qa.py only. Also: recall of the fp16 flat scan and of an IVF index (the forms VectorIndex takes past
its thresholds) against the exact index on the same windows, and the fusion weights.

    python benchmarks/bench_select.py --sizes 131072,1048576 --questions 60
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time

import numpy as np
from tqdm import tqdm
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_qa import needle_blocks, token_offsets  # noqa: E402
from haystack import haystack, make_questions, real_questions  # noqa: E402
from common import seed_of, write_json  # noqa: E402

from kvmemory.documents import text_ids  # noqa: E402
from kvmemory.index import VectorIndex  # noqa: E402
from kvmemory.index import windows as win  # noqa: E402
from kvmemory.index.embedder import TextEmbedder  # noqa: E402
from kvmemory.index.fusion import best_per_block, rrf  # noqa: E402
from kvmemory.index.lexical import LexicalIndex  # noqa: E402
from kvmemory.retrieve import FUSION_K, FUSION_WEIGHTS, MIN_POOL, WINDOWS_PER_BLOCK  # noqa: E402

KS = (1, 2, 4, 8)
C = 256


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="131072,1048576")
    ap.add_argument("--questions", type=int, default=60)
    ap.add_argument("--weights", default="0.05:1:10,0.3:1:10,1:1",
                    help="dense:bm25[:k] fusion weights (and RRF constant, default 60) to compare")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--tag", default="")
    ap.add_argument("--nprobe", default="",
                    help="IVF lists probed, a sweep (e.g. 8,16,32,64,128): needle recall@k, overlap of IVF's "
                         "top windows with the exact index's, and query time for each (default: the index's own)")
    ap.add_argument("--hnsw-ef", default="",
                    help="also an HNSW index (M 32) over the same windows, a sweep of efSearch (e.g. 16,64,256): "
                         "the same recall, overlap and query time, and its build time")
    ap.add_argument("--cache", default="",
                    help="a folder to keep the window vectors in (keyed by seed and size): a second run with "
                         "the same --seed skips the embedding")
    ap.add_argument("--prose", choices=("stdlib", "site"), default="stdlib",
                    help="the haystack's prose: the standard library's docstrings (~0.1M tokens, repeated past "
                         "that) or every installed package's too (~5M tokens: IVF measured on text that does not "
                         "repeat itself, whose copies would tie in every search)")
    args = ap.parse_args()
    seed = seed_of(args)
    print(f"seed {seed}", file=sys.stderr)
    rng = random.Random(seed)
    from transformers import AutoTokenizer

    from kvmemory.config import RuntimeConfig, from_env
    from kvmemory.model import default_model_dir
    tok = AutoTokenizer.from_pretrained(default_model_dir(from_env(RuntimeConfig).resolved_cache_dir()))
    emb = TextEmbedder()
    weights = [tuple(float(x) for x in w.split(":")) for w in args.weights.split(",")]
    weights = [w if len(w) == 3 else (*w, 60.0) for w in weights]        # dense:bm25[:rrf k]
    rows = []
    t0 = time.perf_counter()

    def phase(what: str) -> None:      # a long run says where it is, even without a TTY
        print(f"[{time.perf_counter() - t0:7.0f} s] {what}", file=sys.stderr, flush=True)

    for size in (int(s) for s in args.sizes.split(",")):
        phase(f"{size:,} tokens: drawing the haystack")
        qs = make_questions(rng, args.questions - args.questions // 5)
        text = haystack(rng, tok, size, qs, prose=args.prose)
        qs += real_questions(rng, text, args.questions // 5)      # about the real prose, as bench_qa.py
        ids = text_ids(tok, text)
        offsets = token_offsets(tok, text, ids)
        blocks = [tok.decode(ids[i:i + C]) for i in range(0, len(ids), C)]
        t = time.perf_counter()
        phase(f"{len(ids):,} tokens, {len(blocks):,} blocks: cutting and embedding windows")
        per_block = win.block_windows(lambda s: emb.pieces(s)[0], blocks, [None] + blocks[:-1])
        wids = [win.window_id(r, w) for r, ws in enumerate(per_block) for w in range(len(ws))]
        pieces = [p for ws in per_block for p in ws]
        dense = VectorIndex(384, fp16_threshold=10**12, ivf_threshold=10**12)     # the exact fp32 scan
        kept = Path(args.cache) / f"select-{seed}-{size}.npy" if args.cache else None
        if kept is not None and kept.exists() and np.load(kept, mmap_mode="r").shape == (len(wids), 384):
            vecs = np.load(kept)
            phase(f"reusing the window vectors in {kept} (same seed and size)")
        else:
            bar = tqdm(per_block, desc=f"embedding {len(wids):,} windows", unit="block",
                       disable=not sys.stderr.isatty())
            vecs = np.concatenate([emb.embed_pieces(ws) for ws in bar if ws])    # per block, as a deposit
            if kept is not None:
                kept.parent.mkdir(parents=True, exist_ok=True)
                np.save(kept, vecs)
        dense.add(wids, vecs)
        embed_s = time.perf_counter() - t
        phase(f"embedded {len(wids):,} windows in {embed_s:.0f} s; BM25, IVF, the questions")
        t = time.perf_counter()
        lex = LexicalIndex()
        lex.add(wids, [emb.tokenizer.decode(p) for p in pieces])
        lex.search("warm up", 1)
        bm25_s = time.perf_counter() - t
        ivf = VectorIndex(384, ivf_threshold=0)
        ivf.add(wids, vecs)
        import faiss
        inner = faiss.downcast_index(ivf.index.index)
        own_nprobe, nlist = inner.nprobe, inner.nlist
        qvs, golds, lexical, exact = [], [], [], []     # per question: vector, needles' blocks, BM25 order, flat hits
        methods = ["dense", "bm25", "ivf"] + [f"rrf {a:g}:{b:g}:{k:g}" for a, b, k in weights]
        hit = {m: {k: 0 for k in KS} for m in methods}
        pool = max(MIN_POOL, max(KS) * WINDOWS_PER_BLOCK)
        lat = {"dense": [], "bm25": [], "ivf": [], "flat_scan": []}
        for q in qs:
            gold = [needle_blocks(tok, text, ids, nd, C, offsets) for nd in q.needles]
            t = time.perf_counter()
            qv = emb.embed([q.question])[0]
            qvs.append(qv)
            golds.append(gold)
            ts = time.perf_counter()
            exact.append(dense.search(qv, pool))
            lat["flat_scan"].append(time.perf_counter() - ts)
            d = [r for r, _ in best_per_block(exact[-1], win.row_of)]
            lat["dense"].append(time.perf_counter() - t)
            t = time.perf_counter()
            b = [r for r, _ in best_per_block(lex.search(q.question, pool), win.row_of)]
            lat["bm25"].append(time.perf_counter() - t)
            lexical.append(b)
            t = time.perf_counter()
            v = [r for r, _ in best_per_block(ivf.search(qv, pool), win.row_of)]
            lat["ivf"].append(time.perf_counter() - t)
            ranked = {"dense": d, "bm25": b, "ivf": v}
            for a, bw, rk in weights:
                ranked[f"rrf {a:g}:{bw:g}:{rk:g}"] = [r for r, _ in rrf([d, b], k=int(rk), weights=[a, bw])]
            for m, order in ranked.items():
                for k in KS:
                    hit[m][k] += all(g & set(order[:k]) for g in gold)
        n = len(qs)

        pos_of = {w: i for i, w in enumerate(wids)}

        def sweep_of(search, index, setting: str, values) -> list[dict]:
            """For each value of index.<setting>: recall of search(qv, k) against the exact index."""
            out = []
            for value in values:
                setattr(index, setting, value)
                got, fused = {k: 0 for k in KS}, {k: 0 for k in KS}
                overlap, by_score, ms = [], [], []
                for qv, gold, b, flat in zip(qvs, golds, lexical, exact):
                    t = time.perf_counter()
                    hits = search(qv, pool)
                    ms.append(1000 * (time.perf_counter() - t))
                    overlap.append(len({i for i, _ in flat} & {i for i, _ in hits}) / max(1, len(flat)))
                    # recall@pool as ANN benchmarks count it: hits whose exact score is at least the exact
                    # pool-th score (ties, such as copies of one window, then count whichever copy was
                    # returned; an index of rounded codes is judged by the true scores of what it returns)
                    by_score.append(sum(float(vecs[pos_of[i]] @ qv) >= flat[-1][1] - 1e-5 for i, _ in hits)
                                    / max(1, len(flat)))
                    order = [r for r, _ in best_per_block(hits, win.row_of)]
                    both = [r for r, _ in rrf([order, b], k=FUSION_K, weights=[FUSION_WEIGHTS["dense"],
                                                                                  FUSION_WEIGHTS["bm25"]])]
                    for k in KS:
                        got[k] += all(g & set(order[:k]) for g in gold)
                        fused[k] += all(g & set(both[:k]) for g in gold)
                out.append({setting: getattr(index, setting), "recall": {str(k): v / n for k, v in got.items()},
                            "recall_fused_default": {str(k): v / n for k, v in fused.items()},
                            "top_window_overlap_with_flat": statistics.mean(overlap),
                            "recall_at_pool_by_score": statistics.mean(by_score),
                            "ms_median": statistics.median(ms)})
            return out

        phase("the fp16 flat scan (what the index becomes past 200,000 windows)")
        flat16 = VectorIndex(384, fp16_threshold=0, ivf_threshold=10**12)
        flat16.add(wids, vecs)

        class Codes:
            codes = "fp16"
        flat16_row = sweep_of(flat16.search, Codes(), "codes", ["fp16"])[0]
        del flat16
        sweep = sweep_of(ivf.search, inner, "nprobe", [min(int(x), nlist) for x in args.nprobe.split(",") if x.strip()])
        hnsw_sweep, hnsw_build_s = [], None
        if args.hnsw_ef.strip():
            phase("building HNSW (M 32)")
            t = time.perf_counter()
            hnsw = faiss.IndexHNSWFlat(384, 32, faiss.METRIC_INNER_PRODUCT)
            hnsw.add(vecs)
            hnsw_build_s = time.perf_counter() - t
            wid_arr = np.asarray(wids, dtype=np.int64)

            def hnsw_search(qv, k):
                sc, ix = hnsw.search(np.ascontiguousarray(qv.reshape(1, -1), dtype=np.float32), k)
                return [(int(wid_arr[i]), float(v)) for i, v in zip(ix[0], sc[0]) if i >= 0]
            hnsw_sweep = sweep_of(hnsw_search, hnsw.hnsw, "efSearch", [int(x) for x in args.hnsw_ef.split(",") if x.strip()])
        inner.nprobe = own_nprobe
        row = {"size": size, "prose": args.prose, "unique_windows": len({tuple(p) for p in pieces}),
               "doc_tokens": len(ids), "blocks": len(blocks), "windows": len(wids), "questions": n,
               "embed_s": embed_s, "bm25_build_s": bm25_s, "ivf_nlist": nlist, "ivf_nprobe": own_nprobe,
               "ivf_sweep": sweep, "hnsw_m": 32 if hnsw_sweep else None, "hnsw_build_s": hnsw_build_s,
               "hnsw_sweep": hnsw_sweep, "flat16": flat16_row,
               "recall": {m: {str(k): v / n for k, v in d.items()} for m, d in hit.items()},
               "latency_ms_median": {m: 1000 * statistics.median(v) for m, v in lat.items()}}
        rows.append(row)
        print(f"\n{len(ids):,} tokens ({args.prose} prose), {len(blocks):,} blocks, {len(wids):,} windows, "
              f"{row['unique_windows']:,} of them distinct (embedded in {embed_s:.0f} s, "
              f"BM25 built in {bm25_s:.2f} s), {n} questions")
        for m in methods:
            lt = f"  {row['latency_ms_median'][m]:.1f} ms" if m in lat else ""
            print(f"  {m:>12} " + "  ".join(f"@{k} {hit[m][k] / n:4.0%}" for k in KS) + lt)
        print(f"  exact fp32 scan alone (no question embedding): {row['latency_ms_median']['flat_scan']:.1f} ms")
        rows_of = [("flat fp16 scan", flat16_row)] + [(f"ivf nprobe {sw['nprobe']:>4}/{nlist}", sw) for sw in sweep]
        rows_of += [(f"hnsw efSearch {sw['efSearch']:>4}", sw) for sw in hnsw_sweep]
        if hnsw_sweep:
            print(f"  hnsw M 32 built in {hnsw_build_s:.0f} s")
        for name, sw in rows_of:
            at_k = "  ".join(f"@{k} {v:4.0%}" for k, v in sw["recall"].items())
            at_k += "  fused " + "  ".join(f"@{k} {v:4.0%}" for k, v in sw["recall_fused_default"].items())
            print(f"  {name} {at_k}  top-{pool} overlap with flat {sw['top_window_overlap_with_flat']:.3f} "
                  f"(by score {sw['recall_at_pool_by_score']:.3f})  {sw['ms_median']:.1f} ms")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d") + (f"-{args.tag}" if args.tag else "")
    write_json(out / f"select-{stamp}.json", {"benchmark": "select", "rows": rows}, seed)
    print(f"wrote {out}/select-{stamp}.json")


if __name__ == "__main__":
    main()
