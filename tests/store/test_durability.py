"""Durability of the commit protocol: write-once files, exact fsyncs, checked writes, a full disk,
leftovers, lazy metadata, snapshots, gc. Synthetic KV bytes (no model)."""

import errno
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

import kvmemory.store.durable as durable_mod
import kvmemory.store.log as log_mod
from kvmemory import hashing
from kvmemory import kv as kvops
from kvmemory.errors import StoreCorruptError, StoreError
from kvmemory.store.files import LocalFiles
from kvmemory.store.log import read_manifest
from kvmemory.store.manifest import SNAPSHOT_EVERY, DocEntry
from kvmemory.store import BlockStore
from kvmemory.store import Change
from kvmemory.store.info import describe

from tests.store.test_block_store import C, commit_state, make_store, random_state, read_state


def _files(root: Path) -> dict[str, tuple]:
    """path -> (inode, size, bytes) of every file but the lock."""
    return {str(p.relative_to(root)): (p.stat().st_ino, p.stat().st_size, p.read_bytes())
            for p in root.rglob("*") if p.is_file() and p.name != ".lock"}


def _commit_doc(store, gen, n_tokens, doc_id):
    """Commit a document's blocks and its entry in one commit (no state names them)."""
    tokens, kv = random_state(gen, n_tokens)
    ids = hashing.chain_ids(store.manifest.fingerprint, tokens, C)
    rows: list[int] = []

    def build(s):
        new, got = s.plan_chain(ids, tokens, 0, -1, lambda i: kvops.to_storage(kv[:, :, :, i * C:(i + 1) * C]))
        rows[:] = got
        return Change(new, {}, {doc_id: DocEntry(rows=got, n_tokens=n_tokens, segments=1)})
    store.commit(build)
    return rows, tokens, kv


def test_a_commit_never_rewrites_a_committed_file(tmp_path):
    gen = torch.Generator().manual_seed(10)
    store = make_store(tmp_path / "s", shard_blocks=2)
    states = {commit_state(store, *random_state(gen, 5)): None}       # 2 blocks: the last shard is partly used
    for n in (3, 1, 9, 4, 13):
        before = _files(tmp_path / "s")
        t, kv = random_state(gen, n)
        states[commit_state(store, t, kv)] = (t, kv)
        after = _files(tmp_path / "s")
        changed = [p for p, v in before.items() if after.get(p) != v]
        assert changed == [], f"commit of {n} tokens rewrote {changed}"
        assert len(after) > len(before)
    again = BlockStore.open(tmp_path / "s")
    assert again.verify_all() == []
    for sid, v in states.items():
        if v is not None:
            assert torch.equal(read_state(again, sid), v[1])


