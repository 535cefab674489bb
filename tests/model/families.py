"""Tiny random-weight models of every family the engine supports (kvmemory.model.families.FAMILIES),
each built from its family's real transformers config class (no download), with the default model's
vocabulary so the real tokenizer serves them all; and the models it must refuse, with the reason's
words."""

from __future__ import annotations

import torch

# the geometry every family shares: small, and with grouped-query attention
_BASE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=8192, tie_word_embeddings=True)


def _rope(theta=100000.0, **kw) -> dict:
    return {"rope_parameters": {"rope_theta": theta, "rope_type": "default", **kw}}


def configs(vocab: int, bos: int, eos: int) -> dict:
    """family -> its tiny config (one per kvmemory.model.families.FAMILIES entry)."""
    import transformers as t

    ids = dict(vocab_size=vocab, bos_token_id=bos, eos_token_id=eos, pad_token_id=eos)
    base = {**_BASE, **ids}
    return {
        "llama": t.LlamaConfig(**base, head_dim=16, **_rope()),
        "llama3": t.LlamaConfig(**base, head_dim=16, rope_parameters={
            "rope_theta": 500000.0, "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 1024}),
        "qwen2": t.Qwen2Config(**base, use_sliding_window=False, **_rope()),
        "qwen3": t.Qwen3Config(**base, head_dim=16, use_sliding_window=False, **_rope()),
        "qwen3_moe": t.Qwen3MoeConfig(**base, head_dim=16, use_sliding_window=False, num_experts=4,
                                      num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1,
                                      **_rope()),
        "mistral": t.MistralConfig(**base, head_dim=16, sliding_window=None, **_rope()),
        "phi3": t.Phi3Config(**base, sliding_window=None, **_rope()),
        "olmo2": t.Olmo2Config(**base, **_rope()),
        "granite": t.GraniteConfig(**base, embedding_multiplier=6.0, residual_multiplier=0.22,
                                   attention_multiplier=0.0625, logits_scaling=4.0, **_rope()),
        "gemma": t.GemmaConfig(**base, head_dim=16, **_rope()),
        "olmo": t.OlmoConfig(**base, **_rope()),
        "stablelm": t.StableLmConfig(**base, partial_rotary_factor=0.25, **_rope()),
        # windows of 24 tokens: the tests' states (up to ~60 tokens) reach past them
        "mistral_sliding": t.MistralConfig(**base, head_dim=16, sliding_window=24, **_rope()),
        "gemma2": t.Gemma2Config(**base, head_dim=16, sliding_window=24, **_rope()),
        "gemma3_text": t.Gemma3TextConfig(**{**base, "num_hidden_layers": 6}, head_dim=16, sliding_window=24,
                                          rope_parameters={
                                              "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
                                              "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}),
    }


def refused(vocab: int) -> dict:
    """name -> (a config the engine must refuse, words its reason holds)."""
    import transformers as t

    base = {**_BASE, "vocab_size": vocab}
    return {
        "dynamic-ntk": (t.LlamaConfig(**base, head_dim=16, rope_parameters={
            "rope_theta": 10000.0, "rope_type": "dynamic", "factor": 2.0}), "dynamic NTK"),
        "longrope": (t.Phi3Config(**base, sliding_window=None, original_max_position_embeddings=1024,
                                  rope_parameters={"rope_theta": 10000.0, "rope_type": "longrope",
                                                   "short_factor": [1.0] * 8, "long_factor": [2.0] * 8,
                                                   "original_max_position_embeddings": 1024}), "longrope"),
        "gpt2": (t.GPT2Config(vocab_size=vocab, n_embd=64, n_layer=2, n_head=4), "no RoPE"),
        "mamba": (t.MambaConfig(vocab_size=vocab, hidden_size=64, num_hidden_layers=2), "recurrent or hybrid"),
        "t5": (t.T5Config(vocab_size=vocab, d_model=64, num_layers=2, num_heads=4), "encoder-decoder"),
    }


def build(cfg, seed: int = 0):
    """A random-weight causal LM of `cfg` (its family's own class), in eval mode."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg)
    return model.eval()
