"""Grafting: the one place a window is assembled from stored blocks (ask, rerank, chat memory, the
library all come through here).

    stored rows (with the blocks before them in their segment: candidates)
      -> pieces: which tokens of which block go where, and their RoPE shift
      -> assemble: the pager's verified blocks copied behind a head (prelude or a restored prefix),
         keys re-rotated where the slot differs from the deposit position (ops.gather_blocks: the
         CUDA kernel on a GPU, its torch reference elsewhere; a zero shift is a byte copy)
      -> prefill_tail: the tokens after the window (a question, a new message, a problem) prefilled
         over it, or a fraction of the grafted tokens recomputed with them (blend.py): a cache and
         the logits of the last token

Every shift comes from stored positions that were verified first (StoreCorruptError otherwise).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kvmemory import batching, kv as kvops
from kvmemory.device import ids_tensor, to_model
from kvmemory.ops import gather_blocks
from kvmemory.pager.pager import FetchStats
from kvmemory.runtime import Runtime
from kvmemory.window import Candidate, WindowPlan


@dataclass(frozen=True)
class Piece:
    """Tokens [skip, skip + n) of the stored block `row`, placed at window offset `at`, keys rotated by
    `shift` (window position - the position they were computed at; 0: a byte copy)."""
    row: int
    n: int
    at: int
    shift: int
    skip: int = 0


def _longs(xs) -> torch.Tensor:
    return torch.tensor(list(xs), dtype=torch.long)


def assemble(rt: Runtime, head_kv: torch.Tensor, pieces: Sequence[Piece], room: int = 0
             ) -> tuple[torch.Tensor, FetchStats]:
    """head_kv [L, 2, H, P, D] followed by the pieces: -> (kv [L, 2, H, T + room, D], what the pager
    read from where). T is the end of the last piece (P when there is none); the `room` tokens after
    it are allocated, left unwritten. On the pager's device when there are pieces."""
    rows = [p.row for p in pieces]
    pager = rt.pager if rows else None
    pool, fetch = pager.fetch(rows, stacked=pager.device.type == "cuda") if pager is not None else (None, FetchStats())
    dev = pager.device if pager is not None else head_kv.device
    L, _, H, P, D = head_kv.shape
    T = max([P] + [p.at + p.n for p in pieces])
    out = torch.empty((L, 2, H, T + room, D), dtype=rt.kv_dtype, device=dev)
    out[:, :, :, :P] = head_kv.to(dev)
    whole = [i for i, p in enumerate(pieces) if not p.skip]
    if whole:
        gather_blocks(pool, _longs(whole), _longs(pieces[i].n for i in whole), _longs(pieces[i].at for i in whole),
                      _longs(pieces[i].shift for i in whole), out, rt.freqs)
    for i, p in enumerate(pieces):
        if p.skip:                       # a block entered mid-way: gathered whole, its tail kept
            part = torch.empty((L, 2, H, p.skip + p.n, D), dtype=rt.kv_dtype, device=dev)
            gather_blocks(pool, _longs([i]), _longs([p.skip + p.n]), _longs([0]), _longs([p.shift]), part, rt.freqs)
            out[:, :, :, p.at:p.at + p.n] = part[:, :, :, p.skip:]
    return out, fetch


def plan_pieces(window: WindowPlan) -> list[Piece]:
    """The pieces of a planned window (ask, rerank): each slot's block whole at its offset."""
    return [Piece(s.candidate.row, s.candidate.n_tokens, s.offset, s.shift) for s in window.slots]


def window_kv(rt: Runtime, window: WindowPlan, prelude_kv: torch.Tensor, room: int = 0
              ) -> tuple[torch.Tensor, FetchStats]:
    """The window's KV [L, 2, H, context_tokens + room, D]: prelude, then every slot."""
    return assemble(rt, prelude_kv, plan_pieces(window), room)


def after(rt: Runtime, prefix_kv: torch.Tensor, rows: list[int]) -> tuple[torch.Tensor, int, int]:
    """prefix_kv [L, 2, H, P, D] followed by the blocks `rows` in this order, each re-rotated to follow
    the one before: -> (kv [L, 2, H, P + T, D], tokens grafted T, tokens re-rotated)."""
    if not rows:
        return prefix_kv, 0, 0
    meta = rt.store().verified_meta(rows)        # RoPE shifts come from stored positions: trust them verified
    pieces, at = [], prefix_kv.shape[3]
    for i, r in enumerate(rows):
        n = int(meta["n_tokens"][i])
        pieces.append(Piece(r, n, at, at - int(meta["positions"][i][0])))
        at += n
    kv, _ = assemble(rt, prefix_kv, pieces)
    return kv, at - prefix_kv.shape[3], sum(p.n for p in pieces if p.shift)


