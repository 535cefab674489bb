"""QA over stores larger than the window: needles of four shapes in real prose, at several sizes.

Each size gets fresh random haystacks (shuffled stdlib docstring prose) holding fresh needles
of four shapes: a magic number, a pass key, a fact about a person, and a two-fact question
(both facts needed, stated apart). Every needle is asked about. A fifth of the questions are
about the real prose itself ("real"): a sentence of the haystack quoted with one word blanked
out, a word that occurs nowhere else in the haystack. Side by side, on the same
questions, in one run:

  ceiling   the model given only the gold passage (the blocks holding the needles) as text:
            separates the model's own weakness from the engine's losses
  full      the whole document in the prompt (only where it fits the window; prefilled once
            per haystack, the question appended to a copy of that cache)
  rag       text RAG: exactly the tokens kvmemory grafted (first of --configs), re-prefilled
  kvm-...   kvmemory `ask` with top_k k, recompute r (and without segment expansion: "-noexp")

Also the selection alone: recall@k of each selector (text = dense + BM25 fused, dense, bm25,
keys): the question's needle(s) inside the k best blocks. And the window's deviation: the KL
of ask's first-answer-token distribution against rag's (the same window's text re-prefilled).
Accuracy: every answer string in the reply (case-insensitive), with a 95% Wilson interval.

    python benchmarks/bench_qa.py --sizes 7600,32768,131072 --questions 60
    python benchmarks/bench_qa.py --sizes 32768 --questions 40 --configs k1,k2,k3,k4,k2-noexp,k2-r0.15 --tag sweep
"""

from __future__ import annotations

import argparse
import hashlib
import math
import random
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import numpy as np  # noqa: E402
import torch  # noqa: E402
from haystack import GENERATORS, SHAPES, generated, haystack, real_questions  # noqa: E402
from common import describe, seed_of, write_json  # noqa: E402

import kvmemory  # noqa: E402
from kvmemory import kv as kvops  # noqa: E402
from kvmemory.graft import window_tokens  # noqa: E402
from kvmemory.config import (ASK_MIN_RELEVANCE, ASK_RECOMPUTE, ASK_REREAD, ASK_RERANK, ASK_RERANK_KEEP,  # noqa: E402
                             ASK_RERANK_MARGIN, ASK_TOP_K)
from kvmemory.exactness import kl_divergence  # noqa: E402
from kvmemory.retrieve import rank_blocks  # noqa: E402
from kvmemory.window import follows  # noqa: E402

SELECTOR_KS = (1, 2, 4, 8)


# ask's defaults as a config name
DEFAULT_CONFIG = (f"k{ASK_TOP_K}-rr{ASK_RERANK}-m{ASK_RERANK_MARGIN:g}{'-keep' * ASK_RERANK_KEEP}"
                  f"{'-reread' * ASK_REREAD}")


def parse_config(name: str) -> dict:
    """'k2', 'k2-r0.15', 'k3-noexp', 'k2-c0.75', 'k2-rr8-m0.05', 'k8-b2048', 'k2-s16-last' -> ask() keyword
    arguments (c: min_relevance, rr: rerank, m: rerank_margin, b: max_context_tokens, s: seam tokens
    recomputed, last: order "best_last", keep: rerank_keep, reread: the tokens after the exact prefix
    re-read)."""
    # no re-rank, keep or reread unless named (ask's defaults do all three: its config is
    # k2-rr8-m0.5-keep-reread), so a name means what it meant in the earlier result files
    out = {"top_k": ASK_TOP_K, "recompute": ASK_RECOMPUTE, "expand": True, "min_relevance": ASK_MIN_RELEVANCE,
           "rerank": 0, "rerank_keep": False, "reread": False}
    for part in name.split("-"):
        if part == "keep":
            out["rerank_keep"] = True
        elif part == "reread":
            out["reread"] = True
        elif part.startswith("rr"):
            out["rerank"] = int(part[2:])
        elif part.startswith("m"):
            out["rerank_margin"] = float(part[1:])
        elif part.startswith("b"):
            out["max_context_tokens"] = int(part[1:])
        elif part.startswith("k"):
            out["top_k"] = int(part[1:])
        elif part.startswith("c"):
            out["min_relevance"] = float(part[1:])
        elif part.startswith("r"):
            out["recompute"] = float(part[1:])
        elif part.startswith("s"):
            out["seam"] = int(part[1:])
        elif part == "last":
            out["order"] = "best_last"
        elif part == "noexp":
            out["expand"] = False
        else:
            raise SystemExit(f"unknown config part {part!r} in {name!r}")
    return out


