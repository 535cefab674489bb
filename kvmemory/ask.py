"""ask: select blocks for a question, page them in, graft them into a fixed-size window, answer.

    question -> rank blocks (dense + BM25 windows, fused) -> the top_k, each with its segment
             prefix (window.plan) -> pager.fetch (one concurrent read) -> gather_blocks (copy;
             re-rotate keys whose slot differs from their deposit position)
             -> prefill the question over the window (optionally recomputing a fraction of the
                window's tokens, blend.py) -> greedy answer
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from kvmemory import batching, kv as kvops
from kvmemory.config import (ASK_CONTEXT_TOKENS, ASK_MIN_RELEVANCE, ASK_ORDER, ASK_RECOMPUTE, ASK_RERANK,
                             ASK_RERANK_MARGIN, ASK_SEAM, ASK_TOP_K)
from kvmemory.decode import TextStream, greedy
from kvmemory.device import ids_tensor, to_host
from kvmemory.errors import EmptyStoreError, InputError, WindowExceededError
from kvmemory.ops import gather_blocks
from kvmemory.retrieve import check_selector, rank_blocks, relevant
from kvmemory.window import ORDERS, Candidate, WindowPlan, plan

TOP_K, RECOMPUTE, MIN_RELEVANCE = ASK_TOP_K, ASK_RECOMPUTE, ASK_MIN_RELEVANCE
RERANK, RERANK_MARGIN, CONTEXT_TOKENS = ASK_RERANK, ASK_RERANK_MARGIN, ASK_CONTEXT_TOKENS
SEAM, ORDER = ASK_SEAM, ASK_ORDER


@dataclass
class Answer:
    text: str
    sources: list[tuple[str, int, int, float]]     # (doc_id, start_token, end_token, score), window order
    stats: dict = field(default_factory=dict)
    window: WindowPlan | None = field(default=None, repr=False)            # what was grafted where
    first_logits: torch.Tensor | None = field(default=None, repr=False)    # [vocab] of the first answer token


def build_window(mem, docs, window: WindowPlan, prelude_kv: torch.Tensor, room: int = 0) -> tuple[torch.Tensor, object]:
    """The window's KV [L, 2, H, context_tokens, D]: prelude, then every slot (re-rotated as needed).
    room: that many more tokens allocated after them, left unwritten ([..., context_tokens + room, D])."""
    geo = mem.geometry
    rows = [s.candidate.row for s in window.slots]
    pool, fetch = mem.pager.fetch(rows, stacked=mem.pager.device.type == "cuda")   # [k, L, 2, H, C, D]
    dev = mem.pager.device if rows else "cpu"
    out = torch.empty((geo.layers, 2, geo.kv_heads, window.context_tokens + room, geo.head_dim), dtype=mem.kv_dtype,
                      device=dev)
    out[:, :, :, :window.prelude_tokens] = prelude_kv.to(out.device)
    if rows:
        t = lambda xs: torch.tensor(xs, dtype=torch.long)              # noqa: E731
        gather_blocks(pool, t(list(range(len(rows)))), t([s.candidate.n_tokens for s in window.slots]),
                      t([s.offset for s in window.slots]), t([s.shift for s in window.slots]), out, docs.freqs)
    return out, fetch


def candidates(mem, docs, chosen, expand: bool) -> tuple[list[Candidate], dict[int, list[Candidate]]]:
    """Window candidates of the chosen blocks, and (expand) each one's segment prefix: the blocks
    before it in its deposit segment, in document order."""
    store, live = mem.store, docs.live_map()
    C, p = store.manifest.block_tokens, len(docs.prelude.ids)
    meta = store.block_meta([h.row for h in chosen])
    cands = [_candidate(live, h.row, int(meta["positions"][i][0]), int(meta["n_tokens"][i]), C, h.score)
             for i, h in enumerate(chosen)]
    context: dict[int, list[Candidate]] = {}
    if expand:
        want: dict[int, list[int]] = {}
        for c in cands:
            i = live[c.row][2]
            back = (c.deposit_pos - p) // C                 # blocks before it in its segment
            want[c.row] = store.manifest.docs[c.doc_id].rows[max(0, i - back):i]
        rows = sorted({r for v in want.values() for r in v})
        pm = store.block_meta(rows)
        at = {r: j for j, r in enumerate(rows)}
        for row, prev in want.items():
            doc_id, rank, i = live[row]         # context is placed by the document of the block it serves
            context[row] = [Candidate(r, doc_id, rank, (i - len(prev) + j) * C, int(pm["n_tokens"][at[r]]),
                                      int(pm["positions"][at[r]][0]), 0.0, selected=False)
                            for j, r in enumerate(prev)]
    return cands, context


def _candidate(live, row: int, deposit_pos: int, n_tokens: int, C: int, score: float) -> Candidate:
    doc_id, rank, i = live[row]
    return Candidate(row=row, doc_id=doc_id, doc_rank=rank, doc_start=i * C, n_tokens=n_tokens,
                     deposit_pos=deposit_pos, score=score)


def sources_of(window: WindowPlan) -> list[tuple[str, int, int, float]]:
    """Contiguous runs of grafted blocks as (doc_id, start, end, best score of a selected block), window order."""
    out: list[list] = []
    for s in window.slots:
        c = s.candidate
        score = c.score if c.selected else float("-inf")
        if out and out[-1][0] == c.doc_id and out[-1][2] == c.doc_start:
            out[-1][2] = c.doc_start + c.n_tokens
            out[-1][3] = max(out[-1][3], score)
        else:
            out.append([c.doc_id, c.doc_start, c.doc_start + c.n_tokens, score])
    return [(d, a, b, s if s != float("-inf") else 0.0) for d, a, b, s in out]


@torch.inference_mode()
def check_recompute(recompute) -> None:
    """recompute (ask and solve): the fraction of the grafted tokens to recompute, a number in [0, 1]
    (not a boolean)."""
    if isinstance(recompute, bool) or not isinstance(recompute, (int, float)) or not 0.0 <= recompute <= 1.0:
        raise InputError(f"recompute is the fraction of the grafted tokens to recompute, a number in [0, 1], "
                         f"got {recompute!r}")


def ask(mem, docs, question: str, top_k: int = TOP_K, selector: str = "text", max_new_tokens: int = 48,
        recompute: float = RECOMPUTE, expand: bool = True, min_relevance: float = MIN_RELEVANCE,
        on_token=None, doc_filter=None, rerank: int = RERANK, rerank_margin: float = RERANK_MARGIN,
        max_context_tokens: int = CONTEXT_TOKENS, seam: int = SEAM, order: str = ORDER) -> Answer:
    t0 = time.perf_counter()
    if not isinstance(question, str) or not question.strip():
        raise InputError("the question is empty")
    if top_k < 1 or max_new_tokens < 1:
        raise InputError(f"top_k and max_new_tokens must be >= 1, got {top_k} and {max_new_tokens}")
    if not isinstance(min_relevance, (int, float)) or not 0.0 <= min_relevance <= 1.0:
        raise InputError(f"min_relevance is a fraction of the best block's BM25 score in [0, 1], got {min_relevance!r}")
    check_recompute(recompute)
    check_selector(selector)
    if isinstance(rerank, bool) or not isinstance(rerank, int) or rerank < 0:
        raise InputError(f"rerank is how many ranked blocks to re-rank with the model (0: none), got {rerank!r}")
    if isinstance(rerank_margin, bool) or not isinstance(rerank_margin, (int, float)) or not rerank_margin >= 0:
        raise InputError(f"rerank_margin is in nats per question token, a number >= 0, got {rerank_margin!r}")
    if isinstance(max_context_tokens, bool) or not isinstance(max_context_tokens, int) or max_context_tokens < 1:
        raise InputError(f"max_context_tokens is a number of tokens >= 1, got {max_context_tokens!r}")
    if isinstance(seam, bool) or not isinstance(seam, int) or seam < 0:
        raise InputError(f"seam is how many tokens to recompute at the start of each grafted run (0: none), "
                         f"got {seam!r}")
    if order not in ORDERS:
        raise InputError(f"order is one of {', '.join(ORDERS)}, got {order!r}")
    store = mem.require_store()
    store.refresh()
    manifest = store.manifest
    if not manifest.docs:
        raise EmptyStoreError(f"store {mem.path} holds no documents; add some first (kvmemory add)")
    q_ids = docs.prelude.question_ids(question)
    prelude_ids = docs.prelude.ids
    room = mem.geometry.max_positions - len(prelude_ids) - max_new_tokens
    if len(q_ids) > room:
        raise WindowExceededError(f"the question is {len(q_ids)} tokens; at most {room} fit the window with the "
                                  f"prelude and {max_new_tokens} answer tokens")
    # ---- selection
    t = time.perf_counter()
    pool = rank_blocks(mem, docs, question, selector, n=max(4 * top_k, 16, rerank), doc_filter=doc_filter)
    if not pool:
        raise EmptyStoreError(f"store {mem.path} holds no document this question may use")
    select_s = time.perf_counter() - t
    rr = {"blocks": 0, "tokens_restored": 0, "tokens_prefilled": 0, "seconds": 0.0}
    if rerank > 1:
        from kvmemory.rerank import rerank as _rerank, within_margin
        ranked, rr = _rerank(mem, docs, q_ids, relevant(pool, rerank, min_relevance), rerank)   # the contenders
        ranked = within_margin(ranked, top_k, rerank_margin)
    else:
        ranked = relevant(pool, top_k, min_relevance)
    cands, context = candidates(mem, docs, ranked, expand)
    window = plan(cands, len(prelude_ids), len(q_ids), max_new_tokens, mem.geometry.max_positions, top_k, context,
                  max_context_tokens, order)
    # the RoPE shift of every slot comes from its stored positions: trust them only once its id
    # re-derives from its parent, tokens and positions (StoreCorruptError otherwise)
    store.verified_meta([s.candidate.row for s in window.slots])
    # ---- page in and graft
    device = mem.model.device
    seams = window.seam_positions(seam)
    if device.type == "cuda" and recompute == 0 and not seams:   # decode attention through the paged-window kernel
        from kvmemory.ops import use_window_attention
        use_window_attention(mem.model)
    t = time.perf_counter()
    # on CPU, the plain path's window is built with room for the question and the answer: its
    # cache views it (no copy), and a batched step writes their KV in place (batching.room_of)
    room = len(q_ids) + max_new_tokens if device.type == "cpu" and recompute == 0 and not seams else 0
    ctx_buf, fetch = build_window(mem, docs, window, docs.prelude_kv(), room=room)
    ctx_kv = ctx_buf[:, :, :, :window.context_tokens]
    graft_s = time.perf_counter() - t
    # ---- answer
    t = time.perf_counter()
    recomputed, feed = 0, None
    exact_tokens = window.exact_prefix_tokens()
    if recompute > 0 or seams:
        from kvmemory.blend import blend_prefill
        ctx_ids = list(prelude_ids) + window_tokens(store, window)
        logits, kv, bs = blend_prefill(mem.model, ctx_kv, ctx_ids, q_ids, float(recompute),
                                       exact_tokens=exact_tokens, always=seams)
        recomputed = bs.recomputed
        cache = kvops.make_cache(kv, mem.model.config)
    else:
        cache = kvops.make_cache(ctx_kv, mem.model.config, copy=not room)
        if room:
            batching.room_of(cache, ctx_buf)
        batcher = batching.current()
        if batcher is not None and batcher.model is mem.model:
            # served with others: the question's tokens are this sequence's rows of the decode
            # loop's next step (greedy's feed), not a pass over the weights of their own
            logits, feed = None, list(q_ids)
        else:
            logits = kvops.last_logits(mem.model, ids_tensor(q_ids, mem.model), cache)
    first_token_s = time.perf_counter() - t
    ttft = time.perf_counter() - t0
    t = time.perf_counter()
    stream = TextStream(mem.tokenizer, on_text=on_token, strip=True)
    first_at: list[float] = []

    def took(ids):                     # when the first token came (with a feed, its prefill ends there)
        if not first_at:
            first_at.append(time.perf_counter())
        return stream(ids)
    first_logits: list = []
    new = greedy(mem.model, cache, logits, max_new_tokens, mem.eos_ids, on_token=took, feed=feed, first=first_logits)
    logits = first_logits[0]
    text = stream.finish(new)
    decode_s = time.perf_counter() - t
    if feed is not None:
        fed = (first_at[0] if first_at else time.perf_counter()) - t
        first_token_s, ttft, decode_s = first_token_s + fed, ttft + fed, decode_s - fed
    exact = exact_tokens - window.prelude_tokens
    stats = {
        "selector": selector, "top_k": top_k, "recompute": recompute, "min_relevance": min_relevance,
        "rerank": rerank, "rerank_margin": rerank_margin, "max_context_tokens": max_context_tokens,
        "seam": seam, "order": order, "tokens_seam": len(seams),
        "reranked": rr,
        "window_tokens": window.context_tokens + len(q_ids) + len(new),
        "tokens_restored": window.context_tokens, "tokens_prefilled": len(q_ids), "tokens_decoded": len(new),
        "tokens_exact": exact, "tokens_rerotated": sum(s.candidate.n_tokens for s in window.slots if s.shift),
        "tokens_recomputed": recomputed,
        "blocks": len(window.slots), "blocks_selected": sum(s.candidate.selected for s in window.slots),
        "exact_slots": window.exact_slots, "rerotated_slots": len(window.slots) - window.exact_slots,
        "bytes_read": {"disk": fetch.disk_bytes, "host": fetch.host_bytes},
        "blocks_from": {"gpu": fetch.from_gpu, "host": fetch.from_host, "disk": fetch.from_disk,
                        **({"disk_cache": fetch.from_disk_cache, "object_store": fetch.from_object_store}
                           if mem.store.remote else {})},
        "tiers": fetch.tiers,
        "ranking": [{"row": h.row, "score": h.score, "ranks": h.ranks} for h in ranked],
        "timings_s": {"select": select_s, "rerank": rr["seconds"], "page_in_and_graft": graft_s, "disk_read": fetch.disk_s,
                      "first_token": first_token_s, "ttft": ttft, "decode": decode_s,
                      "total": time.perf_counter() - t0},
        "store_tokens": sum(d.n_tokens for d in manifest.docs.values()),
        # a compact store: the worst measured error of the blocks grafted (prelude and slots)
        "encoding": manifest.encoding,
        "encoding_error": store.error_report([s.candidate.row for s in window.slots] +
                                             store.chain(docs._prelude_state()[1])) if store.encoding.lossy else None,
    }
    return Answer(text, sources_of(window), stats,
                  window, to_host(logits).float())


def passages(mem, answer: Answer) -> list[dict]:
    """What an Answer grafted, as text: one dict per run of answer.sources (doc_id, start_token,
    end_token, score, text), window order. The text is the blocks' stored tokens, decoded."""
    window = answer.window
    if window is None:
        return []
    meta = mem.require_store().block_meta([s.candidate.row for s in window.slots])
    runs: list[list[int]] = []
    for i, s in enumerate(window.slots):
        c = s.candidate
        ids = [int(x) for x in meta["tokens"][i][: c.n_tokens]]
        if runs and runs[-1][0] == (c.doc_id, c.doc_start):
            runs[-1][0] = (c.doc_id, c.doc_start + c.n_tokens)
            runs[-1][1] += ids
        else:
            runs.append([(c.doc_id, c.doc_start + c.n_tokens), ids])
    return [{"doc_id": d, "start_token": a, "end_token": b, "score": score,
             "text": mem.tokenizer.decode(ids, skip_special_tokens=True)}
            for (d, a, b, score), (_, ids) in zip(answer.sources, runs, strict=True)]


def window_tokens(store, window: WindowPlan) -> list[int]:
    """Token ids of the window's slots, in window order."""
    meta = store.block_meta([s.candidate.row for s in window.slots])
    out: list[int] = []
    for i, s in enumerate(window.slots):
        out += [int(x) for x in meta["tokens"][i][: s.candidate.n_tokens]]
    return out
