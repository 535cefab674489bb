"""KV tensors: the canonical computation of blocks, and conversions cache <-> blocks <-> storage.

Canonical computation: a sequence is prefilled in chunks aligned to absolute block
boundaries (positions [i*C, (i+1)*C)), each chunk attending to the cache of everything
before it (a store made with prefill_tokens Q < C runs each block as forwards of Q from its
start: the same rule at a finer grain). A block's KV bytes then depend only on its parent
chain's KV and its own tokens, which is what makes E2 (recompute gives the same bytes) and prefix sharing sound: the same
block computed after a shorter or longer tail is the same computation.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np
import torch

from kvmemory.device import ids_tensor
from kvmemory.model.fingerprint import KVGeometry

_STORAGE_VIEW = {torch.bfloat16: torch.uint16}


def to_storage(t: torch.Tensor) -> np.ndarray:
    """Lossless numpy view of a KV tensor: bf16 as its raw 16-bit words."""
    t = t.detach().contiguous().cpu()
    view = _STORAGE_VIEW.get(t.dtype)
    return (t.view(view) if view is not None else t).numpy()


def from_storage(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    t = torch.from_numpy(np.ascontiguousarray(a))
    return t.view(dtype) if dtype in _STORAGE_VIEW else t


def cache_slice(cache, start: int, stop: int) -> torch.Tensor:
    """KV of tokens [start, stop) of a batch-1 cache: returns kv [layers, 2, kv_heads, n, head_dim]."""
    per_layer = []
    for layer in cache.layers:
        k, v = layer.keys, layer.values          # [1, H, T, D]
        per_layer.append(torch.stack((k[0, :, start:stop], v[0, :, start:stop])))
    return torch.stack(per_layer)


def sliding(config) -> bool:
    """Whether any layer of the model attends through a sliding window (local layers)."""
    from kvmemory.model.families import SLIDING_LAYERS
    cfg = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    types = getattr(cfg, "layer_types", None) or ()
    return any(t in SLIDING_LAYERS for t in types) or bool(
        getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", True))


def new_cache(config):
    """An empty DynamicCache for the model of `config`. Every layer holds every token, a sliding-window
    layer too (transformers' own would keep only the last window - 1): the model's mask applies the
    window, so a token attends to what it would in a trimmed cache, and the cache can be sliced, cut
    back and grafted like any other (kvmemory/model/families.py)."""
    from transformers import DynamicCache
    return DynamicCache() if sliding(config) else DynamicCache(config=config)


def make_cache(kv: torch.Tensor | None, config, copy: bool = True):
    """A fresh transformers DynamicCache holding kv [layers, 2, kv_heads, T, head_dim].

    copy=True: the cache owns a copy. copy=False: its layers start as views of kv (no second pass
    over the bytes); the model's updates concatenate into new tensors, so kv itself is never
    written (a cache whose layers are not plain DynamicLayers is copied anyway)."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    if kv is None or kv.shape[3] == 0:
        return new_cache(config)
    if not copy:
        cache = new_cache(config)
        if len(cache.layers) == kv.shape[0] and all(type(layer) is DynamicLayer for layer in cache.layers):
            for i, layer in enumerate(cache.layers):
                k, v = kv[i, 0].unsqueeze(0), kv[i, 1].unsqueeze(0)
                layer.lazy_initialization(k, v)
                layer.keys, layer.values = k, v
            return cache
    # [H, T, D] -> [1, H, T, D]; DynamicLayer.update concatenates, so the cache owns a copy
    return DynamicCache(ddp_cache_data=[(kv[i, 0].unsqueeze(0), kv[i, 1].unsqueeze(0)) for i in range(kv.shape[0])],
                        config=None if sliding(config) else config)


@torch.inference_mode()
def last_logits(model, ids: torch.Tensor, cache) -> torch.Tensor:
    """Run ids [1, T] after `cache` (extended in place); the logits of the last token [vocab].

    Only the last position goes through the LM head (transformers' logits_to_keep=1, what its
    generate() does for a prefill): 49,152 x 576 multiply-adds per token saved, ~20% of a
    256-token block on CPU. The last row's bits are those of a [1, 576] product, not of row -1
    of a [T, 576] one (they differ by ~1e-5): every kvmemory path takes logits this way, so
    graft and fresh computations (E3) compare like with like."""
    return model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits[0, -1]


@torch.inference_mode()
def prefill_chunked(model, ids: torch.Tensor, cache, chunk_tokens: int) -> torch.Tensor:
    """Run ids [1, T] after `cache` (extended in place) in forwards of chunk_tokens (the last may be
    shorter); the logits of the last token [vocab]. The caller starts it where a chunk of the
    canonical prefill starts."""
    logits = None
    for s in range(0, ids.shape[1], chunk_tokens):
        logits = last_logits(model, ids[:, s:s + chunk_tokens], cache)
    return logits


@torch.inference_mode()
def prefill_blocks(model, token_ids: Sequence[int], block_tokens: int, cache=None, start: int = 0,
                   chunk_tokens: int | None = None) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    """Canonical chunked prefill of token_ids placed at positions start...

    `cache` holds exactly the `start` tokens before (None: start must be 0); it is extended
    in place. Blocks are cut every block_tokens from `start` (the end of the parent chain),
    exactly as hashing.chain_ids cuts them; each block runs as one forward, or, with chunk_tokens
    (a divisor of block_tokens: the store's prefill_tokens), as forwards of chunk_tokens from the
    block's start. Yields, per block,
    (block_start, kv [layers, 2, kv_heads, n, head_dim], logits of the block's last token [vocab]).
    """
    if cache is None:
        if start:
            raise ValueError("a non-zero start needs the cache of the tokens before it")
        cache = new_cache(model.config)
    if cache.get_seq_length() != start:
        raise ValueError(f"cache holds {cache.get_seq_length()} tokens, start is {start}")
    Q = chunk_tokens or block_tokens
    if block_tokens % Q:
        raise ValueError(f"chunk_tokens {Q} does not divide block_tokens {block_tokens}")
    ids = ids_tensor(token_ids, model)                                     # [1, T] on the model's device
    for s in range(0, ids.shape[1], block_tokens):
        chunk = ids[:, s:s + block_tokens]
        logits = prefill_chunked(model, chunk, cache, Q)
        p = start + s
        yield p, cache_slice(cache, p, p + chunk.shape[1]), logits


def check_geometry(kv: torch.Tensor, geo: KVGeometry) -> None:
    """Cheap guard against a silently wrong layout: kv [layers, 2, kv_heads, T, head_dim]."""
    want = (geo.layers, 2, geo.kv_heads, geo.head_dim)
    got = (kv.shape[0], kv.shape[1], kv.shape[2], kv.shape[4])
    if got != want:
        raise ValueError(f"kv shape {tuple(kv.shape)} does not match geometry {want} (layers, 2, heads, -, dim)")


def truncate(cache, n: int) -> None:
    """Drop every token past the first n of a DynamicCache (in place).

    transformers' own `crop` changed meaning between 5.x releases; slicing the layers'
    keys/values is the same operation, and the next update concatenates a fresh copy.
    """
    for layer in cache.layers:
        layer.keys = layer.keys[..., :n, :]
        layer.values = layer.values[..., :n, :]


def extend(cache, kv: torch.Tensor) -> None:
    """Append kv [layers, 2, kv_heads, n, head_dim] to a DynamicCache (in place)."""
    for i in range(kv.shape[0]):
        cache.update(kv[i, 0].unsqueeze(0), kv[i, 1].unsqueeze(0), i)
