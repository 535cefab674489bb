"""What a store holds, read from its header and commit log; no model, no block metadata."""

from __future__ import annotations

from kvmemory.store.blocks import BlockStore

_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}


def per_token_bytes(m) -> int:
    """Bytes of KV one token holds in a store of this manifest (all layers, K and V), as the model
    computes it (before the store's codec and encoding)."""
    return m.model["layers"] * 2 * m.model["kv_heads"] * m.model["head_dim"] * _ITEMSIZE[m.kv_dtype]


def describe(store: BlockStore, with_states: bool = False) -> dict:
    m = store.manifest
    per_token = per_token_bytes(m)
    tokens = m.stored_tokens
    disk = store.disk_bytes()
    out = {"path": store.name, "model": m.model["name"], "fingerprint": m.fingerprint,
           "states": len(m.states), "documents": len(m.docs), "blocks": m.n_blocks, "block_tokens": m.block_tokens,
           "prefill_tokens": m.chunk_tokens,
           "codec": m.codec, "kv_dtype": m.kv_dtype, "stored_tokens": tokens, "kv_bytes": tokens * per_token,
           "disk_bytes": disk, "compression_ratio": (tokens * per_token / disk) if disk else 1.0,
           "commit": m.commit, "kernels": m.model.get("kernels", "default"), "encoding": m.encoding,
           "encryption": m.encryption["cipher"] if m.encryption else "none",
           # the dtype attention computes in: a half-precision model's on CPU in float32 (kvmemory/model/half.py)
           "attention": "float32" if m.model.get("attention") else m.kv_dtype,
           # what its encoding saves: the blocks' KV words held exact, less as they are held (0 when exact)
           "bytes_saved": m.n_blocks * m.block_tokens * (per_token - per_token * store.encoding.itemsize //
                                                         _ITEMSIZE[m.kv_dtype])}
    if store.encoding.lossy:             # the worst measured error of any block (kvmemory/compact.py)
        out["encoding_error"] = store.error_report(None)
    if with_states:
        out["state_list"] = [{"id": k, "n_tokens": v.n_tokens, "label": v.label, "created": v.created}
                             for k, v in sorted(m.states.items(), key=lambda kv: kv[1].created)]
    return out


def store_info(path, with_states: bool = False, storage_options: dict | None = None) -> dict:
    return describe(BlockStore.open(path, storage_options=storage_options), with_states)