def test_a_commit_fsyncs_exactly_what_it_wrote(tmp_path, monkeypatch):
    gen = torch.Generator().manual_seed(11)
    root = tmp_path / "s"
    store = make_store(root, shard_blocks=2)
    commit_state(store, *random_state(gen, 9))
    before = set(_files(root))
    synced: list[str] = []
    real = os.fsync

    def spy(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        return real(fd)
    monkeypatch.setattr(os, "fsync", spy)
    commit_state(store, *random_state(gen, 6))
    monkeypatch.undo()
    new = set(_files(root)) - before
    synced_files = {str(Path(p).relative_to(root)) for p in synced if Path(p).is_file()}
    synced_dirs = {Path(p) for p in synced if Path(p).is_dir()}
    assert not synced_files & before, "an earlier commit's file was fsynced (walked), not only the new ones"
    new_data = {p for p in new if p.startswith("data/")}
    assert new_data and new_data <= synced_files, f"written but not fsynced: {new_data - synced_files}"
    assert any(p.startswith("log/") for p in new)
    # every directory that gained an entry was fsynced; no directory outside the new files' paths
    for p in new:
        assert (root / p).parent in synced_dirs, f"{p}: its directory was not fsynced"
    wanted_dirs = {d for p in new for d in (root / p).parents if root in d.parents or d == root}
    assert synced_dirs <= wanted_dirs


def test_short_writes_still_commit_whole(tmp_path, monkeypatch):
    gen = torch.Generator().manual_seed(12)
    store = make_store(tmp_path / "s")
    real = os.write
    monkeypatch.setattr(durable_mod.os, "write", lambda fd, data: real(fd, bytes(data[:7])))
    t, kv = random_state(gen, 6)
    sid = commit_state(store, t, kv)
    monkeypatch.undo()
    assert torch.equal(read_state(BlockStore.open(tmp_path / "s"), sid), kv)


@pytest.mark.parametrize("where", ["record", "data"])
def test_failed_write_is_a_store_error_and_keeps_the_last_commit(tmp_path, monkeypatch, where):
    gen = torch.Generator().manual_seed(13)
    root = tmp_path / "s"
    store = make_store(root)
    t, kv = random_state(gen, 6)
    sid = commit_state(store, t, kv)
    files = _files(root)

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")
    if where == "record":
        monkeypatch.setattr(durable_mod.os, "write", full)
    else:
        import zarr.storage._local as zl
        monkeypatch.setattr(zl, "_put", full)
    with pytest.raises(StoreError, match="disk full"):
        commit_state(store, *random_state(gen, 9))
    monkeypatch.undo()
    assert _files(root) == files, "a failed commit left files behind or changed one"
    again = BlockStore.open(root)
    assert again.manifest.commit == store.manifest.commit == 1 and list(again.manifest.states) == [sid]
    assert again.verify_all() == []
    assert torch.equal(read_state(again, sid), kv)
    sid2 = commit_state(store, *random_state(gen, 3))                  # and the store goes on
    assert sid2 in BlockStore.open(root).manifest.states


FILL_DISK = textwrap.dedent("""
    import json, sys, torch
    sys.path.insert(0, sys.argv[2])
    from tests.store.test_block_store import make_store, commit_state, random_state, read_state
    from kvmemory.errors import StoreError
    from kvmemory.store import BlockStore
    root = sys.argv[1] + "/s"
    store = make_store(root, shard_blocks=2)
    gen = torch.Generator().manual_seed(0)
    ok, err = {}, None
    for i in range(10000):
        t, kv = random_state(gen, 37)
        try:
            ok[commit_state(store, t, kv)] = kv
        except StoreError as e:
            err = str(e)
            break
    again = BlockStore.open(root)
    good = all(torch.equal(read_state(again, s), kv) for s, kv in ok.items())
    print(json.dumps({"committed": len(ok), "error": err, "commit": again.manifest.commit,
                      "states": sorted(again.manifest.states) == sorted(ok), "read_back": good,
                      "bad": again.verify_all()}))
""")


def _can_mount_tmpfs() -> bool:
    if not shutil.which("unshare"):
        return False
    r = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c",
                        "mkdir -p /tmp/kvm-probe && mount -t tmpfs -o size=64k tmpfs /tmp/kvm-probe"],
                       capture_output=True)
    return r.returncode == 0


@pytest.mark.skipif(not _can_mount_tmpfs(), reason="needs unshare and a user namespace to mount a small tmpfs")
def test_a_full_tmpfs_gives_store_error_and_keeps_every_commit(tmp_path):
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    repo = Path(__file__).resolve().parents[2]
    script = tmp_path / "fill.py"
    script.write_text(FILL_DISK)
    r = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c",
                        f"mount -t tmpfs -o size=1m tmpfs {mnt} && {sys.executable} {script} {mnt} {repo}"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["committed"] > 3 and out["error"] and "disk full" in out["error"]
    assert out["commit"] == out["committed"] and out["states"] and out["read_back"] and out["bad"] == []


