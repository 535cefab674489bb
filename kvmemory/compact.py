"""`kvmemory compact SRC DEST [--encoding fp16|bf16]`: a compact, lossy copy of an exact store, for
cold storage: every block encoded (kvmemory/store/encoding.py: half the bytes), its error measured
against the exact block it came from, and the copy made atomically (built beside DEST, renamed
into place once whole; the source is only read).

What each block carries (the copy's `error` array; every graft from the copy reports the worst of
its blocks, kvmemory/store/blocks.py error_report):
    key_rel_error, value_rel_error   relative L2 error of the block's keys and values, decoded
                                     against its exact words
    kl                               KL(exact || compact) of the next-token distribution at the end
                                     of every chain through the block (a state, a deposit segment),
                                     the largest: the chain's last token run over the exact KV of
                                     the tokens before it, and over the same KV encoded and decoded
                                     (one forward each, the same computation but for the KV)

The copy keeps everything else: block ids, tokens, positions, rows (so its selection indexes are
the source's, copied), states, documents, chat users, commit number. It takes no new blocks
(CompactStoreError): add to the exact store and compact again.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from kvmemory import kv as kvops
from kvmemory.device import ids_tensor, to_model
from kvmemory.errors import InputError, StoreExistsError
from kvmemory.exactness import kl_divergence, max_abs_diff
from kvmemory.runtime import Runtime
from kvmemory.store import BlockStore, encoding as encodings
from kvmemory.store.commit import NewBlock
from kvmemory.store.durable import fsync_dir, fsync_tree
from kvmemory.store.info import per_token_bytes
from kvmemory.store.log import write_snapshot
from kvmemory.store.manifest import Manifest

COPIED_DIRS = ("index", "users")          # derived data keyed by row: the same rows, the same files


@dataclass(frozen=True)
class CompactReport:
    path: str
    encoding: str
    blocks: int
    tokens: int
    chains: int                    # chain ends whose next-token KL was measured
    chains_same_top1: int          # ... where the exact and the compact KV give the same greedy token
    kv_bytes: int                  # the exact KV of the source's tokens
    source_disk_bytes: int
    disk_bytes: int
    kl_max: float
    kl_mean: float                 # over the chains
    logit_diff_max: float          # largest |logit difference| at a chain end
    key_rel_error_max: float
    value_rel_error_max: float
    seconds: float

    @property
    def bytes_saved(self) -> int:
        return self.source_disk_bytes - self.disk_bytes


def chain_ends(src: BlockStore) -> list[int]:
    """Rows that end a chain: every state's last block, and every block no other block continues."""
    rows = src.manifest.committed_rows()
    parents = {int(p) for p in src.block_meta(rows)["parent"]} if rows else set()
    ends = {s.last_row for s in src.manifest.states.values()} | {r for r in rows if r not in parents}
    return sorted(ends)


@torch.inference_mode()
def chain_kl(model, src: BlockStore, enc, rows: list[int]) -> tuple[float, float, bool]:
    """(KL, max |logit diff|, same greedy token) of the next-token distribution at the end of a chain:
    its last token over the exact KV of the tokens before it vs over that KV encoded and decoded."""
    ids = src.token_ids(rows)
    if len(ids) < 2:
        return 0.0, 0.0, True            # no KV before the last token: nothing encoded to measure
    exact = src.read_state_kv(rows)
    dtype = getattr(torch, src.manifest.kv_dtype)
    last = ids_tensor(ids[-1:], model)
    out = []
    for words in (exact, enc.roundtrip(exact)):
        kv = to_model(kvops.from_storage(words, dtype)[:, :, :, :len(ids) - 1], model)
        out.append(kvops.last_logits(model, last, kvops.make_cache(kv, model.config)).double().cpu())
    return kl_divergence(out[0], out[1]), max_abs_diff(out[0], out[1]), bool(out[0].argmax() == out[1].argmax())