@torch.inference_mode()
def greedy(model, tokenizer, ids: list[int], max_new: int, cache=None, C: int = 256):
    """Prefill ids (block-chunked) over an optional cache, decode greedily.
    Returns (text, time to first token, logits of the first answer token)."""
    t = time.perf_counter()
    cache = cache if cache is not None else kvops.make_cache(None, model.config)
    for s in range(0, len(ids), C):
        logits = kvops.last_logits(model, torch.tensor([ids[s:s + C]]), cache)   # only the last row's LM head
    ttft = time.perf_counter() - t
    first = logits.float().clone()
    from kvmemory.decode import eos_ids, greedy as decode
    out = decode(model, cache, logits, max_new, eos_ids(tokenizer, model))
    return tokenizer.decode(out, skip_special_tokens=True), ttft, first


def correct(reply: str, answers) -> bool:
    return all(a.lower() in reply.lower() for a in answers)


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    if n == 0:
        return (0.0, 0.0)
    p = k / n
    d = 1 + z * z / n
    c = (p + z * z / (2 * n)) / d
    h = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return (max(0.0, c - h), min(1.0, c + h))


def needle_blocks(tok, text: str, doc_ids: list[int], needle: str, C: int, offsets=None) -> set[int]:
    """Indices (in the document) of the blocks that hold any token of the needle sentence.
    `offsets`: the text's token offsets from `token_offsets` (pass them for many needles of one
    long text: tokenizing 5M tokens again per needle is what kept bench_select from finishing)."""
    if offsets is None:
        offsets = token_offsets(tok, text, doc_ids)
    a = text.index(needle)
    b = a + len(needle)
    hit = np.nonzero((offsets[:, 0] < b) & (offsets[:, 1] > a))[0]
    return {int(t) // C for t in hit}


def token_offsets(tok, text: str, doc_ids: list[int]):
    """The (start, end) character offsets of every token of the text, checked against its ids."""
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True, split_special_tokens=True)
    assert enc["input_ids"] == doc_ids
    return np.asarray(enc["offset_mapping"], dtype=np.int64).reshape(-1, 2)


def code_digest() -> bytes:
    """A digest of the kvmemory code a deposit runs (its .py files, kvmemory.index's included)."""
    import kvmemory.index
    h = hashlib.sha256()
    for root in (Path(kvmemory.__file__).parent, Path(kvmemory.index.__file__).parent):
        for f in sorted(root.rglob("*.py")):
            h.update(str(f.relative_to(root)).encode() + b"\0" + f.read_bytes())
    return h.digest()


