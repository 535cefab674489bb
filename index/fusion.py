"""Rank fusion and per-block aggregation of window hits. Pure: no torch, no faiss."""

from __future__ import annotations

from collections.abc import Iterable

RRF_K = 60               # the constant of Cormack et al. (2009); robust across collections


def best_per_block(hits: Iterable[tuple[int, float]], row_of, tie=None) -> list[tuple[int, float]]:
    """Window hits (id, score) -> blocks (row, best window score), best first; equal scores
    break by tie(row) (default: the row itself)."""
    best: dict[int, float] = {}
    for wid, s in hits:
        r = row_of(wid)
        if r not in best or s > best[r]:
            best[r] = s
    tie = tie or (lambda r: r)
    return sorted(best.items(), key=lambda kv: (-kv[1], tie(kv[0])))


def rrf(rankings: list[list[int]], k: int = RRF_K, weights: list[float] | None = None,
        tie=None) -> list[tuple[int, float]]:
    """Reciprocal rank fusion: score(x) = sum over rankings of weight / (k + rank), rank from 1.

    Ties (equal fused score) break by the earliest rank in any list, then by tie(id) (default:
    the id), so the order is deterministic."""
    score: dict[int, float] = {}
    first: dict[int, int] = {}
    for i, ranking in enumerate(rankings):
        w = 1.0 if weights is None else weights[i]
        for rank, x in enumerate(ranking, start=1):
            score[x] = score.get(x, 0.0) + w / (k + rank)
            first[x] = min(first.get(x, rank), rank)
    tie = tie or (lambda x: x)
    return sorted(score.items(), key=lambda kv: (-kv[1], first[kv[0]], tie(kv[0])))
