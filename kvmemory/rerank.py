"""Re-rank with the model over stored KV: the question's likelihood behind each candidate.

For each of the fused ranking's first n blocks, the block is grafted behind the prelude with
the blocks before it in its deposit segment (its segment prefix, at the positions it was
computed at: byte for byte, no re-rotation), the question is prefilled over that window, and
the block is scored by the mean log-probability of the question's own words given the passage
(query likelihood, as UPR, Sachan et al. 2022, does with re-read text). A passage about the
question's subject makes its words likely; a distractor of the same shape (another city's
magic number) does not. The question's tokens behind all n windows run in one pass over the
weights (kvmemory.batching.forward_many; each window attended to alone): the cost of about one
forward of n x the question's tokens, not of n forwards; each window is built with room for the
question's KV, written in place (0.96 -> 0.26-0.36 s for 8 candidates, the default model on a
2-core Xeon); a cross-encoder over text would prefill each candidate's tokens
as well. A score is the question's likelihood behind a fresh prefill of its segment prefix up to
the last bits of a GEMM over more rows (bit for bit in invariant mode), and the same every time
for the same question and store (the groups are fixed by the ranking).

    ranked[:n] -> per block: graft segment prefix (exact) -> the question behind every window, in
              one pass -> mean log p(question | passage) -> re-ordered, best first

Only an ambiguous ranking is re-ranked: the candidates are the first n blocks whose BM25 score
passes the relevance cut (retrieve.relevant with n for top_k); where the best block
stands alone above the cut there is nothing to decide and no forward is run. `margin` then
decides per question whether a second block enters the window at all: only those whose score
is within `margin` (nats per question token) of the best.
"""

from __future__ import annotations

import time
from dataclasses import replace

import torch

from kvmemory import graft
from kvmemory.retrieve import Ranked
from kvmemory.runtime import Runtime
from kvmemory.window import plan

GROUP = 8          # candidates scored in one pass: their windows' KV is held at once (~46 KB a token)


@torch.inference_mode()
def question_loglik(model, cache, q_ids: list[int], span: tuple[int, int]) -> float:
    """Mean log p(q_ids[t] | cache, q_ids[:t]) over the question's own words (t in span, t >= 1;
    the template around them is the same behind every passage). Runs q_ids[:span[1]] only."""
    return questions_loglik(model, [cache], q_ids, span)[0]


@torch.inference_mode()
def questions_loglik(model, caches: list, q_ids: list[int], span: tuple[int, int]) -> list[float]:
    """question_loglik behind each of `caches`, the question's tokens behind all of them in one
    pass over the weights (kvmemory.batching.forward_many): one cache, the model's own forward;
    several, the same up to the last bits of a GEMM over more rows (bit for bit in invariant mode)."""
    from kvmemory.batching import forward_many

    a, b = max(1, span[0]), span[1]
    n = len(caches)
    logits = forward_many(model, caches, [q_ids[:b]] * n, [b - a + 1] * n)
    tgt = torch.tensor(q_ids[a:b], dtype=torch.long, device=logits[0].device)
    out = []
    for lg in logits:
        lp = torch.log_softmax(lg[:-1].float(), dim=-1)                   # predicts q_ids[a:b]
        out.append(float(lp.gather(1, tgt[:, None]).mean()))
    return out


def rerank(rt: Runtime, docs, q_ids: list[int], ranked: list[Ranked], n: int) -> tuple[list[Ranked], dict]:
    """ranked[:n] re-ordered by the question's likelihood behind each (best first; the score is
    that mean log-probability, ranks["fused"] the block's place before); the rest of `ranked`
    is dropped. Also the cost: {"blocks", "tokens_restored", "tokens_prefilled", "seconds"}."""
    t0 = time.perf_counter()
    head = ranked[:n]
    if len(head) <= 1:
        return head, {"blocks": 0, "tokens_restored": 0, "tokens_prefilled": 0, "seconds": 0.0}
    cands, context = graft.candidates(rt, docs, head, expand=True)
    prelude_kv = docs.prelude_kv()
    p = len(docs.prelude.ids)
    geo = rt.geometry
    rt.store().verified_meta(sorted({c.row for c in cands} | {x.row for v in context.values() for x in v}))
    span = docs.prelude.question_span(q_ids)
    scored: list[tuple[float, Ranked]] = []
    restored = 0
    for g in range(0, len(head), GROUP):                 # GROUP candidates' questions in one pass
        caches = []
        for c in cands[g:g + GROUP]:
            w = plan([c], p, len(q_ids), 1, geo.max_positions, 1, context)
            buf, _ = graft.window_kv(rt, w, prelude_kv, room=span[1])   # room for the question's KV
            restored += w.context_tokens - p
            caches.append(graft.view_cache(rt, buf, w.context_tokens))
        scored += zip(questions_loglik(rt.model, caches, q_ids, span), head[g:g + GROUP])
    order = sorted(range(len(scored)), key=lambda i: -scored[i][0])
    out = [replace(scored[i][1], score=scored[i][0],
                   ranks={**scored[i][1].ranks, "fused": i + 1},
                   scores={**scored[i][1].scores, "rerank": scored[i][0]}) for i in order]
    return out, {"blocks": len(head), "tokens_restored": restored, "tokens_prefilled": len(head) * span[1],
                 "seconds": time.perf_counter() - t0}


def within_margin(ranked: list[Ranked], top_k: int, margin: float, keep: Ranked | None = None) -> list[Ranked]:
    """The best re-ranked block, then each of the next top_k - 1 whose score is within `margin`
    nats (per question token) of the best's. `keep` (the first ranking's best): always in the
    result, second where the re-rank put another block first (first where top_k is 1), so a re-rank
    can add a block to the window but never drop the one the lexical and dense ranks agreed on."""
    if not ranked:
        return []
    best = ranked[0].score
    out = [ranked[0]] + [h for h in ranked[1:top_k] if h.score >= best - margin]
    if keep is None or any(h.row == keep.row for h in out):
        return out
    mine = next((h for h in ranked if h.row == keep.row), keep)     # with its re-rank score
    return [mine] if top_k == 1 else [ranked[0], mine] + [h for h in out[1:top_k - 1]]