def test_leftovers_are_cleaned_by_the_next_writer_and_not_counted(tmp_path):
    gen = torch.Generator().manual_seed(14)
    root = tmp_path / "s"
    store = make_store(root, shard_blocks=2)
    t, kv = random_state(gen, 9)                                        # rows 0..2: shards 0, 1
    sid = commit_state(store, t, kv)
    size = store.disk_bytes()
    shard = next(p for p in (root / "data" / "kv" / "c").rglob("*") if p.is_file())
    # what a killed commit leaves: data files past the commit, zarr's and our temp files
    past = root / "data" / "kv" / "c" / "5" / "0" / "0" / "0" / "0" / "0"
    past.parent.mkdir(parents=True)
    shutil.copy(shard, past)
    (root / "data" / "tokens" / "c" / "7").mkdir(parents=True)
    (root / "data" / "tokens" / "c" / "7" / "0").write_bytes(b"x" * 100)
    temps = [root / "log" / ".00000002.json.abcdef.tmp", root / "index" / ".dense-w1.faiss.123.tmp",
             shard.with_name("0.deadbeef.partial")]
    for p in temps:
        p.parent.mkdir(exist_ok=True)
        p.write_bytes(b"y" * 1000)
    assert store.disk_bytes() == size + past.stat().st_size + 100       # temp files are not store bytes
    foreign = root / "serve" / ".jobs.json.abc.tmp"                     # written without the writer lock
    foreign.parent.mkdir()
    foreign.write_bytes(b"z")
    again = BlockStore.open(root, read_only=False)
    sid2 = commit_state(again, *random_state(gen, 3))                   # a writer's first commit cleans
    assert not past.exists() and not (root / "data" / "tokens" / "c" / "7").exists()
    assert not any(p.exists() for p in temps)
    assert foreign.exists(), "the cleanup reached into a folder the writer lock does not govern"
    fresh = BlockStore.open(root)
    assert fresh.verify_all() == [] and torch.equal(read_state(fresh, sid), kv) and sid2 in fresh.manifest.states


def test_open_and_info_read_no_block_metadata(tmp_path):
    gen = torch.Generator().manual_seed(15)
    store = make_store(tmp_path / "s")
    for i in range(5):
        _commit_doc(store, gen, 9, f"doc{i}")
    s = BlockStore.open(tmp_path / "s")
    info = describe(s)
    assert s.loaded_metadata_chunks == 0
    assert info["blocks"] == 15 and info["stored_tokens"] == 45 and info["documents"] == 5
    s.block_meta([0])
    assert s.loaded_metadata_chunks == 1


def test_snapshots_bound_what_an_open_reads(tmp_path, monkeypatch):
    gen = torch.Generator().manual_seed(16)
    root = tmp_path / "s"
    store = make_store(root)
    kept = {}
    for i in range(SNAPSHOT_EVERY + 5):
        t, kv = random_state(gen, 1 + i % 6)
        kept[commit_state(store, t, kv)] = kv
    assert (root / "log" / f"snapshot-{SNAPSHOT_EVERY:08d}.json").is_file()
    opened: list[str] = []
    real = log_mod._read_text
    monkeypatch.setattr(log_mod, "_read_text", lambda f, key: opened.append(key) or real(f, key))
    m = read_manifest(LocalFiles(root))
    assert len(opened) <= 2 + 5 + 1              # header, snapshot, the records after it, one miss
    assert m.commit == SNAPSHOT_EVERY + 5 and sorted(m.states) == sorted(kept)
    assert m.ranges == store.manifest.ranges
    fresh = BlockStore.open(root)
    for sid, kv in list(kept.items())[::10]:
        assert torch.equal(read_state(fresh, sid), kv)


def test_damaged_commit_record_is_an_error_not_a_silent_rollback(tmp_path):
    gen = torch.Generator().manual_seed(17)
    root = tmp_path / "s"
    store = make_store(root)
    commit_state(store, *random_state(gen, 5))
    commit_state(store, *random_state(gen, 5))
    rec = root / "log" / "00000002.json"
    rec.write_text(rec.read_text()[:-10])
    with pytest.raises(StoreCorruptError, match="00000002.json"):
        BlockStore.open(root)


def test_verified_meta_catches_moved_positions(tmp_path):
    gen = torch.Generator().manual_seed(18)
    root = tmp_path / "s"
    store = make_store(root)
    commit_state(store, *random_state(gen, 9))
    import zarr
    pos = zarr.open_array(str(root / "data" / "positions"), mode="r+")
    row = pos[1]
    pos[1] = row + 100                                    # a block claims to sit 100 tokens later
    fresh = BlockStore.open(root)
    fresh.verified_meta([0, 2])
    with pytest.raises(StoreCorruptError, match="does not match"):
        fresh.verified_meta([1])


