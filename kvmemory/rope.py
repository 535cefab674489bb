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

LINEAR_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")


def inv_freq(model) -> torch.Tensor:
    """The model's RoPE inverse frequencies, [R / 2] float32 on the CPU (R: the rotary dims, head_dim
    unless the rotary is partial)."""
    cfg = model.config
    rope = getattr(cfg, "rope_parameters", None) or {}
    kind = rope.get("rope_type", "default")
    if kind not in LINEAR_ROPE_TYPES:
        raise ModelLoadError(f"RoPE type {kind!r} is not position-linear; kvmemory cannot re-rotate its keys")
    for mod in model.modules():
        f = getattr(mod, "inv_freq", None)
        if isinstance(f, torch.Tensor):
            return f.detach().float().cpu()
    raise ModelLoadError(f"{type(model).__name__} has no rotary embedding with inv_freq")


def shift_cos_sin(shift: torch.Tensor, freqs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shift * inv_freq, computed in float64: [k] x [D/2] -> [k, D/2] each (float64)."""
    ang = shift.double().unsqueeze(-1) * freqs.double().unsqueeze(0)
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
