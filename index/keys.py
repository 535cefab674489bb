"""Model-internal selection: summarise a block by its keys, query with the question's queries.

Block vector: keys of one layer, rotated back to position 0 (pre-RoPE), averaged over the
block's tokens, per KV head, concatenated and L2-normalised: [kv_heads * head_dim].
Query vector: the question's pre-RoPE queries at the same layer (q_proj output, captured with
a forward hook), averaged over tokens and over the query heads that share each KV head.
The inner product approximates the mean attention logit the question would give the block.
"""

from __future__ import annotations

import numpy as np
import torch

from kvmemory.device import ids_tensor, to_host
from kvmemory.rope import rotate, shift_cos_sin


def default_layer(num_layers: int) -> int:
    return num_layers // 2


def block_vectors(kv: torch.Tensor, positions: list[int], layer: int, freqs: torch.Tensor) -> np.ndarray:
    """kv [L, 2, H, n, D] of one block whose first token sits at positions[0] -> [H * D] float32."""
    k = to_host(kv[layer, 0]).float()                                  # [H, n, D]
    pos = torch.as_tensor(positions, dtype=torch.long)
    f = to_host(freqs)
    cos, sin = shift_cos_sin(-pos, f[layer] if f.dim() == 2 else f)               # [n, D/2]: rotate back to 0
    k0 = rotate(k, cos.unsqueeze(0), sin.unsqueeze(0)).mean(dim=1)     # [H, D]
    v = k0.reshape(-1)
    return torch.nn.functional.normalize(v, dim=0).numpy().astype(np.float32)


@torch.inference_mode()
def query_vector(model, token_ids: list[int], layer: int, kv_heads: int, head_dim: int) -> np.ndarray:
    """The question's mean pre-RoPE query at `layer`, grouped per KV head -> [kv_heads * head_dim]."""
    captured = {}
    attn = model.model.layers[layer].self_attn
    hook = attn.q_proj.register_forward_hook(lambda m, i, o: captured.__setitem__("q", o.detach()))
    try:
        model.model(input_ids=ids_tensor(token_ids, model), use_cache=False)
    finally:
        hook.remove()
    q = to_host(captured["q"][0]).float()                                       # [T, n_heads * D]
    n_heads = q.shape[-1] // head_dim
    q = q.reshape(q.shape[0], kv_heads, n_heads // kv_heads, head_dim).mean(dim=(0, 2))   # [H, D]
    return torch.nn.functional.normalize(q.reshape(-1), dim=0).numpy().astype(np.float32)
