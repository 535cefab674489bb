"""Recall as KV: the window of a chat request with memory is

    [the session's prompt so far: restored exactly] [recalled turns: grafted, re-rotated] [the new message]

The session prefix is the conversation's own stored state (bit-exact, as without memory); the
recalled turns' blocks are read verified and their keys re-rotated (RoPE) from the positions they
were deposited at to the slots after the prefix; only the new message is prefilled. The reply and
the next turn's prefix do not depend on what was recalled: the conversation is saved without it."""

from __future__ import annotations

import torch

from kvmemory.ops import gather_blocks


def graft_after(mem, prefix_kv: torch.Tensor, rows: list[int], freqs: torch.Tensor):
    """prefix_kv [L, 2, H, P, D] followed by the blocks `rows` (in this order), each re-rotated to its
    slot: -> (kv [L, 2, H, P + T, D], tokens grafted T, tokens re-rotated, fetch stats)."""
    store = mem.require_store()
    P = prefix_kv.shape[3]
    if not rows:
        return prefix_kv, 0, 0, None
    meta = store.verified_meta(rows)             # RoPE shifts come from stored positions: trust them verified
    n = [int(x) for x in meta["n_tokens"]]
    offsets, at = [], P
    for k in n:
        offsets.append(at)
        at += k
    shifts = [off - int(meta["positions"][i][0]) for i, off in enumerate(offsets)]
    pool, fetch = mem.pager.fetch(rows)          # [k, L, 2, H, C, D], digest-checked
    L, _, H, _, D = prefix_kv.shape
    out = torch.empty((L, 2, H, at, D), dtype=mem.kv_dtype, device=pool.device)
    out[:, :, :, :P] = prefix_kv.to(out.device)
    t = lambda xs: torch.tensor(xs, dtype=torch.long)      # noqa: E731
    gather_blocks(pool, t(list(range(len(rows)))), t(n), t(offsets), t(shifts), out, freqs)
    return out, at - P, sum(k for k, s in zip(n, shifts) if s), fetch