def test_gc_reclaims_unreferenced_blocks_and_keeps_the_rest(tmp_path):
    gen = torch.Generator().manual_seed(19)
    root = tmp_path / "s"
    store = make_store(root, shard_blocks=2)
    keep_rows, _, keep_kv = _commit_doc(store, gen, 9, "keep")          # rows 0..2
    drop_rows, _, _ = _commit_doc(store, gen, 13, "drop")               # rows 4..7
    also_rows, _, _ = _commit_doc(store, gen, 3, "also")                # row 8: shares a shard with nothing
    reader = BlockStore.open(root)                       # a reader that saw "drop"
    reader.read_kv(drop_rows)
    store.commit(lambda s: Change(removed_docs=("drop",)))
    assert store.gc(grace_s=3600).blocks_freed == 0      # too recent: maybe a document being added
    data_bytes = lambda: sum(p.stat().st_size for p in (root / "data").rglob("*") if p.is_file())  # noqa: E731
    before = data_bytes()
    report = store.gc(grace_s=0)
    assert report.blocks_freed == len(drop_rows) == 4 and report.bytes_freed > 0 and report.files_removed > 0
    assert data_bytes() == before - report.bytes_freed
    fresh = BlockStore.open(root)
    assert fresh.verify_all() == [] and fresh.n_blocks == 4
    kv, _ = fresh.read_kv(keep_rows + also_rows)
    assert torch.equal(kvops.from_storage(fresh.read_state_kv(keep_rows), torch.float32), keep_kv)
    with pytest.raises(StoreCorruptError, match="reclaimed"):
        fresh.read_kv(drop_rows[:1])
    with pytest.raises(StoreCorruptError):               # a stale reader gets an error, never bytes
        reader.read_kv(drop_rows)
    reader.refresh()
    with pytest.raises(StoreCorruptError, match="reclaimed"):
        reader.read_kv(drop_rows)
    assert store.gc(grace_s=0).bytes_freed == 0


def test_gc_rewrites_a_shared_shard_and_resumes_after_a_crash(tmp_path, monkeypatch):
    gen = torch.Generator().manual_seed(20)
    root = tmp_path / "s"
    store = make_store(root, shard_blocks=4)
    tokens, kv = random_state(gen, 16)                                  # one shard, rows 0..3
    ids = hashing.chain_ids(store.manifest.fingerprint, tokens, C)

    def build(s):
        new, rows = s.plan_chain(ids, tokens, 0, -1, lambda i: kvops.to_storage(kv[:, :, :, i * C:(i + 1) * C]))
        return Change(new, {}, {"head": DocEntry(rows=rows[:2], n_tokens=8, segments=1),
                                "tail": DocEntry(rows=rows[2:], n_tokens=8, segments=1)})
    store.commit(build)
    store.commit(lambda s: Change(removed_docs=("tail",)))
    import kvmemory.store.shards as sh

    def crash(*a, **k):
        raise KeyboardInterrupt("killed after the freed record, before the rewrite")
    monkeypatch.setattr(sh, "rewrite_shard", crash)
    with pytest.raises(KeyboardInterrupt):
        store.gc(grace_s=0)
    monkeypatch.undo()
    fresh = BlockStore.open(root, read_only=False)
    assert fresh.n_blocks == 2 and fresh.verify_all() == []
    report = fresh.gc(grace_s=0)                         # the next gc finds the bytes still on disk
    assert report.blocks_freed == 0 and report.files_rewritten == 1 and report.bytes_freed > 0
    again = BlockStore.open(root)
    assert again.verify_all() == []
    assert torch.equal(kvops.from_storage(again.read_state_kv([0, 1]), torch.float32), kv[:, :, :, :8])
    import zarr                                          # the rewritten shard is still a valid Zarr shard
    arr = zarr.open_array(str(root / "data" / "kv"), mode="r")
    assert np.array_equal(arr[1][:, :, :, :C], kvops.to_storage(kv[:, :, :, C:2 * C]))
    assert not np.any(arr[2])                             # reclaimed: fill
