"""BlockStore with synthetic KV bytes: round trip (E1), corruption, crashes, locks, read-only."""

import subprocess
import sys
import textwrap
import time

import pytest
import torch

from kvmemory import hashing
from kvmemory import kv as kvops
from kvmemory.errors import StoreCorruptError, StoreError, StoreLockedError, StoreReadOnlyError
from kvmemory.store.manifest import Manifest, StateEntry
from kvmemory.store import BlockStore, Change

L, H, C, D = 2, 2, 4, 3


def make_store(path, kv_dtype="float32", codec="none", shard_blocks=2, timeout=5.0):
    m = Manifest(fingerprint="kvm1-test", block_tokens=C, shard_blocks=shard_blocks, codec=codec, kv_dtype=kv_dtype,
                 model={"name": "synthetic", "layers": L, "kv_heads": H, "head_dim": D, "max_positions": 64})
    return BlockStore.create(path, m, lock_timeout_s=timeout)


def random_state(gen, n_tokens, dtype=torch.float32):
    tokens = [int(t) for t in torch.randint(0, 1000, (n_tokens,), generator=gen)]
    return tokens, torch.randn((L, 2, H, n_tokens, D), generator=gen).to(dtype)


def commit_state(store, tokens, kv, label=""):
    """Commit a state the way Memory.save does: reuse known blocks, append the rest."""
    ids = hashing.chain_ids(store.manifest.fingerprint, tokens, C)

    def build(s):
        new, rows = s.plan_chain(ids, tokens, 0, -1, lambda i: kvops.to_storage(kv[:, :, :, i * C:(i + 1) * C]))
        return Change(new, {ids[-1].hex(): StateEntry(last_row=rows[-1], n_tokens=len(tokens), label=label)})

    store.commit(build)
    return ids[-1].hex()


def read_state(store, sid, dtype=torch.float32):
    """The store's read path must agree byte for byte with zarr-python reading the same arrays."""
    rows = store.chain(store.manifest.states[sid].last_row)
    got = kvops.from_storage(store.read_state_kv(rows), dtype)
    n = store.block_meta(rows)["n_tokens"]
    via_zarr = torch.cat([kvops.from_storage(store._arr["kv"][r], dtype)[:, :, :, :int(n[i])]
                          for i, r in enumerate(rows)], dim=3)
    assert torch.equal(got.contiguous().view(-1).view(torch.uint8), via_zarr.contiguous().view(-1).view(torch.uint8))
    return got


def _kv_shard_files(root):
    return sorted(p for p in (root / "data" / "kv").rglob("*") if p.is_file() and p.name != "zarr.json")


@pytest.mark.parametrize("codec", ["none", "zstd", "lz4"])
def test_flipped_byte_raises_naming_block(tmp_path, codec):
    gen = torch.Generator().manual_seed(2)
    store = make_store(tmp_path / "s", codec=codec)
    tokens, kv = random_state(gen, 8)
    sid = commit_state(store, tokens, kv)
    shard = _kv_shard_files(tmp_path / "s")[0]
    data = bytearray(shard.read_bytes())
    data[40] ^= 0x01                                # inside the first block's data
    shard.write_bytes(bytes(data))
    fresh = BlockStore.open(tmp_path / "s")
    first_id = hashing.chain_ids("kvm1-test", tokens, C)[0].hex()
    with pytest.raises(StoreCorruptError, match=first_id if codec == "none" else "block|cannot read"):
        read_state(fresh, sid)
    bad = fresh.verify_all()
    assert bad and bad[0][0] == 0


def test_missing_or_truncated_shard_raises(tmp_path):
    gen = torch.Generator().manual_seed(3)
    store = make_store(tmp_path / "s")
    tokens, kv = random_state(gen, 8)
    sid = commit_state(store, tokens, kv)
    shard = _kv_shard_files(tmp_path / "s")[0]
    shard.write_bytes(shard.read_bytes()[:50])
    with pytest.raises(StoreCorruptError):
        read_state(BlockStore.open(tmp_path / "s"), sid)
    shard.unlink()                                  # zarr would return fill values: the digest catches it
    with pytest.raises(StoreCorruptError):
        read_state(BlockStore.open(tmp_path / "s"), sid)


def test_read_only_store_refuses_writes_and_changes_nothing(tmp_path):
    gen = torch.Generator().manual_seed(6)
    store = make_store(tmp_path / "s")
    t, kv = random_state(gen, 5)
    commit_state(store, t, kv)
    before = sorted(p.name for p in (tmp_path / "s").rglob("*"))
    ro = BlockStore.open(tmp_path / "s", read_only=True)
    with pytest.raises(StoreReadOnlyError):
        commit_state(ro, *random_state(gen, 3))
    assert sorted(p.name for p in (tmp_path / "s").rglob("*")) == before


def test_open_rejects_file_and_non_store(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(StoreError, match="is a file"):
        BlockStore.open(f)
    with pytest.raises(StoreError, match="no kvmemory store"):
        BlockStore.open(tmp_path)


HOLD_LOCK = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from kvmemory.store.lock import writer_lock
    with writer_lock(Path(sys.argv[1]), 5):
        print("locked", flush=True)
        time.sleep(float(sys.argv[2]))
""")


def _hold_lock(root, seconds):
    p = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(root), str(seconds)], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "locked"
    return p


def test_second_writer_gets_clear_error_when_lock_is_held(tmp_path):
    gen = torch.Generator().manual_seed(7)
    store = make_store(tmp_path / "s", timeout=0.3)
    holder = _hold_lock(tmp_path / "s", 3)
    try:
        with pytest.raises(StoreLockedError, match="locked by another writer"):
            commit_state(store, *random_state(gen, 3))
        assert store.n_blocks == 0
    finally:
        holder.kill()
        holder.wait()


def test_second_writer_waits_for_the_lock(tmp_path):
    gen = torch.Generator().manual_seed(8)
    store = make_store(tmp_path / "s", timeout=10)
    holder = _hold_lock(tmp_path / "s", 0.7)
    t0 = time.monotonic()
    t, kv = random_state(gen, 3)
    sid = commit_state(store, t, kv)
    holder.wait()
    assert time.monotonic() - t0 >= 0.3
    assert torch.equal(read_state(BlockStore.open(tmp_path / "s"), sid), kv)


def test_damaged_tokens_are_caught_by_id_check(tmp_path):
    gen = torch.Generator().manual_seed(9)
    store = make_store(tmp_path / "s")
    t, kv = random_state(gen, 9)
    commit_state(store, t, kv)
    arr = __import__("zarr").open_array(str(tmp_path / "s" / "data" / "tokens"), mode="r+")
    row = arr[1]
    row[0] += 1
    arr[1] = row
    bad = BlockStore.open(tmp_path / "s").verify_all()
    assert [r for r, _ in bad] == [1] and "does not match" in bad[0][1]
