"""Selective recompute of a grafted window (CacheBlend-style, training-free).

Grafted blocks were computed in their own segment's context: their deeper-layer K/V do not
encode the other blocks now beside them in the window. Re-prefilling the whole window fixes
that at full cost. Selective recompute recomputes only the tokens whose K/V deviate most:

  1. the window's tokens that are not already exact (everything after the leading run of
     blocks grafted at their deposit positions behind their own context) and the question
     run through the first `check_layer + 1` layers in full, attending to the whole window;
  2. at `check_layer`, each such context token's K/V deviation (recomputed vs grafted,
     squared error over heads) is measured, and the fraction `r` of the window's context
     tokens that deviate most is kept (at most all the non-exact ones);
  3. from then on only the kept tokens and the question go through the layers; everyone
     else keeps its grafted K/V, which the kept tokens' new K/V overwrite in place.

r = 1.0 recomputes every token at every layer: the window's text re-prefilled in one pass.
`always` (EPIC-style seams, Hu et al. 2024) names context tokens recomputed at every layer
whatever their deviation: the first tokens of each grafted run, where it meets a window it
was not computed in. With r == 0 only they (and the question) are recomputed, and nothing is
measured.
The model's own decoder layers do the work (through a cache object that writes the K/V of
the tokens in flight at their window positions), under one causal mask and one rotary embedding:
so a model whose forward adds something around its layers (Granite's multipliers, Gemma 2's final
soft-cap) or whose layers differ in mask or RoPE (sliding windows, Gemma 3's two bases) is refused
(`supported`), never blended wrongly. tests/model/test_conformance.py holds every family's blend at
r = 1 to a fresh prefill of the same text.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvmemory.model import half


@dataclass(frozen=True)
class BlendStats:
    recomputed: int              # context tokens whose K/V were recomputed at every layer
    checked: int                 # context tokens run through the first layers to measure deviation
    context: int                 # context tokens in the window


class _WindowKV:
    """Stands in for a transformers Cache inside the decoder layers: `update` writes the K/V of
    the tokens in flight (window positions `pos`) into the window buffer and returns the whole
    window's K/V for attention."""

    def __init__(self, buf: torch.Tensor) -> None:
        self.buf = buf                       # [L, 2, H, N, D]
        self.pos: torch.Tensor | None = None
        self.deviation: torch.Tensor | None = None
        self.measure_layer = -1

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        k, v = key_states[0], value_states[0]                          # [H, n, D]
        if layer_idx == self.measure_layer:
            old = self.buf[layer_idx, :, :, self.pos]                  # [2, H, n, D]
            self.deviation = ((k - old[0]).float().pow(2).sum((0, 2)) + (v - old[1]).float().pow(2).sum((0, 2)))
        self.buf[layer_idx, 0, :, self.pos] = k
        self.buf[layer_idx, 1, :, self.pos] = v
        return self.buf[layer_idx, 0].unsqueeze(0), self.buf[layer_idx, 1].unsqueeze(0)


def _mask(q_pos: torch.Tensor, n: int, dtype, device) -> torch.Tensor:
    """Additive causal mask [1, 1, len(q_pos), n]: query at window position p sees keys 0..p."""
    keys = torch.arange(n, device=device)
    m = torch.zeros((len(q_pos), n), dtype=dtype, device=device)
    m.masked_fill_(keys.unsqueeze(0) > q_pos.unsqueeze(1), torch.finfo(dtype).min)
    return m[None, None]


def supported(model) -> str | None:
    """Why the blend cannot reproduce this model's forward, or None where it can."""
    from kvmemory.kv import sliding
    cfg = model.config
    if sliding(cfg):
        return "its local layers attend through a sliding window (the blend applies one causal mask)"
    for name in ("final_logit_softcapping", "attn_logit_softcapping"):
        if getattr(cfg, name, None):
            return f"it soft-caps its {'logits' if name.startswith('final') else 'attention scores'}"
    for name in ("embedding_multiplier", "logits_scaling"):
        if getattr(cfg, name, 1.0) not in (None, 1.0):
            return f"its forward scales around its layers ({name})"
    if not hasattr(getattr(model, "model", None), "rotary_emb") or not hasattr(model.model, "embed_tokens"):
        return "its decoder has no single rotary embedding and token embedding the blend can run"
    return None


