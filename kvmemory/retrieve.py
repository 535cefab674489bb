"""Selection: rank a store's live blocks for a question.

    question -> dense windows (FAISS) ┐
             -> BM25 windows          ┴> best window per block -> reciprocal rank fusion -> blocks

Each index ranks windows; a block takes its best window's rank; the text selector fuses the
dense and lexical block rankings by reciprocal rank. Only blocks of visible documents count.
"""

from __future__ import annotations

from dataclasses import dataclass


from kvmemory.errors import InputError
from kvmemory.index import NEEDS, SELECTORS
from kvmemory.index import keys as keysel
from kvmemory.index import windows as win
from kvmemory.index.fusion import best_per_block, rrf
from kvmemory.runtime import Runtime
from kvmemory.text import text_ids

# windows fetched from each index per block wanted: several windows of one block may lead
WINDOWS_PER_BLOCK = 8
MIN_POOL = 64
# The fusion, measured with benchmarks/bench_select.py on fresh draws (docs/benchmarks/answer-quality.md, "Answer
# quality"): plain RRF (equal weights, k = 60) let dense near-misses (the same sentence about
# another city) outrank BM25's exact hit and lost 20-25 points of recall@2 against BM25 alone;
# at dense 0.3 it still lost 5-9. At 0.05 and k = 10 the dense ranking cannot reorder BM25's
# first four blocks: it breaks BM25's ties further down and answers alone where BM25 finds no
# term of the question (recall equal to BM25's on every draw measured).
FUSION_WEIGHTS = {"dense": 0.05, "bm25": 1.0}
FUSION_K = 10
# relevant(held=...): a block below the cut that holds a term of the question no kept block holds needs
# this fraction of the first block's BM25 score
COVER = 0.5


@dataclass(frozen=True)
class Ranked:
    row: int
    score: float                 # the selector's score: RRF for "text", inner product or BM25 otherwise
    ranks: dict                  # index kind -> 1-based rank of the block in that index (absent: not found)
    scores: dict                 # index kind -> the block's best window score in that index


def check_selector(selector: str) -> None:
    if selector not in SELECTORS:
        raise InputError(f"selector must be one of {SELECTORS}, got {selector!r}")


def rank_blocks(rt: Runtime, docs, question: str, selector: str = "text", n: int = 32, doc_filter=None,
                lexical: str | None = None, need=None) -> list[Ranked]:
    """The n best live blocks for a question, best first. doc_filter(doc_id) -> bool limits the
    ranking to some documents (the indexes are searched deeper to find them). lexical: the query
    BM25 scores (default: the question); need: BM25 ranks only the windows holding one of these terms
    (index.lexical.terms)."""
    check_selector(selector)
    live = docs.live_map()
    if doc_filter is not None:
        live = {r: v for r, v in live.items() if doc_filter(v[0])}
    # equal scores break by where the block sits in the documents (deposit rank, index in the
    # document), not by its row: a store built in another order (Ray, a resumed deposit) ranks alike
    def tie(r):
        return live[r][1:]
    pool = max(MIN_POOL, n * WINDOWS_PER_BLOCK) * (8 if doc_filter is not None else 1)
    per_kind: dict[str, list[tuple[int, float]]] = {}
    for kind in NEEDS[selector]:
        idx = docs.index(kind)
        if kind == "dense":
            hits = idx.search(docs.embedder.embed([question])[0], pool)
        elif kind == "bm25":
            hits = idx.search(question if lexical is None else lexical, pool, need)
        else:
            g = rt.geometry
            qv = keysel.query_vector(rt.model, text_ids(rt.tokenizer, question), docs.key_layer, g.kv_heads,
                                     g.head_dim)
            hits = idx.search(qv, pool)
        hits = [h for h in hits if win.row_of(h[0]) in live]
        per_kind[kind] = best_per_block(hits, win.row_of, tie)
    ranks = {k: {r: i for i, (r, _) in enumerate(v, start=1)} for k, v in per_kind.items()}
    raw = {k: dict(v) for k, v in per_kind.items()}
    if len(per_kind) == 1:
        (kind, blocks), = per_kind.items()
        order = blocks
    else:
        order = rrf([[r for r, _ in v] for v in per_kind.values()], k=FUSION_K,
                    weights=[FUSION_WEIGHTS[k] for k in per_kind], tie=tie)
    return [Ranked(r, float(s), {k: ranks[k][r] for k in ranks if r in ranks[k]},
                   {k: raw[k][r] for k in raw if r in raw[k]}) for r, s in order[:n]]


def relevant(ranked: list[Ranked], top_k: int, min_relevance: float, held=None) -> list[Ranked]:
    """The first block, then each of the next top_k - 1 whose BM25 score is at least
    min_relevance x the first's: a block far less relevant than the best is a distractor to
    a small model, not help (benchmarks/bench_qa.py measures the cut). Where the first block
    has no BM25 score (the dense ranking found it alone) nothing is cut.

    held(block) -> the question's terms the block holds: with it, a block below the bar is kept
    still when it holds a term of the question that no block kept before it holds and scores at
    least COVER x the first (a question of two facts needs both turns, the second sharing fewer
    words with it: "What is my locker code, and what is my sister's name?")."""
    if not ranked:
        return []
    best = ranked[0].scores.get("bm25")
    if best is None or min_relevance <= 0:
        return ranked[:top_k]
    out, have = [ranked[0]], set(held(ranked[0])) if held else set()
    for h in ranked[1:top_k]:
        s = h.scores.get("bm25", 0.0)
        if s < min(COVER, min_relevance) * best:
            continue                                   # under both bars: its terms are not read
        mine = set(held(h)) if held else set()
        if s >= min_relevance * best or not mine <= have:
            out.append(h)
            have |= mine
    return out


