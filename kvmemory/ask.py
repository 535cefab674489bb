"""ask: select blocks for a question, page them in, graft them into a fixed-size window, answer.

    question -> rank blocks (dense + BM25 windows, fused) -> the top_k, each with its segment
             prefix (window.plan) -> pager.fetch (one concurrent read) -> gather_blocks (copy;
             re-rotate keys whose slot differs from their deposit position)
             -> prefill the question over the window (optionally recomputing a fraction of the
                window's tokens, blend.py) -> greedy answer

With `reread` (the default) only the window's exact prefix is grafted (the prelude and the leading
run at the positions it was computed at, behind the blocks it was computed after); the tokens after
it (a second run, computed apart from the first) are prefilled over it with the question, the
canonical way. The window then holds what re-reading its text computes, and a window of one exact
run (most of them, with the re-rank) is grafted whole at no extra cost.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

import torch

from kvmemory import graft
from kvmemory.decode import TextStream, greedy
from kvmemory.device import to_host
from kvmemory.errors import EmptyStoreError, InputError, WindowExceededError
from kvmemory.options import AskOptions
from kvmemory.rerank import rerank as rerank_blocks, within_margin
from kvmemory.retrieve import rank_blocks, relevant
from kvmemory.runtime import Runtime
from kvmemory.window import WindowPlan, plan


@dataclass
class Answer:
    text: str
    sources: list[tuple[str, int, int, float]]     # (doc_id, start_token, end_token, score), window order
    stats: dict = field(default_factory=dict)
    window: WindowPlan | None = field(default=None, repr=False)            # what was grafted where
    first_logits: torch.Tensor | None = field(default=None, repr=False)    # [vocab] of the first answer token


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


def ask(rt: Runtime, docs, question: str, opts: AskOptions = AskOptions(), on_token=None, doc_filter=None) -> Answer:
    """Answer `question` from the documents of `docs` (a Documents) as `opts` says. on_token(text)
    streams the answer; doc_filter(doc_id) -> bool limits the documents used."""
    t0 = time.perf_counter()
    if not isinstance(question, str) or not question.strip():
        raise InputError("the question is empty")
    store = rt.store()
    store.refresh()
    manifest = store.manifest
    if not manifest.docs:
        raise EmptyStoreError(f"store {rt.path} holds no documents; add some first (kvmemory add)")
    q_ids = docs.prelude.question_ids(question)
    prelude_ids = docs.prelude.ids
    room = rt.geometry.max_positions - len(prelude_ids) - opts.max_new_tokens
    if len(q_ids) > room:
        raise WindowExceededError(f"the question is {len(q_ids)} tokens; at most {room} fit the window with the "
                                  f"prelude and {opts.max_new_tokens} answer tokens")
    # ---- selection
    t = time.perf_counter()
    pool = rank_blocks(rt, docs, question, opts.selector, n=max(4 * opts.top_k, 16, opts.rerank),
                       doc_filter=doc_filter)
    if not pool:
        raise EmptyStoreError(f"store {rt.path} holds no document this question may use")
    select_s = time.perf_counter() - t
    rr = {"blocks": 0, "tokens_restored": 0, "tokens_prefilled": 0, "seconds": 0.0}
    if opts.rerank > 1:
        first = relevant(pool, opts.rerank, opts.min_relevance)
        ranked, rr = rerank_blocks(rt, docs, q_ids, first, opts.rerank)
        ranked = within_margin(ranked, opts.top_k, opts.rerank_margin, keep=first[0] if opts.rerank_keep else None)
    else:
        ranked = relevant(pool, opts.top_k, opts.min_relevance)
    cands, context = graft.candidates(rt, docs, ranked, opts.expand)
    window = plan(cands, len(prelude_ids), len(q_ids), opts.max_new_tokens, rt.geometry.max_positions, opts.top_k,
                  context, opts.max_context_tokens, opts.order)
    # the RoPE shift of every slot comes from its stored positions: trust them only once its id
    # re-derives from its parent, tokens and positions (StoreCorruptError otherwise)
    store.verified_meta([s.candidate.row for s in window.slots])
    # ---- page in and graft
    device = rt.model.device
    exact_tokens = window.exact_prefix_tokens()
    # reread: the tokens after the exact prefix are prefilled over it, not grafted (their blocks not read)
    reread = window.context_tokens - exact_tokens if opts.reread else 0
    grafted = window.exact_head() if reread else window
    seams = [] if reread else window.seam_positions(opts.seam)
    blend = not reread and (opts.recompute > 0 or bool(seams))
    if device.type == "cuda" and not blend:              # decode attention through the paged-window kernel
        from kvmemory.ops import plain_attention, use_window_attention
        if plain_attention(rt.model):
            use_window_attention(rt.model)
    t = time.perf_counter()
    # on CPU, the plain path's window is built with room for the question and the answer: its
    # cache views it (no copy), and a batched step writes their KV in place (batching.room_of)
    room = len(q_ids) + opts.max_new_tokens if device.type == "cpu" and not blend and not reread else 0
    ctx_buf, fetch = graft.window_kv(rt, grafted, docs.prelude_kv(), room=room)
    ctx_kv = ctx_buf[:, :, :, :grafted.context_tokens]
    graft_s = time.perf_counter() - t
    # ---- answer
    t = time.perf_counter()
    if reread:          # the window's text after its exact prefix, then the question: the canonical prefill
        rest = graft.window_tokens(store, replace(window, slots=window.slots[len(grafted.slots):]))
        tail = graft.prefill_tail(rt, ctx_kv, rest + list(q_ids), chunked=True)
    else:
        tail = graft.prefill_tail(rt, ctx_kv, list(q_ids), recompute=opts.recompute, seams=seams,
                                  ctx_ids=lambda: list(prelude_ids) + graft.window_tokens(store, window),
                                  exact_tokens=exact_tokens, copy=not room, buffer=ctx_buf if room else None,
                                  batched=True)
    first_token_s = time.perf_counter() - t
    ttft = time.perf_counter() - t0
    t = time.perf_counter()
    stream = TextStream(rt.tokenizer, on_text=on_token, strip=True)
    first_at: list[float] = []

    def took(ids):                     # when the first token came (with a feed, its prefill ends there)
        if not first_at:
            first_at.append(time.perf_counter())
        return stream(ids)
    first_logits: list = []
    new = greedy(rt.model, tail.cache, tail.logits, opts.max_new_tokens, rt.eos_ids, on_token=took, feed=tail.feed,
                 first=first_logits)
    text = stream.finish(new)
    decode_s = time.perf_counter() - t
    if tail.feed is not None:
        fed = (first_at[0] if first_at else time.perf_counter()) - t
        first_token_s, ttft, decode_s = first_token_s + fed, ttft + fed, decode_s - fed
    exact = exact_tokens - window.prelude_tokens
    stats = {
        **opts.as_dict(), "tokens_seam": len(seams),
        "reranked": rr,
        "window_tokens": window.context_tokens + len(q_ids) + len(new),
        "tokens_restored": grafted.context_tokens, "tokens_prefilled": len(q_ids) + reread,
        "tokens_decoded": len(new), "tokens_exact": exact, "tokens_reread": reread,
        "tokens_rerotated": sum(s.candidate.n_tokens for s in grafted.slots if s.shift),
        "tokens_recomputed": tail.recomputed,
        "blocks": len(window.slots), "blocks_selected": sum(s.candidate.selected for s in window.slots),
        "exact_slots": window.exact_slots, "rerotated_slots": len(grafted.slots) - grafted.exact_slots,
        "reread_slots": len(window.slots) - len(grafted.slots),
        "bytes_read": {"disk": fetch.disk_bytes, "host": fetch.host_bytes},
        "blocks_from": {"gpu": fetch.from_gpu, "host": fetch.from_host, "disk": fetch.from_disk,
                        **({"disk_cache": fetch.from_disk_cache, "object_store": fetch.from_object_store}
                           if store.remote else {})},
        "tiers": fetch.tiers,
        "ranking": [{"row": h.row, "score": h.score, "ranks": h.ranks} for h in ranked],
        "timings_s": {"select": select_s, "rerank": rr["seconds"], "page_in_and_graft": graft_s,
                      "disk_read": fetch.disk_s, "first_token": first_token_s, "ttft": ttft, "decode": decode_s,
                      "total": time.perf_counter() - t0},
        "store_tokens": sum(d.n_tokens for d in manifest.docs.values()),
        # a compact store: the worst measured error of the blocks grafted (prelude and slots)
        "encoding": manifest.encoding,
        "encoding_error": store.error_report([s.candidate.row for s in grafted.slots] +
                                             store.chain(docs.prelude_state()[1])) if store.encoding.lossy else None,
    }
    return Answer(text, sources_of(window), stats, window, to_host(first_logits[0]).float())


def passages(rt: Runtime, answer: Answer) -> list[dict]:
    """What an Answer grafted, as text: one dict per run of answer.sources (doc_id, start_token,
    end_token, score, text), window order. The text is the blocks' stored tokens, decoded."""
    window = answer.window
    if window is None:
        return []
    meta = rt.store().block_meta([s.candidate.row for s in window.slots])
    runs: list[list] = []
    for i, s in enumerate(window.slots):
        c = s.candidate
        ids = [int(x) for x in meta["tokens"][i][: c.n_tokens]]
        if runs and runs[-1][0] == (c.doc_id, c.doc_start):
            runs[-1][0] = (c.doc_id, c.doc_start + c.n_tokens)
            runs[-1][1] += ids
        else:
            runs.append([(c.doc_id, c.doc_start + c.n_tokens), ids])
    return [{"doc_id": d, "start_token": a, "end_token": b, "score": score,
             "text": rt.tokenizer.decode(ids, skip_special_tokens=True)}
            for (d, a, b, score), (_, ids) in zip(answer.sources, runs, strict=True)]
