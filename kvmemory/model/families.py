"""Which models the engine keeps exact, and the reason it refuses the others.

kvmemory restores a model's KV cache byte for byte and re-rotates stored keys to new positions
(kvmemory/rope.py). That holds for a decoder-only transformer whose every layer is attention over
the whole context with RoPE whose angle is linear in the position. Refused, each with its reason
(ModelLoadError), from the configuration alone, before any weight is read:

- encoder-decoders (the decoder's cache depends on an encoder pass over other input);
- positions other than RoPE (learned or ALiBi positions: a stored key cannot be moved);
- RoPE whose frequencies depend on the sequence length: "dynamic" NTK scaling, and "longrope"
  where the model's window reaches past its original window (the long factors then replace the
  short ones mid-sequence);
- recurrent or hybrid layers (Mamba, gated delta nets, linear attention, short convolutions):
  their state is not a per-token KV cache; their exact persistence is a later step;

Sliding-window attention and local/global layers (Mistral v0.1, Gemma 2 and 3) are kept exact:
kvmemory's caches hold every token in every layer (kvmemory.kv.new_cache) and the model's own mask
applies each local layer's window, so a token after a graft attends in each local layer to exactly
the tokens the canonical computation gives it; layers of different types may rotate with different
RoPE frequencies (kvmemory.rope.inv_freq gives one set per layer). A local layer's KV older than its
window is stored too (it is never attended to by later tokens: the bytes a local layer could save are
measured by benchmarks/bench_models.py, not saved yet).

The tested families (tests/model/test_conformance.py, the README's support matrix) are in
FAMILIES.
"""

from __future__ import annotations

from pathlib import Path

from kvmemory.errors import ModelLoadError

# model_type -> what the conformance suite builds (tests/model/families.py holds them to this list)
FAMILIES = {
    "llama": "Llama 2 / SmolLM2 (the default model)",
    "llama3": "Llama 3.x (llama3 RoPE scaling)",
    "qwen2": "Qwen2 / Qwen2.5",
    "qwen3": "Qwen3 (QK-norm)",
    "qwen3_moe": "Qwen3-MoE (QK-norm, mixture of experts)",
    "mistral": "Mistral without a sliding window (v0.2+)",
    "phi3": "Phi-3 (fused QKV and gate-up projections)",
    "olmo2": "OLMo 2 (QK-norm, norms after attention and MLP)",
    "granite": "Granite (embedding, residual, attention and logit multipliers)",
    "gemma": "Gemma (scaled embeddings, GeGLU, 1 + w RMSNorm)",
    "olmo": "OLMo (non-parametric layer norm)",
    "stablelm": "StableLM (partial rotary, LayerNorm)",
    "mistral_sliding": "Mistral with a sliding window (v0.1)",
    "gemma2": "Gemma 2 (local/global layers, attention and logit soft-capping)",
    "gemma3_text": "Gemma 3 (five local layers to one global, two RoPE bases, QK-norm)",
}

# model types whose layers hold a recurrent or convolutional state, not only attention KV
HYBRID = {"mamba", "mamba2", "jamba", "bamba", "zamba", "zamba2", "falcon_mamba", "falcon_h1", "granitemoehybrid",
          "qwen3_next", "lfm2", "lfm2_moe", "nemotron_h", "plamo2", "recurrent_gemma", "rwkv", "xlstm", "minimax",
          "olmo3_5_hybrid", "kimi_linear", "qwen3_5", "qwen3_5_moe"}
ATTENTION_LAYERS = {"full_attention", "attention", "global_attention"}
SLIDING_LAYERS = {"sliding_attention", "sliding_window_attention", "local_attention", "chunked_attention"}


def refusal(cfg) -> str | None:
    """Why the engine cannot keep a model of configuration `cfg` exact, or None where it can."""
    kind = getattr(cfg, "model_type", "") or ""
    if getattr(cfg, "is_encoder_decoder", False):
        return f"{kind} is an encoder-decoder; kvmemory keeps the cache of decoder-only models"
    if hasattr(cfg, "get_text_config"):
        cfg = cfg.get_text_config(decoder=True)
        kind = getattr(cfg, "model_type", "") or kind
    if kind in HYBRID or getattr(cfg, "ssm_cfg", None) or getattr(cfg, "mamba_d_state", None):
        return (f"{kind} has recurrent or hybrid layers (a state that is not a per-token KV cache); "
                "their exact persistence is not supported yet")
    layer_types = list(getattr(cfg, "layer_types", None) or ())
    other = sorted({t for t in layer_types if t not in ATTENTION_LAYERS | SLIDING_LAYERS})
    if other:
        return f"{kind} has layers of type {', '.join(other)}, not attention; only attention layers are supported"
    rope = dict(getattr(cfg, "rope_parameters", None) or {})
    if not rope and getattr(cfg, "rope_theta", None) is not None:
        rope = {"rope_theta": cfg.rope_theta, **(getattr(cfg, "rope_scaling", None) or {})}
    if not rope or (rope.get("rope_theta") is None and not any(isinstance(v, dict) for v in rope.values())):
        return f"{kind} has no RoPE (its positions are learned or ALiBi): a stored key cannot move to a new position"
    for sub in [v for v in rope.values() if isinstance(v, dict)]:      # one set per layer type (Gemma 3)
        why = _rope_refusal(cfg, sub, kind)
        if why is not None:
            return why
    return _rope_refusal(cfg, rope, kind)


def _rope_refusal(cfg, rope: dict, kind: str) -> str | None:
    rope_type = rope.get("rope_type") or rope.get("type") or "default"
    if rope_type == "dynamic":
        return "dynamic NTK RoPE changes its frequencies with the sequence length: stored keys cannot be re-rotated"
    if rope_type == "longrope":
        original = rope.get("original_max_position_embeddings") or getattr(cfg, "original_max_position_embeddings",
                                                                           None)
        if original is None or getattr(cfg, "max_position_embeddings", 0) > original:
            return (f"longrope RoPE switches from its short to its long factors past {original} tokens (this "
                    f"model's window is {getattr(cfg, 'max_position_embeddings', '?')}): its frequencies depend "
                    "on the sequence length")
    if rope_type not in ("default", "linear", "llama3", "yarn", "longrope"):
        return f"RoPE type {rope_type!r} is not one kvmemory knows to be position-linear"
    if getattr(cfg, "position_embedding_type", "rope") not in ("rope", "rotary", None):
        return f"{kind} adds {cfg.position_embedding_type} position embeddings to RoPE"
    return None


def check(cfg) -> None:
    """ModelLoadError with refusal(cfg)'s reason where there is one."""
    why = refusal(cfg)
    if why is not None:
        raise ModelLoadError(f"kvmemory cannot keep this model exact: {why}")


def check_config(path: Path) -> None:
    """check() on a local model directory's config.json, before its weights are loaded."""
    from transformers import AutoConfig

    try:
        cfg = AutoConfig.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, KeyError) as e:
        raise ModelLoadError(f"cannot read the model configuration in {path}: {e}") from None
    check(cfg)
