"""Opening a store for a model: an existing store's fingerprint checked against the model's (with a
hint that names what differs: dtype, kernels, attention), or a new store created with the model's
geometry in its header."""

from __future__ import annotations

import dataclasses
import uuid

from kvmemory.config import RuntimeConfig, StoreConfig, from_env
from kvmemory.errors import InputError, ModelMismatchError
from kvmemory.model import half, invariant as invariant_ops
from kvmemory.model.fingerprint import KVGeometry, with_prefill
from kvmemory.store import BlockStore
from kvmemory.store.manifest import CIPHER, Manifest


def open_store(loc, model, geometry: KVGeometry, fingerprint: str, config: RuntimeConfig,
               read_only: bool, keys=None) -> BlockStore:
    """The store at `loc` (store.location.locate), which must have been written by this model in this
    mode and dtype: ModelMismatchError naming what differs otherwise. keys: an encrypted store's
    KeyProvider (None: the environment's, kvmemory/keys.py)."""
    store = BlockStore(loc.root, read_only=read_only, lock_timeout_s=config.lock_timeout_s,
                       files=loc.files if loc.remote else None, cache_bytes=config.store_cache_bytes, keys=keys)
    m = store.manifest
    want = with_prefill(fingerprint, m.prefill_tokens, m.block_tokens)
    if m.fingerprint != want:
        raise ModelMismatchError(m.fingerprint, want, loc.name, _hint(m, model, geometry))
    if store.sealer is not None and not read_only:
        from kvmemory.chat_memory.memory import finish_forgets
        finish_forgets(store, loc.root)          # a forget a crash cut short after its key was destroyed
    return store


def open_or_create(loc, model, model_name: str, geometry: KVGeometry, fingerprint: str, config: RuntimeConfig,
                   read_only: bool, store_config: StoreConfig | None, encrypt: bool | None, keys):
    """Memory's store: the one at `loc` opened, or a new one created (encrypted where `encrypt` or the
    StoreConfig says so). encrypt=True on an existing store that is not encrypted is an InputError."""
    if encrypt is not None:
        store_config = dataclasses.replace(store_config or from_env(StoreConfig), encrypt=bool(encrypt))
    if not loc.exists:
        return create_store(loc, model, model_name, geometry, fingerprint, config, store_config, keys)
    store = open_store(loc, model, geometry, fingerprint, config, read_only, keys)
    if encrypt and not store.manifest.encryption:
        raise InputError(f"store {loc.name} exists and is not encrypted: encryption is chosen when a store is "
                         "created (deposit into a new, encrypted store)")
    return store


def _hint(m: Manifest, model, geometry: KVGeometry) -> str:
    """What differs between a store's header and this model, in words."""
    theirs = m.model.get("kernels", invariant_ops.DEFAULT)
    ours = invariant_ops.kernels(model)
    hint = "" if theirs == ours else (f"its blocks were computed with the {theirs} kernels, this Memory "
                                      f"uses the {ours} ones: open it with "
                                      f"invariant={theirs != invariant_ops.DEFAULT}")
    theirs_att, ours_att = m.model.get("attention"), half.mode(model)
    if m.kv_dtype == geometry.dtype and theirs == ours and theirs_att != ours_att:
        hint = (f"its blocks were computed with {'float32' if theirs_att else m.kv_dtype} attention, this "
                f"Memory computes with {'float32' if ours_att else m.kv_dtype} attention (kvmemory.model.half)"
                + ("; a half-precision store made before kvmemory computed attention in float32 on CPU "
                   "(2026-12-04) holds other bytes: deposit its documents into a new store"
                   if theirs_att is None else ""))
    if m.kv_dtype != geometry.dtype:
        hint = (f"its blocks were computed in {m.kv_dtype}, this Memory computes in {geometry.dtype}: "
                f"open it with dtype={m.kv_dtype!r} (--dtype {m.kv_dtype}, KVMEMORY_DTYPE)"
                + (f"; {hint}" if hint else ""))
    return hint


def create_store(loc, model, model_name: str, geometry: KVGeometry, fingerprint: str, config: RuntimeConfig,
                 store_config: StoreConfig | None, keys=None) -> BlockStore:
    """A new store at `loc` for this model, its header holding the model's geometry and mode."""
    cfg = store_config or from_env(StoreConfig)
    g = geometry
    kernels, attention = invariant_ops.kernels(model), half.mode(model)
    q = 0 if cfg.prefill_tokens == cfg.block_tokens else cfg.prefill_tokens
    manifest = Manifest(
        fingerprint=with_prefill(fingerprint, q, cfg.block_tokens), block_tokens=cfg.block_tokens,
        shard_blocks=cfg.shard_blocks, codec=cfg.codec, kv_dtype=g.dtype, prefill_tokens=q,
        model={"name": model_name, "layers": g.layers, "kv_heads": g.kv_heads,
               "head_dim": g.head_dim, "max_positions": g.max_positions, "rope": g.rope,
               **({"kernels": kernels} if kernels != invariant_ops.DEFAULT else {}),
               **({"attention": attention} if attention is not None else {})},
        encryption={"cipher": CIPHER, "store": uuid.uuid4().hex} if cfg.encrypt else None)
    if loc.remote:
        return BlockStore.create_remote(loc.files, loc.root, manifest, lock_timeout_s=config.lock_timeout_s,
                                        cache_bytes=config.store_cache_bytes, keys=keys)
    return BlockStore.create(loc.root, manifest, lock_timeout_s=config.lock_timeout_s, keys=keys)
