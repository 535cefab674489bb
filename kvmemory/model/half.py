"""A half-precision model's attention on CPU, computed in float32.

PyTorch's CPU attention kernel (scaled_dot_product_attention) is slow for bfloat16 queries of
one row, which is every decode step: on the 2-core EPYC with AVX-512 BF16 (2026-12-04) a step's
attention of one query over 300 keys (the default model's 9 query and 3 KV heads of 64) takes 111
us in bf16 and 16 us in fp32, over 1,000 keys 409 against 44 us, 30 times a token. With chunks of
many queries both dtypes take the same time (a 256-query chunk: 918 and 901 us). So a bf16 (or
fp16) model on CPU gets this attention instead: its queries, keys and values (bf16 numbers, each
exact in fp32) go through the float32 kernel and the result is rounded to the model's dtype once.
Prefill costs the same, a decode step's attention 4-6x less, and no bf16 rounding of scores or
weights happens in between.

It is part of what a half-precision model computes, so it is in the fingerprint
(kvmemory/model/fingerprint.py) and the store's header (`attention`): a bf16 store made before
it (2026-12-04) has other bytes and does not open (the error says so). The invariant mode's
attention (kvmemory/model/invariant.py) replaces it where that mode is on; on a GPU the model's
own attention runs (its bf16 kernels are fast).
"""

from __future__ import annotations

import torch

NAME = "kvmemory_half_f32"
MODE = "float32-v1"              # the fingerprint's and the header's name for this attention
HALF = (torch.bfloat16, torch.float16)


def attention(module, query, key, value, attention_mask=None, **kwargs):
    """transformers' SDPA attention over float32 copies of query, key and value (and of a float
    mask); the output [B, Lq, Hq, D] rounded back to the query's dtype."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if attention_mask is not None and attention_mask.is_floating_point():
        attention_mask = attention_mask.float()
    out, weights = sdpa_attention_forward(module, query.float(), key.float(), value.float(), attention_mask,
                                          **kwargs)
    return out.to(query.dtype), weights


def sdpa32(query32, key, value, mask, scale: float) -> torch.Tensor:
    """The same computation for forward_many's loop (kvmemory/batching.py), which converts a
    step's queries to float32 at once and rounds the output once: query32 [1, Hq, T, D] (float32),
    key/value [1, Hkv, L, D] (heads shared in the kernel); -> [1, T, Hq, D] in float32."""
    out = torch.nn.functional.scaled_dot_product_attention(query32, key.float(), value.float(),
                                                           attn_mask=mask, scale=scale, enable_gqa=True)
    return out.transpose(1, 2)


def on_cpu(model) -> bool:
    """A half-precision (bfloat16, float16) model on CPU."""
    p = next(model.parameters(), None)
    return p is not None and p.dtype in HALF and p.device.type == "cpu"


def wanted(model) -> bool:
    """A half-precision model on CPU with transformers' SDPA attention (what install replaces)."""
    return on_cpu(model) and getattr(model.config, "_attn_implementation", None) in ("sdpa", NAME)


def set_attention(model, name: str) -> None:
    """The model's attention implementation set to `name` (an AttentionInterface function), on its
    config and on every sub-module's config (the layers read it from their own)."""
    model.config._attn_implementation = name
    for mod in model.modules():
        cfg = getattr(mod, "config", None)
        if cfg is not None and cfg is not model.config:
            cfg._attn_implementation = name


def install(model) -> None:
    """This attention for `model`, in place (idempotent); nothing where `wanted` is false."""
    if not wanted(model) or installed(model):
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    AttentionInterface.register(NAME, attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)   # the masks SDPA's take (without, none would be built)
    set_attention(model, NAME)


def installed(model) -> bool:
    return getattr(model.config, "_attn_implementation", None) == NAME


def mode(model) -> str | None:
    """What the fingerprint and a store's header record of this attention: MODE where it is
    installed, None where the model computes its own."""
    return MODE if installed(model) else None