def run_doc(model, size: int, questions, args, rng, work: Path, configs: dict, res: dict, sel: dict,
            examples: list, doc_no: int, n_real: int = 0) -> dict:
    tok = model[1]
    text = haystack(rng, tok, size, questions, prose=args.prose)
    questions = questions + real_questions(rng, text, n_real)
    from kvmemory.documents import text_ids
    doc_ids = text_ids(tok, text)
    reused = False
    if args.keep:
        # a kept deposit is reused when it was made of the same text by the same code (the seed,
        # the size and the questions decide the text)
        key = hashlib.sha256(text.encode() + code_digest()).hexdigest()[:16]
        dt = "" if args.dtype == "float32" else f"-{args.dtype}"
        path = Path(args.keep) / f"qa-{size}-{doc_no}-{key}{dt}.kvm"
    else:
        path = work / f"qa-{size}-{doc_no}.kvm"
    mem = kvmemory.Memory(path, model=model)
    t = time.perf_counter()
    have = mem.store.manifest.docs.get("haystack") if mem.store is not None else None
    if have is not None and have.n_tokens == len(doc_ids):
        reused = True
        print(f"  reusing the deposit of {len(doc_ids)} tokens at {path} (same seed, text and code)",
              file=sys.stderr, flush=True)
    else:
        if have is not None:
            mem.remove("haystack")
        mem.add(text, doc_id="haystack", progress=True)
    deposit_s = time.perf_counter() - t
    C = mem.block_tokens
    pre = mem.documents.prelude
    rows = mem.store.manifest.docs["haystack"].rows
    fits = len(pre.ids) + len(doc_ids) + 64 + args.max_new_tokens <= mem.geometry.max_positions
    full_cache, full_s = None, 0.0
    if fits and "full" in args.methods:
        t = time.perf_counter()
        full_cache = kvops.make_cache(None, mem.model.config)
        with torch.inference_mode():
            ids = pre.ids + doc_ids
            for s in range(0, len(ids), C):
                mem.model(input_ids=torch.tensor([ids[s:s + C]]), past_key_values=full_cache)
        full_s = time.perf_counter() - t
        base = full_cache.get_seq_length()
    row_of = {r: i for i, r in enumerate(rows)}
    offsets = token_offsets(tok, text, doc_ids)
    for q in questions:
        gold = [needle_blocks(tok, text, doc_ids, nd, C, offsets) for nd in q.needles]
        q_ids = pre.question_ids(q.question)
        replies = {}
        # ---- selection alone
        for selector in args.selectors:
            ranked = [row_of[h.row] for h in rank_blocks(mem.rt, mem.documents, q.question, selector, n=max(SELECTOR_KS))]
            for k in SELECTOR_KS:
                sel[selector][k] += all(g & set(ranked[:k]) for g in gold)
        # ---- kvmemory
        default_window = None
        ttfts: dict[str, float] = {}
        for name, kw in configs.items():
            a = mem.ask(q.question, max_new_tokens=args.max_new_tokens, **kw)
            picked = tok.decode(window_tokens(mem.store, a.window))
            r = res[name]
            ok = correct(a.text, q.answers)
            r["correct"].append(ok)
            r["shape"].append(q.shape)
            r["recall"].append(all(x in picked for x in q.answers))
            st = a.stats
            r["ttft"].append(st["timings_s"]["ttft"])
            r["prefilled"].append(st["tokens_prefilled"])
            r["restored"].append(st["tokens_restored"])
            r["recomputed"].append(st["tokens_recomputed"] + st["tokens_reread"])
            r["rerank_s"].append(st["timings_s"]["rerank"])
            r["rerank_restored"].append(st["reranked"]["tokens_restored"])
            r["seamed"].append(bool(a.window.seam_positions(1)))    # a run meets context it was not computed in
            r["_first"] = a.first_logits
            r["_window"] = a.window.slots
            replies[name] = a.text
            ttfts[name] = st["timings_s"]["ttft"]
            if name == next(iter(configs)):
                default_window = a.window
        # ---- text RAG over exactly the tokens of the first config's window
        if "rag" in args.methods and default_window is not None:
            ids = pre.ids + window_tokens(mem.store, default_window) + q_ids
            reply, ttft, first = greedy(mem.model, tok, ids, args.max_new_tokens, C=C)
            _record(res["rag"], q, reply, all(x in tok.decode(ids) for x in q.answers), ttft, len(ids), 0)
            replies["rag"] = reply
            for name in configs:
                if res[name]["_window"] == default_window.slots:     # KL only where the window is the same
                    res[name]["kl"].append(float(kl_divergence(first, res[name]["_first"])))
        if "ceiling" in args.methods:
            idx = sorted(set().union(*gold))
            spans, cur = [], None          # contiguous runs of gold blocks, in document order
            for i in idx:
                if cur and cur[1] == i:
                    cur[1] = i + 1
                else:
                    cur = [i, i + 1]
                    spans.append(cur)
            gold_ids = [t for a, b in spans for t in doc_ids[a * C:b * C]]
            ids = pre.ids + gold_ids + q_ids
            reply, ttft, _ = greedy(mem.model, tok, ids, args.max_new_tokens, C=C)
            _record(res["ceiling"], q, reply, True, ttft, len(ids), 0)
            replies["ceiling"] = reply
        if full_cache is not None:
            kvops.truncate(full_cache, base)
            reply, ttft, _ = greedy(mem.model, tok, q_ids, args.max_new_tokens, cache=full_cache, C=C)
            _record(res["full"], q, reply, True, full_s + ttft, base + len(q_ids), 0)
            replies["full"] = reply
        examples.append({"shape": q.shape, "question": q.question, "answers": list(q.answers), "replies": replies,
                         "ttft_s": ttfts,
                         **({"window": window_shape(default_window)} if default_window is not None else {})})
        print(f"  [{size}] {q.shape:8} {'/'.join(q.answers):>18}: " +
              "  ".join(f"{m}={'ok' if correct(v, q.answers) else 'x'}" for m, v in replies.items()),
              file=sys.stderr, flush=True)
    out = {"doc_tokens": len(doc_ids), "deposit_s": deposit_s, "deposit_reused": reused, "full_prefill_s": full_s}
    mem.close()
    return out


