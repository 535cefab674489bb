"""ask: select blocks for a question, page them in, graft them into a fixed-size window, answer.

    question -> selector vector -> FAISS top-k -> window.plan -> pager.fetch (one concurrent read)
             -> gather_blocks (copy; re-rotate keys whose slot differs from their deposit position)
             -> prefill the question over the window -> greedy answer
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from kvmemory import kv as kvops
from kvmemory.errors import InputError, KVMemoryError, WindowExceededError
from kvmemory.index import keys as keysel
from kvmemory.memory import _eos_ids
from kvmemory.ops import gather_blocks
from kvmemory.window import Candidate, WindowPlan, plan


class EmptyStoreError(KVMemoryError):
    """ask() on a store that holds no documents."""


@dataclass
class Answer:
    text: str
    sources: list[tuple[str, int, int, float]]     # (doc_id, start_token, end_token, score), window order
    stats: dict = field(default_factory=dict)


def build_window(mem, docs, window: WindowPlan, prelude_kv: torch.Tensor):
    """The window's KV as a transformers cache: prelude, then every slot (re-rotated as needed)."""
    geo = mem.geometry
    rows = [s.candidate.row for s in window.slots]
    pool, fetch = mem.pager.fetch(rows)                                   # [k, L, 2, H, C, D]
    out = torch.empty((geo.layers, 2, geo.kv_heads, window.context_tokens, geo.head_dim), dtype=mem._dtype,
                      device=pool.device if rows else "cpu")
    out[:, :, :, :window.prelude_tokens] = prelude_kv.to(out.device)
    if rows:
        t = lambda xs: torch.tensor(xs, dtype=torch.long)              # noqa: E731
        gather_blocks(pool, t(list(range(len(rows)))), t([s.candidate.n_tokens for s in window.slots]),
                      t([s.offset for s in window.slots]), t([s.shift for s in window.slots]), out, docs.freqs)
    return kvops.make_cache(out, mem.model.config), fetch


@torch.inference_mode()
def ask(mem, docs, question: str, top_k: int = 8, selector: str = "text", max_new_tokens: int = 48) -> Answer:
    t0 = time.perf_counter()
    if not isinstance(question, str) or not question.strip():
        raise InputError("the question is empty")
    if top_k < 1 or max_new_tokens < 1:
        raise InputError(f"top_k and max_new_tokens must be >= 1, got {top_k} and {max_new_tokens}")
    store = mem._store()
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
    idx = docs.index(selector)                 # validates the selector before any work
    if selector == "keys":
        g = mem.geometry
        qv = keysel.query_vector(mem.model, prelude_ids + q_ids, docs.key_layer, g.kv_heads, g.head_dim)
    else:
        qv = docs.embedder.embed([question])[0]
    live = docs.live_map()
    hits = [(r, s) for r, s in idx.search(qv, 4 * top_k) if r in live][:top_k]
    select_s = time.perf_counter() - t
    meta = store.block_meta([r for r, _ in hits])
    doc_start = _doc_starts(store, [r for r, _ in hits])
    cands = [Candidate(row=r, doc_id=live[r][0], doc_rank=live[r][1], doc_start=doc_start[r],
                       n_tokens=int(meta["n_tokens"][i]), deposit_pos=int(meta["positions"][i][0]), score=s)
             for i, (r, s) in enumerate(hits)]
    window = plan(cands, len(prelude_ids), len(q_ids), max_new_tokens, mem.geometry.max_positions, top_k)
    # ---- page in and graft
    if mem.model.device.type == "cuda":      # decode attention through the paged-window kernel
        from kvmemory.ops import use_window_attention
        use_window_attention(mem.model)
    t = time.perf_counter()
    prelude = docs.prelude_kv()
    cache, fetch = build_window(mem, docs, window, prelude)
    graft_s = time.perf_counter() - t
    # ---- answer
    t = time.perf_counter()
    out = mem.model(input_ids=torch.tensor([q_ids], device=mem.model.device), past_key_values=cache, use_cache=True)
    nxt = int(out.logits[0, -1].argmax())
    first_token_s = time.perf_counter() - t
    ttft = time.perf_counter() - t0
    eos = _eos_ids(mem.tokenizer, mem.model)
    new: list[int] = []
    t = time.perf_counter()
    while nxt not in eos:
        new.append(nxt)
        if len(new) == max_new_tokens:       # no forward pass for a token we would not use
            break
        out = mem.model(input_ids=torch.tensor([[nxt]], device=mem.model.device), past_key_values=cache,
                        use_cache=True)
        nxt = int(out.logits[0, -1].argmax())
    decode_s = time.perf_counter() - t
    sources = [(s.candidate.doc_id, s.candidate.doc_start, s.candidate.doc_start + s.candidate.n_tokens,
                s.candidate.score) for s in window.slots]
    stats = {
        "selector": selector, "window_tokens": window.context_tokens + len(q_ids) + len(new),
        "tokens_restored": window.context_tokens, "tokens_prefilled": len(q_ids), "tokens_decoded": len(new),
        "blocks": len(window.slots), "exact_slots": window.exact_slots,
        "rerotated_slots": len(window.slots) - window.exact_slots,
        "bytes_read": {"disk": fetch.disk_bytes, "host": fetch.host_bytes},
        "blocks_from": {"gpu": fetch.from_gpu, "host": fetch.from_host, "disk": fetch.from_disk},
        "tiers": fetch.tiers,
        "timings_s": {"select": select_s, "page_in_and_graft": graft_s, "disk_read": fetch.disk_s,
                      "first_token": first_token_s, "ttft": ttft, "decode": decode_s,
                      "total": time.perf_counter() - t0},
        "store_tokens": sum(d.n_tokens for d in manifest.docs.values()),
    }
    return Answer(mem.tokenizer.decode(new, skip_special_tokens=True).strip(), sources, stats)


def _doc_starts(store, rows: list[int]) -> dict[int, int]:
    """Token offset of each row within its document (a document's rows are in document order)."""
    want, out = set(rows), {}
    for d in store.manifest.docs.values():
        if want.isdisjoint(d.rows):
            continue
        starts = np.concatenate([[0], np.cumsum(store.block_meta(d.rows)["n_tokens"])[:-1]])
        out.update({r: int(s) for r, s in zip(d.rows, starts) if r in want})
    return out
