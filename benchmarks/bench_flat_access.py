"""Flat cost: ask latency (selection + re-rank + page-in + first token) as the store grows.

Stores of the given sizes use the default model's KV geometry with synthetic KV bytes that
are real on disk (distinct blocks with valid ids and digests, so every read is verified), a
real documents table and a real FAISS index (random unit vectors stand in for the text
embeddings). Questions are drawn afresh from each store's own block texts (a few words of a
random block, so BM25 has something to find) and asked with the real model, cold (page cache
evicted before each question), at each --top-k, one answer token, with ask's reread and
without it (--reread on,off). The window's tokens (grafted, or re-read after its exact prefix)
and the share of asks that re-read some are reported next to the time: the window is held to
ask's max_context_tokens budget, so neither it nor the time may grow with the store. ask runs
at its defaults otherwise, the re-rank included: it runs only where the best block does not
stand alone above the relevance cut, so its mean time and the share of asks it ran for are
reported (--min-relevance 0: every ask re-ranks). Sizes that do not fit the free disk (with a
20% margin) are skipped and reported.

    python benchmarks/bench_flat_access.py --tokens 16384,131072,1048576 --top-k 2,8 --questions 30
    python benchmarks/bench_flat_access.py --questions 20 --no-faiss --min-relevance 0 --top-k 2 --reread on,off
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import numpy as np  # noqa: E402
import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402
from common import describe, drop_from_page_cache, write_json  # noqa: E402

import kvmemory  # noqa: E402
from kvmemory import hashing  # noqa: E402
from kvmemory import kv as kvops  # noqa: E402
from kvmemory.documents import SEGMENT_BLOCKS  # noqa: E402
from kvmemory.model.fingerprint import geometry  # noqa: E402
from kvmemory.index import VectorIndex  # noqa: E402
from kvmemory.index import windows as win  # noqa: E402
from kvmemory.index.lexical import LexicalIndex  # noqa: E402
from kvmemory.store.manifest import DocEntry  # noqa: E402
from kvmemory.store import Change, NewBlock  # noqa: E402
from kvmemory.config import ASK_TOP_K  # noqa: E402



def draw_questions(mem, rng: np.random.Generator, n: int) -> list[str]:
    """n questions, each a few words of a random block of the store (its random-token text)."""
    rows = mem.store.manifest.docs["synthetic"].rows
    pick = rng.choice(len(rows), n, replace=len(rows) < n)
    meta = mem.store.block_meta([rows[i] for i in pick])
    out = []
    for i in range(n):
        words = mem.tokenizer.decode([int(t) for t in meta["tokens"][i][:meta["n_tokens"][i]]]).split()
        a = int(rng.integers(0, max(1, len(words) - 6)))
        out.append("What about " + " ".join(words[a:a + 6]) + "?")
    return out


def build_store(path: Path, model, n_tokens: int, rng: np.random.Generator) -> tuple[float, int]:
    """A store holding one document of n_tokens synthetic tokens. Returns (seconds, disk bytes)."""
    t0 = time.perf_counter()
    mem = kvmemory.Memory(path, model=model)
    docs = mem.documents
    prelude, prelude_row = docs.prelude_state()
    store, C, p = mem.store, mem.block_tokens, prelude.n_tokens
    g = mem.geometry
    # synthetic KV in the store's dtype (bfloat16 as its raw 16-bit words)
    base = kvops.to_storage(torch.from_numpy(rng.standard_normal((g.layers, 2, g.kv_heads, C, g.head_dim),
                                                                 dtype=np.float32)).to(mem.kv_dtype))
    vocab = mem.tokenizer.vocab_size
    rows, seg_len = [], SEGMENT_BLOCKS * C
    batch: list[tuple] = []

    def flush():
        def build(s):
            new, local = [], {}          # rows of this batch's blocks, before they are committed
            for bid, parent_key, toks, pos, kv in batch:
                parent_row = prelude_row if parent_key is None else local.get(parent_key, s.row_of(parent_key))
                local[bid] = s.next_row + len(new)
                new.append(NewBlock(bid, parent_row, toks, pos, kv))
            return Change(new)
        store.commit(build)
        rows.extend(store.row_of(b[0]) for b in batch)
        batch.clear()

    for s0 in range(0, n_tokens, seg_len):
        seg = rng.integers(0, vocab, min(seg_len, n_tokens - s0)).tolist()
        ids = hashing.chain_ids(mem.fingerprint, seg, C, parent=bytes.fromhex(prelude.id), start=p)
        parent = None
        for i, bid in enumerate(ids):
            toks = seg[i * C:(i + 1) * C]
            kv = base[:, :, :, :len(toks)].copy()
            kv[0, 0, 0, 0, 0] = (len(rows) + len(batch)) % 65521  # distinct bytes, distinct digest
            batch.append((bid, parent, toks, range(p + i * C, p + i * C + len(toks)), kv))
            parent = bid
        if len(batch) >= 64:
            flush()
    if batch:
        flush()
    # the indexes as a deposit lays them out: ~10 dense windows a block (random unit vectors stand
    # in for MiniLM), BM25 over the blocks' real (random-token) text cut into as many windows,
    # one key summary a block
    meta = store.block_meta(rows)
    wids, texts = [], []
    for i, r in enumerate(rows):
        words = mem.tokenizer.decode([int(t) for t in meta["tokens"][i][:meta["n_tokens"][i]]]).split()
        for w in range(10):
            wids.append(win.window_id(r, w))
            texts.append(" ".join(words[w * len(words) // 10:(w + 2) * len(words) // 10]))
    vecs = rng.standard_normal((len(wids), 384)).astype(np.float32)
    dense = VectorIndex(384)
    dense.add(wids, vecs / np.linalg.norm(vecs, axis=1, keepdims=True))
    docs._save_index("dense", dense)
    lex = LexicalIndex()
    lex.add(wids, texts)
    docs._save_index("bm25", lex)
    keys = VectorIndex(docs.dims["keys"])
    kv_vecs = rng.standard_normal((len(rows), docs.dims["keys"])).astype(np.float32)
    keys.add([win.window_id(r, 0) for r in rows], kv_vecs / np.linalg.norm(kv_vecs, axis=1, keepdims=True))
    docs._save_index("keys", keys)
    store.commit(lambda s: Change(docs={"synthetic": DocEntry(rows=rows, n_tokens=n_tokens,
                                                              segments=-(-n_tokens // seg_len))}))
    disk = store.disk_bytes()
    mem.close()
    return time.perf_counter() - t0, disk


def faiss_scaling(rng: np.random.Generator, sizes=(4_000, 40_000, 400_000), dim=384, k=8, queries=50) -> list:
    """Exact (flat fp32 and fp16) vs IVF search time and recall, to place VectorIndex's switches.

    Each query is a stored vector plus noise, so its planted neighbour is the one right answer
    (recall@1); with random vectors the other top-k neighbours are near-ties, so recall@k is
    reported too but says little.
    """
    out = []
    for n in sizes:
        vecs = rng.standard_normal((n, dim)).astype(np.float32)
        vecs /= np.linalg.norm(vecs, axis=1, keepdims=True)
        planted = rng.integers(0, n, queries)
        qs = vecs[planted] + 0.02 * rng.standard_normal((queries, dim)).astype(np.float32)
        flat = VectorIndex(dim, fp16_threshold=10**12, ivf_threshold=10**12)
        flat.add(list(range(n)), vecs)
        t = time.perf_counter()
        exact = [flat.search(q, k) for q in qs]
        flat_ms = (time.perf_counter() - t) / queries * 1e3
        del flat
        flat16 = VectorIndex(dim, fp16_threshold=0, ivf_threshold=10**12)
        flat16.add(list(range(n)), vecs)
        t = time.perf_counter()
        scanned = [flat16.search(q, k) for q in qs]
        flat16_ms = (time.perf_counter() - t) / queries * 1e3
        del flat16
        ivf = VectorIndex(dim, ivf_threshold=0)
        ivf.add(list(range(n)), vecs)
        t = time.perf_counter()
        approx = [ivf.search(q, k) for q in qs]
        ivf_ms = (time.perf_counter() - t) / queries * 1e3
        recall = np.mean([len({i for i, _ in a} & {i for i, _ in e}) / k for a, e in zip(approx, exact)])
        recall1 = np.mean([bool(a) and a[0][0] == int(p) for a, p in zip(approx, planted)])
        recall16 = np.mean([len({i for i, _ in a} & {i for i, _ in e}) / k for a, e in zip(scanned, exact)])
        out.append({"vectors": n, "tokens_at_C256": n * 256, "flat_ms": flat_ms, "flat16_ms": flat16_ms,
                    "flat16_recall_at_k": float(recall16), "ivf_ms": ivf_ms,
                    "ivf_recall_at_1": float(recall1), "ivf_recall_at_k": float(recall)})
        print(f"  faiss {n} vectors: flat {flat_ms:.2f} ms, flat fp16 {flat16_ms:.2f} ms (recall@{k} "
              f"{recall16:.2f}), ivf {ivf_ms:.2f} ms (recall@1 {recall1:.2f})", file=sys.stderr)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="16384,131072,1048576")
    ap.add_argument("--questions", type=int, default=30, help="questions per size and k (default 30)")
    ap.add_argument("--top-k", default=f"{ASK_TOP_K},8", help=f"comma-separated (default {ASK_TOP_K},8)")
    ap.add_argument("--min-relevance", type=float, default=None,
                    help="ask's relevance cut (default ask's); 0 grafts all top-k blocks, the window's worst case")
    ap.add_argument("--max-context-tokens", default=None,
                    help="comma-separated budgets of grafted tokens to compare (default ask's; 8192: none)")
    ap.add_argument("--reread", default="on",
                    help="comma-separated, of on and off: ask's reread (the tokens after the window's exact prefix "
                         "prefilled over it; on is ask's default), side by side (default on)")
    ap.add_argument("--json", default=None, help="write the JSON here (default benchmarks/results/flat-DATE.json)")
    ap.add_argument("--dir", default=None, help="where to build the stores (default: a temp dir)")
    ap.add_argument("--no-faiss", action="store_true", help="skip the flat-vs-IVF search measurement")
    args = ap.parse_args()
    from kvmemory.config import RuntimeConfig, from_env
    from kvmemory.model import load_model
    model, tok, _ = load_model(None, cache_dir=from_env(RuntimeConfig).resolved_cache_dir())
    work = Path(tempfile.mkdtemp(prefix="bench-flat-", dir=args.dir))
    from kvmemory.config import ASK_CONTEXT_TOKENS
    switch = {"on": True, "off": False}
    if not set(args.reread.split(",")) <= set(switch):
        ap.error(f"--reread takes on and off, got {args.reread!r}")
    rereads = [switch[x] for x in args.reread.split(",")]
    ks = [(int(k), int(b), rr) for k in args.top_k.split(",")
          for b in (args.max_context_tokens or str(ASK_CONTEXT_TOKENS)).split(",") for rr in rereads]
    rng = np.random.default_rng()
    rows, skipped = [], []
    per_token = geometry(model).bytes_per_token
    for n in [int(x) for x in args.tokens.split(",")]:
        free = shutil.disk_usage(work).free
        if n * per_token * 1.2 > free:
            skipped.append({"store_tokens": n, "why": f"needs ~{n * per_token / 1e9:.0f} GB, {free / 1e9:.0f} GB free"})
            print(f"  skip {n}: {skipped[-1]['why']}", file=sys.stderr)
            continue
        path = work / f"flat-{n}.kvm"
        build_s, disk = build_store(path, (model, tok), n, rng)
        print(f"  built {n} tokens in {build_s:.0f} s ({disk / 1e9:.1f} GB)", file=sys.stderr)
        mem = kvmemory.Memory(path, model=(model, tok))
        _ = mem.documents.embedder                  # load MiniLM before timing, like a warm service
        questions = draw_questions(mem, rng, args.questions)
        for k, budget, reread in ks:
            kw = {"top_k": k, "max_new_tokens": 1, "max_context_tokens": budget, "min_relevance": args.min_relevance,
                  "reread": reread}
            mem.ask(questions[0], **kw)     # warm model code paths
            parts = {"ask": [], "select": [], "rerank": [], "page_in": [], "first_token": [], "disk_read": [],
                     "other": []}
            window, reread_tokens, reranked = [], [], 0
            for q in tqdm(questions, desc=f"{n} tokens, k {k}, budget {budget}", disable=not sys.stderr.isatty()):
                mem.rt.handle.drop_pager()                      # cold host tier ...
                drop_from_page_cache(path)              # ... and cold page cache
                t = time.perf_counter()
                a = mem.ask(q, **kw)
                parts["ask"].append((time.perf_counter() - t) * 1e3)
                ts = a.stats["timings_s"]
                parts["select"].append(ts["select"] * 1e3)
                parts["page_in"].append(ts["page_in_and_graft"] * 1e3)
                parts["first_token"].append(ts["first_token"] * 1e3)
                parts["disk_read"].append(ts["disk_read"] * 1e3)
                parts["rerank"].append(ts["rerank"] * 1e3)      # 0 where the best block stood alone
                reranked += a.stats["reranked"]["blocks"] > 0
                # the rest: manifest refresh, question tokens, planning, stats
                parts["other"].append(parts["ask"][-1] - (ts["select"] + ts["rerank"] + ts["page_in_and_graft"]
                                                          + ts["first_token"]) * 1e3)
                # the window's context: grafted, or re-read after its exact prefix
                window.append(a.stats["tokens_restored"] + a.stats["tokens_reread"] - len(mem.documents.prelude.ids))
                reread_tokens.append(a.stats["tokens_reread"])
            q10, q90 = np.percentile(parts["ask"], [10, 90])
            rows.append({"store_tokens": n, "top_k": k, "max_context_tokens": budget, "reread": reread, "x_window": n / 8192, "blocks": -(-n // 256), "disk_bytes": disk,
                         "ask_ms_median": statistics.median(parts["ask"]), "ask_ms_p10": float(q10),
                         "ask_ms_p90": float(q90),
                         **{f"{key}_ms_median": statistics.median(v) for key, v in parts.items() if key != "ask"},
                         "rerank_ms_mean": statistics.fmean(parts["rerank"]), "reranked_share": reranked / len(questions),
                         "window_tokens_median": statistics.median(window), "window_tokens_max": max(window),
                         "reread_tokens_median": statistics.median(reread_tokens),
                         "reread_share": sum(x > 0 for x in reread_tokens) / len(questions),
                         "ask_ms_all": parts["ask"]})
        mem.close()
        shutil.rmtree(path, ignore_errors=True)
    faiss_rows = [] if args.no_faiss else faiss_scaling(rng)
    machine = describe()
    result = {"benchmark": "flat_access", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "machine": machine, "top_k": sorted({k for k, _, _ in ks}), "questions": args.questions,
              "max_context_tokens": sorted({b for _, b, _ in ks}), "min_relevance": args.min_relevance,
              "command": " ".join(sys.argv), "rows": rows, "skipped": skipped, "faiss": faiss_rows}
    print(f"\nflat access — ask latency (selection + re-rank + page-in + first token), cold, {args.questions} questions; "
          f"{machine['cpu']}, {machine['cores']} cores; min_relevance {args.min_relevance}")
    print(f"{'tokens':>9} {'x window':>8} {'k':>2} {'budget':>6} {'reread':>6} {'window':>7} {'re-read':>7} {'ask ms':>7} {'p10-p90':>11} {'select':>7} "
          f"{'rerank':>6} {'ranked':>6} {'page-in':>7} {'disk':>6} {'1st tok':>7} {'other':>6} {'vs first':>8}")
    for r in rows:
        first = next(x for x in rows if (x["top_k"], x["max_context_tokens"], x["reread"]) ==
                     (r["top_k"], r["max_context_tokens"], r["reread"]))
        print(f"{r['store_tokens']:9d} {r['x_window']:8.0f} {r['top_k']:2d} {r['max_context_tokens']:6d} "
              f"{'on' if r['reread'] else 'off':>6} {r['window_tokens_median']:7.0f} {r['reread_share']:7.0%} "
              f"{r['ask_ms_median']:7.0f} {r['ask_ms_p10']:5.0f}-{r['ask_ms_p90']:<5.0f} "
              f"{r['select_ms_median']:7.1f} {r['rerank_ms_mean']:6.0f} {r['reranked_share']:6.0%} "
              f"{r['page_in_ms_median']:7.1f} {r['disk_read_ms_median']:6.1f} "
              f"{r['first_token_ms_median']:7.0f} {r['other_ms_median']:6.0f} "
              f"{r['ask_ms_median'] / first['ask_ms_median']:8.2f}")
    for s in skipped:
        print(f"skipped {s['store_tokens']}: {s['why']}")
    for f in faiss_rows:
        print(f"FAISS {f['vectors']:>7} vectors (~{f['tokens_at_C256'] / 1e6:.0f}M tokens): exact {f['flat_ms']:.2f} ms, "
              f"IVF {f['ivf_ms']:.2f} ms, recall@1 {f['ivf_recall_at_1']:.2f} (recall@{args.top_k} "
              f"{f['ivf_recall_at_k']:.2f})")
    out = Path(args.json) if args.json else Path("benchmarks/results") / \
        f"flat-{datetime.now(timezone.utc).strftime('%Y-%m-%d')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    write_json(out, result)
    _plot(rows, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")
    shutil.rmtree(work, ignore_errors=True)


def _plot(rows, path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a, g) = plt.subplots(1, 2, figsize=(11, 4))
    for k, b, rr in dict.fromkeys((r["top_k"], r["max_context_tokens"], r["reread"]) for r in rows):
        rs = [r for r in rows if (r["top_k"], r["max_context_tokens"], r["reread"]) == (k, b, rr)]
        label = f"top-k {k}, budget {b}, reread {'on' if rr else 'off'}"
        x = [r["store_tokens"] for r in rs]
        med = np.array([r["ask_ms_median"] for r in rs])
        a.errorbar(x, med, yerr=[med - [r["ask_ms_p10"] for r in rs], [r["ask_ms_p90"] for r in rs] - med],
                   fmt="o-", capsize=3, label=label)
        g.plot(x, [r["window_tokens_median"] for r in rs], "o-", label=label)
    a.set(xscale="log", xlabel="store tokens", ylabel="ask ms (median, p10-p90; cold)", title="ask latency")
    g.set(xscale="log", xlabel="store tokens", ylabel="window tokens (median; grafted or re-read)",
          title="the window")
    a.legend()
    g.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
