"""window_attention: decode attention of a few query tokens over a paged KV window (GQA).

    q          [nq, Hq, D]               queries of the newest nq tokens
    k_pages    [P, Hkv, page, D]         key pages (any strides: a view into a block pool works)
    v_pages    [P, Hkv, page, D]         value pages, same strides as k_pages
    table      [num_pages] int32         page of each window page, in window order
    seq_len    int                       window tokens including the nq new ones
    returns    [nq, Hq, D]               query token i attends to positions 0 .. seq_len - nq + i

The reference gathers the pages and computes softmax(q k^T * scale) v in float32. The CUDA
kernel (cuda/window_attention.cu) is held to it with assert_close: float32 atol/rtol 1e-5,
float16 2e-3, bfloat16 1.6e-2 (tests/ops/test_window_attention.py).
`use_window_attention(model)` makes the model's own forward call this op through
transformers' attention-function registry.
"""

from __future__ import annotations

import math

import torch

ATTN_NAME = "kvmemory_window"


def _gather(pages: torch.Tensor, table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """[P, Hkv, page, D] pages in table order -> [Hkv, seq_len, D]."""
    g = pages[table.long()]                                   # [np, Hkv, page, D]
    return g.permute(1, 0, 2, 3).reshape(g.shape[1], -1, g.shape[3])[:, :seq_len]


def window_attention_ref(q, k_pages, v_pages, table, seq_len: int, scale: float | None = None) -> torch.Tensor:
    nq, Hq, D = q.shape
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    k = _gather(k_pages, table, seq_len).float()
    v = _gather(v_pages, table, seq_len).float()
    g = Hq // k.shape[0]
    k = k.repeat_interleave(g, dim=0)                         # [Hq, T, D]
    v = v.repeat_interleave(g, dim=0)
    s = torch.einsum("ihd,htd->hit", q.float(), k) * scale    # [Hq, nq, T]
    pos = torch.arange(seq_len, device=q.device)
    limit = seq_len - nq + torch.arange(nq, device=q.device)
    s = s.masked_fill(pos[None, None, :] > limit[None, :, None], float("-inf"))
    out = torch.einsum("hit,htd->ihd", s.softmax(dim=-1), v)
    return out.to(q.dtype)


def window_attention(q, k_pages, v_pages, table, seq_len: int, scale: float | None = None) -> torch.Tensor:
    """Dispatch: the CUDA kernel for CUDA tensors when it is built, otherwise the reference."""
    if q.is_cuda and k_pages.stride() == v_pages.stride() and q.shape[-1] % 32 == 0 and q.shape[-1] <= 256:
        from kvmemory.ops import cuda_ext
        kernels = cuda_ext.load()
        if kernels is not None:
            D = q.shape[-1]
            out = torch.empty_like(q)
            sp, sh, st, sd = k_pages.stride()
            if sd == 1:
                kernels.window_attention(q.contiguous(), k_pages, v_pages, (sp, sh, st, k_pages.shape[1]),
                                         table.to(torch.int32).contiguous(), k_pages.shape[2], seq_len,
                                         1.0 / math.sqrt(D) if scale is None else scale, out)
                return out
    return window_attention_ref(q, k_pages, v_pages, table, seq_len, scale)


def _attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                       **kwargs):
    """transformers attention function: decode steps on CUDA go through window_attention.

    query [B, Hq, q, D], key/value [B, Hkv, T, D] (the cache after update). Batch 1, up to 16
    query tokens, on CUDA: the op, with the contiguous cache as one page of T tokens. Anything
    else goes to transformers' SDPA path unchanged (on the CPU that is every call).
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    B, Hq, q_len, D = query.shape
    if query.is_cuda and B == 1 and q_len <= 16 and dropout == 0.0 and key.stride() == value.stride():
        T = key.shape[2]
        table = torch.zeros(1, device=query.device, dtype=torch.int32)
        out = window_attention(query[0].transpose(0, 1), key[0].unsqueeze(0), value[0].unsqueeze(0), table, T,
                               scaling)                                            # [q, Hq, D]
        return out.unsqueeze(0), None
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  is_causal=is_causal, **kwargs)


def register() -> str:
    """Register the attention function with transformers under ATTN_NAME; returns the name."""
    from transformers import AttentionInterface
    AttentionInterface.register(ATTN_NAME, _attention_forward)
    return ATTN_NAME


def plain_attention(model) -> bool:
    """Whether the paged-window kernel computes this model's attention: every layer global, no soft-capping
    of scores (a sliding-window or soft-capping model decodes with its own attention)."""
    from kvmemory.kv import sliding
    return not sliding(model.config) and not getattr(model.config, "attn_logit_softcapping", None)


def use_window_attention(model) -> None:
    """Make `model` attend through window_attention (kernel on CUDA, SDPA otherwise)."""
    model.set_attn_implementation(register())