def window_shape(w) -> dict:
    """The first config's window as the blend sees it: its context tokens, the leading exact ones,
    its runs (blocks computed together) and how many runs after the first continue the one before
    them in the document (a segment boundary between them: the later run was computed without it)."""
    runs = w.runs()
    joined = sum(follows(a[-1].candidate, b[0].candidate) for a, b in zip(runs, runs[1:]))
    return {"context_tokens": w.context_tokens, "exact_tokens": w.exact_prefix_tokens(), "runs": len(runs),
            "joined_runs": joined}


def _record(r, q, reply, recall, ttft, prefilled, restored) -> None:
    r["correct"].append(correct(reply, q.answers))
    r["shape"].append(q.shape)
    r["recall"].append(recall)
    r["ttft"].append(ttft)
    r["prefilled"].append(prefilled)
    r["restored"].append(restored)
    r["recomputed"].append(0)
    r["rerank_s"].append(0.0)
    r["rerank_restored"].append(0)
    r["seamed"].append(False)


def run_size(model, size: int, generator: str, args, rng, work: Path, configs: dict) -> tuple[dict, dict]:
    """One generator's questions at one size, on fresh haystacks: (summary, raw per-question results)."""
    per_doc = args.needles_per_doc or min(args.questions, max(8, size // 1024))
    methods = [m for m in ("ceiling", "full", "rag") if m in args.methods] + list(configs)
    res = {m: {k: [] for k in ("correct", "shape", "recall", "ttft", "prefilled", "restored", "recomputed", "kl",
                                  "rerank_s", "rerank_restored", "seamed")}
           for m in methods}
    sel = {s: {k: 0 for k in SELECTOR_KS} for s in args.selectors}
    examples, docs, left, n = [], [], args.questions, 0
    while left > 0:
        take = min(per_doc, left)
        # "mixed": one in five questions is about the real prose; "real": all of them
        n_real = take if generator == "real" else take // len(SHAPES) if generator == "mixed" else 0
        qs = generated(rng, generator, take - n_real)
        docs.append(run_doc(model, size, qs, args, rng, work, configs, res, sel, examples, len(docs), n_real))
        got = len(examples) - n
        left -= got if got else take                   # a haystack short of real sentences: move on
        n = len(examples)
    res = {m: r for m, r in res.items() if r["correct"]}
    out = {"size": size, "generator": generator, "doc_tokens": statistics.mean(d["doc_tokens"] for d in docs),
           "haystacks": len(docs), "deposits_reused": sum(d["deposit_reused"] for d in docs),
           "questions": n, "deposit_s": sum(d["deposit_s"] for d in docs),
           "x_window": statistics.mean(d["doc_tokens"] for d in docs) / 8192,
           "selection_recall": {s: {str(k): v / n for k, v in d.items()} for s, d in sel.items()},
           "methods": summarize(res, n, configs), "examples": examples}
    return out, res


def sign_test(wins: int, losses: int) -> float:
    """Two-sided exact sign test of wins against losses (ties dropped): the chance of a split at least
    this uneven if either side were as likely to win each question."""
    n = wins + losses
    if n == 0:
        return 1.0
    k = min(wins, losses)
    return min(1.0, 2 * sum(math.comb(n, i) for i in range(k + 1)) / 2 ** n)


def summarize(res: dict, n: int, configs: dict) -> dict:
    """Per method: accuracy, CI, recall, TTFT, and paired counts against the first config, against
    the first config that does not re-rank (with a sign test's p) and against text RAG."""
    first = res.get(next(iter(configs), None))
    plain = res.get(next((m for m, kw in configs.items() if not kw.get("rerank")), None))
    rag = res.get("rag")

    def paired(r, other):
        """Question by question against `other`: [right where it was wrong, wrong where it was right]."""
        return ([sum(a and not b for a, b in zip(r["correct"], other["correct"])),
                 sum(b and not a for a, b in zip(r["correct"], other["correct"]))] if other else None)

    out = {}
    for m, r in res.items():
        k = sum(r["correct"])
        ttft = sorted(r["ttft"])
        vs_plain = paired(r, plain)
        out[m] = {
            "correct": k,
            "paired_vs_first_config": paired(r, first), "paired_vs_rag": paired(r, rag),
            "paired_vs_no_rerank": vs_plain, "sign_p_vs_no_rerank": sign_test(*vs_plain) if vs_plain else None,
            "ttft_mean_s": statistics.mean(ttft), "ttft_p90_s": ttft[min(len(ttft) - 1, int(0.9 * len(ttft)))],
            "seamed_share": sum(r["seamed"]) / n,
            "recomputed_mean": statistics.mean(r["recomputed"]),
            "accuracy": k / n, "ci95": wilson(k, n), "recall": sum(r["recall"]) / n,
            "by_shape": {s: sum(c for c, sh in zip(r["correct"], r["shape"]) if sh == s) /
                         max(1, r["shape"].count(s)) for s in sorted(set(r["shape"]))},
            "ttft_median_s": statistics.median(r["ttft"]), "prefilled_median": statistics.median(r["prefilled"]),
            "restored_median": statistics.median(r["restored"]),
            "recomputed_median": statistics.median(r["recomputed"]),
            "rerank_s_median": statistics.median(r["rerank_s"]),
            "rerank_restored_median": statistics.median(r["rerank_restored"]),
            "kl_vs_rag_median": statistics.median(r["kl"]) if r["kl"] else None,
            "kl_vs_rag_max": max(r["kl"]) if r["kl"] else None}
    return out


def pooled(size: int, rows: list[dict], raws: list[dict], configs: dict) -> dict:
    """The generators of one size together: their per-question results concatenated."""
    res: dict = {}
    for raw in raws:
        for m, r in raw.items():
            dst = res.setdefault(m, {k: [] for k in r if not k.startswith("_")})
            for k in dst:
                dst[k] += r[k]
    n = sum(r["questions"] for r in rows)
    return {"size": size, "generator": "pooled", "doc_tokens": statistics.mean(r["doc_tokens"] for r in rows),
            "haystacks": sum(r["haystacks"] for r in rows), "deposits_reused": sum(r["deposits_reused"] for r in rows),
            "questions": n, "deposit_s": sum(r["deposit_s"] for r in rows),
            "x_window": statistics.mean(r["x_window"] for r in rows),
            "selection_recall": {s: {k: sum(r["selection_recall"][s][k] * r["questions"] for r in rows) / n
                                     for k in rows[0]["selection_recall"][s]} for s in rows[0]["selection_recall"]},
            "methods": summarize(res, n, configs), "examples": []}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="7600,32768,131072", help="document tokens per haystack, comma-separated")
    ap.add_argument("--questions", type=int, default=60, help="questions per size (default 60)")
    ap.add_argument("--needles-per-doc", type=int, default=None,
                    help="questions per haystack (default: size/1024, at least 8); more haystacks make up the rest")
    ap.add_argument("--configs", default=f"{DEFAULT_CONFIG},k{ASK_TOP_K},k{ASK_TOP_K}-rr8-m0.5-keep",
                    help="ask() settings to compare: kK[-rR][-noexp][-cC][-rrN][-mM][-bB][-sS][-last][-keep][-reread], "
                         "comma-separated (rr: re-rank N blocks with the model, 0 unless named; m: its margin, "
                         "b: max_context_tokens, s: seam tokens, last: order best_last, keep: rerank_keep, reread: the "
                         "tokens after the window's exact prefix re-read); default: ask's defaults, then no "
                         "re-rank, and the re-rank that keeps the first ranking's best without reread (a repeated "
                         "setting is run once)")
    ap.add_argument("--methods", default="ceiling,full,rag", help="baselines: ceiling, full, rag")
    ap.add_argument("--generators", default=",".join(GENERATORS),
                    help="question generators, each drawn fresh, reported alone and pooled (default: all): "
                         "mixed (four needle shapes and real-prose blanks), records (same-shape records that "
                         "differ in one attribute), paraphrase (few words shared with the passage), span (two "
                         "facts a paragraph apart), real (a word blanked out of the haystack's own prose)")
    ap.add_argument("--selectors", default="text,dense,bm25,keys", help="selectors whose recall@k is measured")
    ap.add_argument("--max-new-tokens", type=int, default=20)
    ap.add_argument("--seed", type=int, default=None, help="default: a fresh random seed (printed)")
    ap.add_argument("--dir", default=None, help="where the temporary stores go")
    ap.add_argument("--keep", default=None, metavar="DIR",
                    help="keep each haystack's store in DIR and reuse it on a later run whose seed, sizes and "
                         "questions draw the same text and whose kvmemory code is the same (a 1M-token deposit "
                         "is ~45 minutes here); the output says which deposits were reused")
    ap.add_argument("--prose", choices=("stdlib", "site"), default="stdlib",
                    help="the haystacks' prose: the standard library's docstrings (~0.1M tokens, repeated past "
                         "that: a 1M-token haystack holds each paragraph ~10 times) or every installed package's "
                         "too (~5M tokens that do not repeat)")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                    help="what the model computes in (Memory's dtype; default float32)")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--tag", default="")
    args = ap.parse_args()
    args.methods = [m for m in args.methods.split(",") if m]
    args.selectors = [s for s in args.selectors.split(",") if s]
    args.generators = [g for g in args.generators.split(",") if g]
    if unknown := sorted(set(args.generators) - set(GENERATORS)):
        raise SystemExit(f"unknown generator(s) {', '.join(unknown)}; they are {', '.join(GENERATORS)}")
    configs: dict = {}
    for c in args.configs.split(","):
        kw = parse_config(c) if c else None
        if kw is not None and kw not in configs.values():       # ask's defaults named twice: once
            configs[f"kvm-{c}"] = kw
    seed = seed_of(args)
    print(f"seed {seed}", file=sys.stderr)
    rng = random.Random(seed)
    work = Path(tempfile.mkdtemp(prefix="bench-qa-", dir=args.dir))
    from kvmemory.config import RuntimeConfig, from_env
    from kvmemory.model import load_model
    model, tok, _ = load_model(None, cache_dir=from_env(RuntimeConfig).resolved_cache_dir(),
                               dtype=getattr(torch, args.dtype))
    rows = []
    for s in args.sizes.split(","):
        got = [run_size((model, tok), int(s), g, args, rng, work, configs) for g in args.generators]
        rows += [r for r, _ in got]
        if len(got) > 1:
            rows.append(pooled(int(s), [r for r, _ in got], [raw for _, raw in got], configs))
    machine = describe()
    result = {"benchmark": "qa", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "seed": seed,
              "prose": args.prose, "dtype": args.dtype, "machine": machine, "configs": {k: v for k, v in configs.items()}, "max_new_tokens": args.max_new_tokens,
              "command": " ".join(sys.argv), "rows": rows}
    print(f"\nQA — SmolLM2-135M-Instruct {args.dtype}, seed {seed}; {machine['cpu']}, {machine['cores']} cores")
    print(f"{'doc tokens':>10} {'generator':>10} {'x win':>5} {'n':>3} {'method':>20} {'accuracy':>8} {'95% CI':>11} {'recall':>6} "
          f"{'TTFT s':>7} {'p90 s':>6} {'prefilled':>9} {'restored':>8} {'recomp':>6} {'KL vs rag':>9} {'seamed':>6} "
          f"{'+/- 1st':>7} {'+/- rag':>7} {'+/- rr0':>7} {'p':>5}")
    for r in rows:
        for m, v in r["methods"].items():
            kl = f"{v['kl_vs_rag_median']:.2g}" if v["kl_vs_rag_median"] is not None else "-"
            p = f"{v['sign_p_vs_no_rerank']:.2f}" if v["sign_p_vs_no_rerank"] is not None else "-"
            print(f"{r['doc_tokens']:10.0f} {r['generator']:>10} {r['x_window']:5.1f} {r['questions']:3d} {m:>20} "
                  f"{v['accuracy']:8.0%} "
                  f"{v['ci95'][0]:5.0%}-{v['ci95'][1]:4.0%} {v['recall']:6.0%} {v['ttft_median_s']:7.2f} "
                  f"{v['ttft_p90_s']:6.2f} {v['prefilled_median']:9.0f} {v['restored_median']:8.0f} "
                  f"{v['recomputed_median']:6.0f} {kl:>9} {v['seamed_share']:6.0%} "
                  f"{'+%d/-%d' % tuple(v['paired_vs_first_config'] or (0, 0)):>7} "
                  f"{'+%d/-%d' % tuple(v['paired_vs_rag'] or (0, 0)):>7} "
                  f"{'+%d/-%d' % tuple(v['paired_vs_no_rerank'] or (0, 0)):>7} {p:>5}")
    for r in rows:
        print(f"{r['doc_tokens']:10.0f} {r['generator']:>10}: {r['haystacks']} haystacks, {r['deposits_reused']} deposits reused "
              f"(--keep), {r['deposit_s']:.0f} s depositing")
    print("\nselection recall@k (needle inside the k best blocks)")
    for r in rows:
        for s, d in r["selection_recall"].items():
            print(f"{r['doc_tokens']:10.0f} {r['generator']:>10} {s:>6} " + "  ".join(f"@{k} {v:4.0%}" for k, v in d.items()))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d") + (f"-{args.tag}" if args.tag else "")
    write_json((out / f"qa-{stamp}.json"), result, seed)
    _plot(rows, out / f"qa-{stamp}.png")
    print(f"wrote {out}/qa-{stamp}.json and .png")
    import shutil
    shutil.rmtree(work, ignore_errors=True)


