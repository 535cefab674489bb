"""RoPE re-rotation: move cached keys from the position they were computed at to another.

RoPE rotates each (d, d + R/2) pair of a key's first R dims by angle pos * inv_freq[d] (the
rotate-half layout of Llama/Qwen/Mistral in transformers; R = D, or R < D for partial rotary,
whose other dims carry no position). Rotations compose, so a key computed at p
is moved to p + shift by rotating it by shift * inv_freq. That holds for every RoPE variant
whose angle is linear in the position (default, linear, llama3, yarn: their scaling lives
in inv_freq, or in an attention factor already applied to the stored key); "dynamic" NTK
changes inv_freq with the sequence length, so it is refused.
"""

from __future__ import annotations

import torch

from kvmemory.errors import ModelLoadError

def inv_freq(model) -> torch.Tensor:
    """The model's RoPE inverse frequencies, float32 on the CPU: [R / 2] (R: the rotary dims, head_dim
    unless the rotary is partial), or [layers, R / 2] where layers of different types rotate with
    different frequencies (Gemma 3: local layers with base 1e4, global ones with 1e6)."""
    from kvmemory.model.families import refusal
    why = refusal(model.config)
    if why is not None:
        raise ModelLoadError(f"kvmemory cannot re-rotate this model's keys: {why}")
    cfg = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
    types = list(getattr(cfg, "layer_types", None) or ())
    for mod in model.modules():
        per_type = {t: getattr(mod, f"{t}_inv_freq", None) for t in set(types)}
        if types and all(isinstance(f, torch.Tensor) for f in per_type.values()):
            freqs = torch.stack([torch.as_tensor(per_type[t]).detach().float().cpu() for t in types])
            return freqs[0] if all(torch.equal(f, freqs[0]) for f in freqs) else freqs
        f = getattr(mod, "inv_freq", None)
        if isinstance(f, torch.Tensor):
            return f.detach().float().cpu()
    raise ModelLoadError(f"{type(model).__name__} has no rotary embedding with inv_freq")


def shift_cos_sin(shift: torch.Tensor, freqs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shift * inv_freq, computed in float64: [k] x [R/2] -> [k, R/2] each (float64); with
    per-layer frequencies [L, R/2] -> [k, L, R/2]."""
    ang = shift.double().reshape(-1, *([1] * freqs.dim())) * freqs.double().unsqueeze(0)
    return ang.cos(), ang.sin()


def rotate(k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate keys k [..., n, D] by per-pair angles given as cos/sin broadcastable to [..., 1, R/2]:
    the first R dims rotate in halves (R = D, or less for partial rotary: StableLM, Phi-4-mini),
    the rest pass through unchanged."""
    half = cos.shape[-1]
    r = 2 * half
    if r > k.shape[-1]:
        raise ValueError(f"{half} RoPE frequencies for keys of {k.shape[-1]} dims")
    k1, k2 = k[..., :half].double(), k[..., half:r].double()
    out = torch.cat((k1 * cos - k2 * sin, k2 * cos + k1 * sin), dim=-1).to(k.dtype)
    return out if r == k.shape[-1] else torch.cat((out, k[..., r:]), dim=-1)