def compact(rt: Runtime, dest, encoding: str = "fp16", progress=None) -> CompactReport:
    """Write a compact copy of the runtime's (exact) store at `dest` (a new local directory). progress: an
    object with update(n) (blocks), driven through both passes (2 x the blocks)."""
    t0 = time.perf_counter()
    src = rt.store()
    src.refresh()
    m = src.manifest
    if src.encoding.lossy:
        raise InputError(f"store {src.name} is already compact ({m.encoding}); compact its exact source")
    if m.encryption:
        raise InputError(f"store {src.name} is encrypted: compacting an encrypted store is not supported (a compact "
                         "copy would be written in plain)")
    enc = encodings.get(encoding, m.kv_dtype)
    if not enc.lossy:
        raise InputError("compact to a lossy encoding (bf16, fp16); an exact copy is a copy of the directory")
    if "://" in str(dest):
        raise InputError(f"compact writes a local directory, got {dest}; copy the result to the object store")
    dest = Path(dest)
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise StoreExistsError(f"{dest} exists and is not empty: compact into a new directory")
    rows = m.committed_rows()
    ends = chain_ends(src)
    if progress is not None and hasattr(progress, "total"):
        progress.total = len(ends) + len(rows)
        if hasattr(progress, "refresh"):
            progress.refresh()

    # pass 1: the next-token KL at every chain end, charged to every block of the chain
    kl = {r: 0.0 for r in rows}
    kls, diffs, agree = [], [], 0
    for end in ends:
        chain = src.chain(end)
        k, d, same = chain_kl(rt.model, src, enc, chain)
        kls.append(k)
        diffs.append(d)
        agree += same
        for r in chain:
            kl[r] = max(kl[r], k)
        if progress is not None:
            progress.update(1)

    # pass 2: every block encoded, shard by shard, into a directory beside dest
    tmp = dest.with_name(f".{dest.name}.compacting-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    header = Manifest(fingerprint=m.fingerprint, model=dict(m.model), block_tokens=m.block_tokens,
                      shard_blocks=m.shard_blocks, codec=m.codec, kv_dtype=m.kv_dtype, encoding=encoding,
                      prefill_tokens=m.prefill_tokens)
    try:
        out = BlockStore.create(tmp, header)
        S = m.shard_blocks
        by_shard: dict[int, list[int]] = {}
        for r in rows:
            by_shard.setdefault(r // S, []).append(r)
        key_err, val_err = [], []
        with out.write_lock():
            for shard, rs in sorted(by_shard.items()):
                kv, n_tokens = src.read_kv(rs)                  # verified: the exact words
                meta = src.block_meta(rs)
                at = {r: i for i, r in enumerate(rs)}
                blocks = []
                for r in range(shard * S, rs[-1] + 1):
                    if r not in at:                             # a row gc reclaimed: never read, kept empty
                        blocks.append(NewBlock(m.id_of(r), -1, np.zeros(0, np.int32), np.zeros(0, np.int32),
                                               enc.encode(kv[0][:, :, :, :0])))
                        continue
                    i, n = at[r], int(n_tokens[at[r]])
                    words = kv[i][:, :, :, :n]
                    stored = enc.encode(words)
                    ke, ve = encodings.relative_errors(words, enc.decode(stored))
                    key_err.append(ke)
                    val_err.append(ve)
                    blocks.append(NewBlock(meta["block_id"][i].tobytes(), int(meta["parent"][i]), meta["tokens"][i][:n],
                                           meta["positions"][i][:n], stored, m.root_of(r), (ke, ve, kl[r])))
                out._append(shard * S, blocks)
                if progress is not None:
                    progress.update(len(rs))
        for name in COPIED_DIRS:
            if (src.root / name).is_dir():
                shutil.copytree(src.root / name, tmp / name)
                fsync_tree(tmp / name)
        # the commit point: one snapshot of the source's view (its commit, states, documents, rows)
        view = dataclasses.replace(header)
        view.load_snapshot(m.snapshot_json(), f"{src.name} (snapshot for {dest})")
        write_snapshot(out.files, view)
        fsync_dir(tmp / "log")
        if dest.exists():
            dest.rmdir()
        os.replace(tmp, dest)
        fsync_dir(dest.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    kv_bytes = m.stored_tokens * per_token_bytes(m)
    return CompactReport(str(dest), encoding, len(rows), m.stored_tokens, len(ends), agree, kv_bytes, src.disk_bytes(),
                         BlockStore.open(dest).disk_bytes(), max(kls, default=0.0),
                         float(np.mean(kls)) if kls else 0.0, max(diffs, default=0.0), max(key_err, default=0.0),
                         max(val_err, default=0.0), time.perf_counter() - t0)