def _plot(rows, path) -> None:
    """Per size: accuracy of every method per generator (bars, 95% CI) and median TTFT."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    sizes = list(dict.fromkeys(r["size"] for r in rows))
    fig, axes = plt.subplots(len(sizes), 2, figsize=(16, 4.4 * len(sizes)), squeeze=False,
                             gridspec_kw={"width_ratios": [3, 1]})
    for (a, b), size in zip(axes, sizes):
        here = [r for r in rows if r["size"] == size]
        methods = list(dict.fromkeys(m for r in here for m in r["methods"]))
        w = 0.8 / len(methods)
        for j, m in enumerate(methods):
            xs = [i + j * w for i, r in enumerate(here) if m in r["methods"]]
            v = [r["methods"][m] for r in here if m in r["methods"]]
            a.bar(xs, [x["accuracy"] for x in v], w, label=m,
                  yerr=[[x["accuracy"] - x["ci95"][0] for x in v], [x["ci95"][1] - x["accuracy"] for x in v]],
                  capsize=2)
        a.set_xticks([i + 0.4 - w / 2 for i in range(len(here))],
                     [f"{r['generator']}\n(n={r['questions']})" for r in here])
        a.set(ylabel="accuracy (95% CI)", ylim=(0, 1.05), title=f"QA accuracy per question generator, {size} tokens")
        a.legend(fontsize=7, ncol=2)
        pool = next((r for r in here if r["generator"] == "pooled"), here[-1])
        ms = list(pool["methods"])
        b.barh(ms, [pool["methods"][m]["ttft_median_s"] for m in ms])
        b.set(xlabel="seconds", title=f"median TTFT ({pool['generator']})")
        b.tick_params(axis="y", labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