@torch.inference_mode()
def blend_prefill(model, ctx_kv: torch.Tensor, ctx_ids: list[int], q_ids: list[int], r: float,
                  exact_tokens: int = 0, check_layer: int = 1,
                  always=()) -> tuple[torch.Tensor, torch.Tensor, BlendStats]:
    """Prefill the question over a grafted window, recomputing a fraction r of its context
    (those that deviate most) and every context position in `always` (at or after exact_tokens).

    ctx_kv: [L, 2, H, W, D], the window's grafted K/V (prelude + blocks), W == len(ctx_ids).
    exact_tokens: the leading tokens whose K/V are already exact (never recomputed unless r == 1).
    Returns (logits of the last question token [vocab], the window's K/V with the question
    [L, 2, H, W + Q, D], stats).
    """
    why = supported(model)
    if why is not None:
        from kvmemory.errors import InputError
        raise InputError(f"recomputing grafted tokens (recompute, seam) is not available for "
                         f"{type(model).__name__}: {why}; use recompute=0")
    L, _, H, W, D = ctx_kv.shape
    always = sorted(set(int(a) for a in always))
    if not 0.0 <= r <= 1.0 or (r == 0 and not always):
        raise ValueError(f"r must be in (0, 1], or 0 with positions in `always`, got {r}")
    if W != len(ctx_ids):
        raise ValueError(f"{W} context K/V positions for {len(ctx_ids)} context tokens")
    if always and not exact_tokens <= always[0] <= always[-1] < W:
        raise ValueError(f"`always` positions must lie in [exact_tokens={exact_tokens}, {W}), got "
                         f"{always[0]}..{always[-1]}")
    dev = ctx_kv.device
    Q = len(q_ids)
    buf = torch.empty((L, 2, H, W + Q, D), dtype=ctx_kv.dtype, device=dev)
    buf[:, :, :, :W] = ctx_kv
    ids = torch.tensor(ctx_ids + q_ids, device=dev)
    question = torch.arange(W, W + Q, device=dev)
    forced = torch.zeros(0, dtype=torch.bool, device=dev)
    if r >= 1.0:
        cand = torch.arange(0, W, device=dev)
        check_layer = -1                     # every token, every layer: no measuring needed
    elif r == 0:
        cand = torch.tensor(always, dtype=torch.long, device=dev)
        check_layer = -1                     # the seams alone: nothing to measure
    else:
        cand = torch.arange(min(exact_tokens, W), W, device=dev)
        forced = torch.isin(cand, torch.tensor(always, dtype=torch.long, device=dev))
    keep_n = min(len(cand), int(round(r * W)) + int(forced.sum()))
    inner = model.model
    cache = _WindowKV(buf)
    pos = torch.cat([cand, question])
    # the tokens in flight sit at scattered positions: attention must honour the mask, which
    # transformers' SDPA path does and a decode kernel registered for plain steps may not
    prev_attn = model.config._attn_implementation
    if prev_attn not in ("sdpa", "eager", half.NAME):
        model.set_attn_implementation("sdpa")
    try:
        h = inner.embed_tokens(ids[pos].unsqueeze(0))                  # [1, n, hidden]
        for i, layer in enumerate(inner.layers[: model.config.num_hidden_layers]):
            if i == check_layer + 1 and check_layer >= 0:
                # keep the context tokens that deviate most, and every question token
                dev_ctx = cache.deviation[: len(cand)].masked_fill(forced, float("inf"))   # seams stay
                top = (torch.topk(dev_ctx, keep_n).indices.sort().values if keep_n
                       else torch.zeros(0, dtype=torch.long, device=dev))
                sel = torch.cat([top, torch.arange(len(cand), len(pos), device=dev)])
                pos, h = pos[sel], h[:, sel]
            cache.pos = pos
            cache.measure_layer = check_layer if i == check_layer else -1
            pos_ids = pos.unsqueeze(0)
            pe = inner.rotary_emb(h, position_ids=pos_ids)
            h = layer(h, attention_mask=_mask(pos, W + Q, h.dtype, dev), position_ids=pos_ids,
                      past_key_values=cache, use_cache=True, position_embeddings=pe)
    finally:
        if prev_attn != model.config._attn_implementation:
            model.set_attn_implementation(prev_attn)
    logits = model.lm_head(inner.norm(h[:, -1:]))[0, -1]
    recomputed = len(cand) if check_layer < 0 else keep_n
    return logits, buf, BlendStats(recomputed=recomputed, checked=len(cand), context=W)
