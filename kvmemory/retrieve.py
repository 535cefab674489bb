"""Selection: rank a store's live blocks for a question.

    question -> dense windows (FAISS) ┐
             -> BM25 windows (bm25s)  ┴> best window per block -> reciprocal rank fusion -> blocks

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

# windows fetched from each index per block wanted: several windows of one block may lead
WINDOWS_PER_BLOCK = 8
MIN_POOL = 64
# The fusion, measured with benchmarks/bench_select.py on fresh draws (README): plain RRF
# (equal weights, k = 60) lets a dense near-miss outrank BM25's exact hit and lost 20 points
# of recall@2 against BM25 alone; dense at 0.3 and k = 10 keeps BM25's order where it is sure
# and lets the dense ranking break its ties and answer where BM25 finds no term at all.
FUSION_WEIGHTS = {"dense": 0.3, "bm25": 1.0}
FUSION_K = 10


@dataclass(frozen=True)
class Ranked:
    row: int
    score: float                 # the selector's score: RRF for "text", inner product or BM25 otherwise
    ranks: dict                  # index kind -> 1-based rank of the block in that index (absent: not found)


def check_selector(selector: str) -> None:
    if selector not in SELECTORS:
        raise InputError(f"selector must be one of {SELECTORS}, got {selector!r}")


def rank_blocks(mem, docs, question: str, selector: str = "text", n: int = 32) -> list[Ranked]:
    """The n best live blocks for a question, best first."""
    check_selector(selector)
    live = docs.live_map()
    pool = max(MIN_POOL, n * WINDOWS_PER_BLOCK)
    per_kind: dict[str, list[tuple[int, float]]] = {}
    for kind in NEEDS[selector]:
        idx = docs.index(kind)
        if kind == "dense":
            hits = idx.search(docs.embedder.embed([question])[0], pool)
        elif kind == "bm25":
            hits = idx.search(question, pool)
        else:
            g = mem.geometry
            from kvmemory.documents import text_ids
            qv = keysel.query_vector(mem.model, text_ids(mem.tokenizer, question), docs.key_layer, g.kv_heads,
                                     g.head_dim)
            hits = idx.search(qv, pool)
        per_kind[kind] = [(r, s) for r, s in best_per_block(hits, win.row_of) if r in live]
    ranks = {k: {r: i for i, (r, _) in enumerate(v, start=1)} for k, v in per_kind.items()}
    if len(per_kind) == 1:
        (kind, blocks), = per_kind.items()
        order = blocks
    else:
        order = rrf([[r for r, _ in v] for v in per_kind.values()], k=FUSION_K,
                    weights=[FUSION_WEIGHTS[k] for k in per_kind])
    return [Ranked(r, float(s), {k: ranks[k][r] for k in ranks if r in ranks[k]}) for r, s in order[:n]]