def chain_pieces(rows: list[int], n_tokens: list[int], block_tokens: int, start: int, at: int) -> list[Piece]:
    """The pieces of a stored chain (a state's blocks `rows`, from position 0) from its token `start`
    on, placed at window offset `at` (shift at - start)."""
    out, pos = [], 0
    for r, n in zip(rows, n_tokens):
        if pos + n > start:
            skip = max(0, start - pos)
            out.append(Piece(r, n - skip, at + pos + skip - start, at - start, skip))
        pos += block_tokens
    return out


def view_cache(rt: Runtime, buf: torch.Tensor, n: int):
    """A cache whose layers view buf[:, :, :, :n] (no copy), with the rest of buf [L, 2, H, n + room, D]
    as its room: the next tokens' KV is written there in place (batching.room_of)."""
    cache = kvops.make_cache(buf[:, :, :, :n], rt.model.config, copy=False)
    batching.room_of(cache, buf)
    return cache


@dataclass
class Tail:
    cache: object                  # a transformers Cache holding the window and the tail
    logits: torch.Tensor | None    # [vocab] of the tail's last token (None: `feed`)
    recomputed: int = 0            # grafted tokens recomputed (blend)
    feed: list[int] | None = None  # served in a batch: the tail's tokens are the decode loop's first rows


def prefill_tail(rt: Runtime, kv: torch.Tensor | None, tail: list[int], *, recompute: float = 0.0,
                 ctx_ids: Callable[[], list[int]] | None = None, exact_tokens: int = 0, seams: Sequence[int] = (),
                 copy: bool = True, buffer: torch.Tensor | None = None, chunked: bool = False,
                 batched: bool = False) -> Tail:
    """The tokens `tail` after a grafted window kv [L, 2, H, W, D] (None: no window).

    recompute > 0 or seams: the fraction `recompute` of the window's tokens that deviate most, and
    every position in `seams`, recomputed with the tail (kvmemory/blend.py; ctx_ids() gives the
    window's W tokens; the first exact_tokens are exact already). Otherwise the tail is prefilled
    over the window as it stands: copy=False lets the cache view kv (a fresh tensor of the caller's),
    buffer (kv's storage with room after it) is where a batched step writes next (batching.room_of);
    chunked prefills the tail the canonical way (block by block, kv.prefill_blocks) instead of in
    one pass; batched hands the tail to the batch this thread is served in, if any (Tail.feed)."""
    model = rt.model
    if recompute > 0 or seams:
        from kvmemory.blend import blend_prefill
        assert kv is not None and ctx_ids is not None, "a blend needs the window and its tokens"
        logits, out, bs = blend_prefill(model, to_model(kv, model), ctx_ids(), tail, float(recompute),
                                        exact_tokens=exact_tokens, always=seams)
        return Tail(kvops.make_cache(out, model.config), logits, bs.recomputed)
    cache = kvops.make_cache(None if kv is None else to_model(kv, model), model.config, copy=copy)
    if buffer is not None:
        batching.room_of(cache, buffer)
    if batched:
        batcher = batching.current()
        if batcher is not None and batcher.model is model:
            # served with others: the tail's tokens are this sequence's rows of the decode loop's next
            # step (greedy's feed), not a pass over the weights of their own
            return Tail(cache, None, feed=list(tail))
    if chunked:
        last = None
        start = 0 if kv is None else kv.shape[3]
        for _, _, last in kvops.prefill_blocks(model, tail, rt.block_tokens, cache, start, rt.prefill_tokens):
            pass
        return Tail(cache, last)
    return Tail(cache, kvops.last_logits(model, ids_tensor(tail, model), cache))


def prefill_rows(rt: Runtime, prefix_kv: torch.Tensor, rows: list[int], tail: list[int]) -> tuple[Tail, int]:
    """prefix_kv [L, 2, H, P, D], then the tokens of the blocks `rows` and `tail`, prefilled: every one of
    the blocks' tokens recomputed after the prefix (a blend's r = 1, computed the plain way), their stored
    KV not read. Their tokens are read verified (their ids re-derive from them). -> (Tail, tokens of rows)."""
    ids = rt.store().token_ids(rows, verified=True) if rows else []
    return prefill_tail(rt, prefix_kv if prefix_kv.shape[3] else None, ids + list(tail)), len(ids)


def candidates(rt: Runtime, docs, chosen, expand: bool) -> tuple[list[Candidate], dict[int, list[Candidate]]]:
    """Window candidates of the chosen blocks (retrieve.Ranked), and (expand) each one's segment
    prefix: the blocks before it in its deposit segment, in document order."""
    store, live = rt.store(), docs.live_map()
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


def window_tokens(store, window: WindowPlan) -> list[int]:
    """Token ids of the window's slots, in window order."""
    meta = store.block_meta([s.candidate.row for s in window.slots])
    out: list[int] = []
    for i, s in enumerate(window.slots):
        out += [int(x) for x in meta["tokens"][i][: s.candidate.n_tokens]]
    return out
