"""The model fingerprint and KV geometry.

The fingerprint hashes everything that determines KV bytes: the architecture config, every
weight tensor's bytes, the dtype, the RoPE parameters and the KV layout version. It uses
xxh3-128 (540 MB of fp32 weights hash in ~0.1 s); it detects accidental mismatch, it is not
meant to resist someone crafting colliding weights.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import xxhash

from kvmemory.errors import ModelLoadError

KV_LAYOUT_VERSION = 1  # bump when the bytes we store for a given model change meaning
# config keys that do not affect KV bytes and vary between save/load round trips
_VOLATILE = {"_name_or_path", "name_or_path", "transformers_version", "quantization_config", "architectures",
             "use_cache", "dtype", "torch_dtype", "_commit_hash", "_attn_implementation_autoset",
             "output_attentions", "output_hidden_states", "return_dict", "generation_config"}


@dataclass(frozen=True)
class KVGeometry:
    layers: int
    kv_heads: int
    head_dim: int
    max_positions: int
    dtype: str            # "float32", "bfloat16", "float16"
    rope: dict

    @property
    def bytes_per_token(self) -> int:
        itemsize = 4 if self.dtype == "float32" else 2
        return self.layers * 2 * self.kv_heads * self.head_dim * itemsize


def _dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def geometry(model) -> KVGeometry:
    from kvmemory.model import families
    families.check(model.config)
    cfg = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
    rope = getattr(cfg, "rope_parameters", None) or {"rope_theta": getattr(cfg, "rope_theta", None)}
    if not rope:                                  # (families.check refused a model without RoPE above)
        raise ModelLoadError(f"{type(model).__name__} has no RoPE parameters; kvmemory needs a RoPE causal LM")
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    dtype = _dtype_name(next(model.parameters()).dtype)
    if dtype not in ("float32", "bfloat16", "float16"):
        raise ModelLoadError(f"model dtype {dtype} is not supported (float32, bfloat16, float16)")
    return KVGeometry(layers=cfg.num_hidden_layers,
                      kv_heads=getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads,
                      head_dim=head_dim, max_positions=cfg.max_position_embeddings, dtype=dtype,
                      rope=dict(rope))


def fingerprint(model) -> str:
    """'kvm1-' + 32 hex digits naming (config, weights' bytes, dtype, RoPE, KV layout version, and
    the kernels where they are not the default: invariant mode computes other bytes, and so does a
    half-precision model's float32 attention, kvmemory/model/half.py)."""
    import torch

    from kvmemory.model import half, invariant
    geo = geometry(model)
    cfg = {k: v for k, v in model.config.to_dict().items() if k not in _VOLATILE}
    named = {"config": cfg, "dtype": geo.dtype, "rope": geo.rope, "layout": KV_LAYOUT_VERSION}
    if invariant.installed(model):
        named["kernels"] = invariant.kernels(model)   # (absent for the default: their stores keep their fingerprints)
    if (attention := half.mode(model)) is not None:
        named["attention"] = attention
    h = xxhash.xxh3_128()
    h.update(json.dumps(named, sort_keys=True, default=str).encode())
    for name, t in sorted(model.state_dict().items()):
        t = t.detach().contiguous().cpu()
        h.update(f"{name}|{_dtype_name(t.dtype)}|{tuple(t.shape)}".encode())
        h.update(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
    return f"kvm{KV_LAYOUT_VERSION}-{h.hexdigest()}"


def with_prefill(fp: str, prefill_tokens: int, block_tokens: int) -> str:
    """The fingerprint of a store whose canonical prefill runs in forwards of prefill_tokens (a
    divisor of block_tokens, the block's own size being the default): its blocks' bytes differ
    from one-forward-a-block blocks, so their ids do too, and a kvmemory that does not know the
    setting refuses the store (a fingerprint it does not compute) instead of writing blocks the
    other way."""
    if prefill_tokens in (0, block_tokens):
        return fp
    h = xxhash.xxh3_128(f"{fp}|prefill_tokens={prefill_tokens}".encode())
    return f"kvm{KV_LAYOUT_VERSION}-{h.hexdigest()}"
