"""The store on an S3-compatible object store (moto's server on 127.0.0.1): the same round trip,
digest checks and commit protocol as a local store, two committers without a lock, the local
disk cache tier, and Memory / CLI / library on an s3:// URL."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import kvmemory
from kvmemory.errors import InputError, StoreCorruptError, StoreError
from kvmemory.store.manifest import Manifest
from kvmemory.store import BlockStore
from kvmemory.store import commit as zarr_store
from kvmemory.store.files import open_files
from tests.store.test_block_store import C, D, H, L, commit_state, random_state, read_state

REPO = Path(__file__).resolve().parents[2]


def make_remote(url, work, kv_dtype="float32", codec="none", shard_blocks=2, cache_bytes=8 << 30):
    m = Manifest(fingerprint="kvm1-test", block_tokens=C, shard_blocks=shard_blocks, codec=codec, kv_dtype=kv_dtype,
                 model={"name": "synthetic", "layers": L, "kv_heads": H, "head_dim": D, "max_positions": 64})
    return BlockStore.create_remote(open_files(url), Path(work), m, lock_timeout_s=10, cache_bytes=cache_bytes)


def open_remote(url, work, cache_bytes=8 << 30):
    return BlockStore(Path(work), files=open_files(url), lock_timeout_s=10, cache_bytes=cache_bytes)


def _bytes(t):
    return t.contiguous().view(-1).view(torch.uint8)


def test_an_s3_store_lives_in_its_bucket_and_reads_through_the_disk_tier(s3, tmp_path):
    """What only an object store has (the byte round trip itself is the conformance suite's): the
    store's objects in the bucket, shard claims, nothing of it on local disk but the disk tier."""
    gen = torch.Generator().manual_seed(0)
    store = make_remote(s3.url(), tmp_path / "w1")
    states = {commit_state(store, *random_state(gen, n)): n for n in (1, 5, 9, 16)}
    keys = s3.keys()
    assert "store/manifest.json" in keys and "store/log/00000004.json" in keys
    assert any(k.startswith("store/data/kv/c/") for k in keys) and any(k.startswith("store/claims/") for k in keys)
    assert not (tmp_path / "w1" / "data").exists()          # nothing of the store itself on local disk
    again = open_remote(s3.url(), tmp_path / "w2")
    for sid in list(states) * 2:                            # the second pass: from local copies
        read_state(again, sid)
    assert again.cache.stats.shards_fetched > 0 and again.cache.stats.hits > 0


def test_a_flipped_byte_in_an_object_is_an_error_and_a_flipped_copy_is_fetched_again(s3, tmp_path):
    gen = torch.Generator().manual_seed(1)
    store = make_remote(s3.url(), tmp_path / "w1")
    tokens, kv = random_state(gen, 7)
    sid = commit_state(store, tokens, kv)
    reader = open_remote(s3.url(), tmp_path / "w2")
    assert torch.equal(read_state(reader, sid), kv)
    # damage the local copy: the read drops it, fetches the object again and succeeds
    copies = [p for p in (tmp_path / "w2" / "cache").rglob("*") if p.is_file()]
    assert copies
    data = bytearray(copies[0].read_bytes())
    data[len(data) // 4] ^= 0x01
    copies[0].write_bytes(bytes(data))
    fetched = reader.cache.stats.shards_fetched
    assert torch.equal(read_state(reader, sid), kv)
    assert reader.cache.stats.shards_fetched == fetched + 1
    # damage the object itself: every reader gets StoreCorruptError naming the block, never bytes
    key = next(k for k in s3.keys("store/data/kv/c/"))
    obj = bytearray(s3.client.get_object(Bucket=s3.bucket, Key=key)["Body"].read())
    obj[len(obj) // 4] ^= 0x01
    s3.client.put_object(Bucket=s3.bucket, Key=key, Body=bytes(obj))
    fresh = open_remote(s3.url(), tmp_path / "w3")
    rows = fresh.chain(fresh.manifest.states[sid].last_row)
    with pytest.raises(StoreCorruptError, match="digest"):
        fresh.read_state_kv(rows)
    with pytest.raises(StoreCorruptError, match="digest"):
        fresh.read_kv(rows)
    assert fresh.verify_all() != []


def test_a_committer_that_loses_the_record_race_retries_on_the_next_commit(s3, tmp_path, monkeypatch):
    """Two writers on two machines: B commits between A's data and A's record. A's create of
    record 2 fails (If-None-Match), A takes B's commit and lands as record 3; nothing is lost."""
    gen = torch.Generator().manual_seed(3)
    a = make_remote(s3.url(), tmp_path / "wa")
    b = open_remote(s3.url(), tmp_path / "wb")
    commit_state(a, *random_state(gen, 3))
    b.refresh()
    ta, kva = random_state(gen, 10)
    tb, kvb = random_state(gen, 6)
    real = zarr_store.write_record
    raced = []

    def racing(files, rec):
        if not raced:
            raced.append(rec.commit)
            sids["b"] = commit_state(b, tb, kvb)      # lands first, as commit 2
        return real(files, rec)
    sids = {}
    with monkeypatch.context() as mp:
        mp.setattr(zarr_store, "write_record", racing)
        sids["a"] = commit_state(a, ta, kva)
    assert raced == [2] and a.manifest.commit == 3
    fresh = open_remote(s3.url(), tmp_path / "wc")
    assert fresh.manifest.commit == 3 and len(fresh.manifest.states) == 3
    assert torch.equal(read_state(fresh, sids["a"]), kva) and torch.equal(read_state(fresh, sids["b"]), kvb)
    ranges = [(s, s + len(ids) // 32) for s, ids, _ in fresh.manifest.ranges]
    assert all(e1 <= s2 for (_, e1), (s2, _) in zip(ranges, ranges[1:]))     # no two commits share a row
    assert fresh.verify_all() == []


def test_two_processes_committing_at_once_lose_nothing(s3, tmp_path):
    make_remote(s3.url(), tmp_path / "w0")
    script = textwrap.dedent(f"""
        import json, sys, torch
        sys.path.insert(0, {str(REPO)!r})
        from pathlib import Path
        from kvmemory.store import BlockStore
        from kvmemory.store.files import open_files
        from tests.store.test_block_store import commit_state, random_state
        who = int(sys.argv[1])
        store = BlockStore(Path(sys.argv[2]), files=open_files({s3.url()!r}), lock_timeout_s=60)
        gen = torch.Generator().manual_seed(100 + who)
        out = {{}}
        for i in range(8):
            tokens, kv = random_state(gen, 1 + (i * 5 + who * 3) % 11)
            sid = commit_state(store, tokens, kv)
            out[sid] = kv.contiguous().view(-1).view(torch.uint8).tolist()
        json.dump(out, open(sys.argv[3], "w"))
    """)
    procs = [subprocess.Popen([sys.executable, "-c", script, str(w), str(tmp_path / f"w{w + 1}"),
                               str(tmp_path / f"out{w}.json")], env=s3.env, cwd=REPO) for w in range(2)]
    for p in procs:
        assert p.wait(timeout=300) == 0
    fresh = open_remote(s3.url(), tmp_path / "check")
    assert fresh.manifest.commit == 16
    for w in range(2):
        for sid, raw in json.loads((tmp_path / f"out{w}.json").read_text()).items():
            got = read_state(fresh, sid)
            assert _bytes(got).tolist() == raw
    assert fresh.verify_all() == []


def test_the_disk_tier_keeps_its_byte_budget(s3, tmp_path):
    gen = torch.Generator().manual_seed(4)
    store = make_remote(s3.url(), tmp_path / "w1", shard_blocks=1)
    sids = [commit_state(store, *random_state(gen, 4)) for _ in range(6)]     # one shard object each
    reader = open_remote(s3.url(), tmp_path / "w2", cache_bytes=1)            # smaller than one shard
    for sid in sids:
        read_state(reader, sid)
    assert reader.cache.used_bytes == 0 and reader.cache.stats.evictions >= len(sids)
    roomy = open_remote(s3.url(), tmp_path / "w3", cache_bytes=1 << 30)
    for sid in sids + sids:
        read_state(roomy, sid)
    assert roomy.cache.stats.shards_fetched == len(sids) and roomy.cache.stats.hits >= len(sids)


def test_bad_object_store_locations_are_typed_errors(s3, tmp_path, tiny):
    for url, err in (("s3://", InputError), ("gs://bucket/x", InputError)):
        with pytest.raises(err):
            kvmemory.Memory(url, model=tiny)
    with pytest.raises(StoreError, match="no kvmemory store"):
        kvmemory.Memory(s3.url("absent"), model=tiny, read_only=True)
    with pytest.raises(InputError):
        kvmemory.Memory(tmp_path / "local.kvm", model=tiny, storage_options={"endpoint": "x"})


def test_memory_on_s3_deposits_asks_learns_and_reports_its_tiers(s3, tmp_path, tiny):
    url = s3.url("team/mem")
    text = " ".join(f"Fact {i}: the {['red', 'blue', 'green'][i % 3]} lamp number {i} stands in room {i * 7}."
                    for i in range(120))
    doc = tmp_path / "facts.txt"
    doc.write_text(text)
    with kvmemory.Memory(url, model=tiny, work_dir=tmp_path / "w1") as mem:
        mem.add_files([doc])
        e = mem.learn("What is 2 + 3?", "2 + 3 = 5.\nAnswer: 5", verify="answer:5")
        assert mem.info()["path"] == url and mem.info()["documents"] == 1
    keys = s3.keys("team/mem/")
    assert f"team/mem/library/{e.entry_id}.verified.json" in keys
    with kvmemory.Memory(url, model=tiny, work_dir=tmp_path / "w2") as mem:    # another machine
        res = mem.ask("Which room holds lamp number 42?", max_new_tokens=4)
        src = res.stats["blocks_from"]
        assert src["disk"] == src["disk_cache"] + src["object_store"] and src["object_store"] > 0
        assert res.stats["tiers"]["disk_cache"]["shards_fetched"] > 0
        again = mem.ask("Which room holds lamp number 42?", max_new_tokens=4)
        assert again.stats["blocks_from"]["host"] > 0            # the host tier serves a repeated question
        sol = mem.solve("What is 2 + 3?", verify="answer:5")
        assert sol.stats["repeated"] and sol.sources == [e.entry_id] and sol.verified
        st = mem.load(e.entry_id)
        assert st.n_tokens == e.n_tokens


def test_cli_works_on_an_s3_url(s3, tmp_path, tiny_dir):
    from tests.clirun import run
    doc = tmp_path / "note.txt"
    doc.write_text("The observatory on the hill was built in 1911 by the town council. " * 20)
    env = dict(s3.env, KVMEMORY_STORE_CACHE_DIR=str(tmp_path / "cli-work"))
    url = s3.url("cli")
    r = run("add", url, doc, "--model", tiny_dir, env=env)
    assert r.returncode == 0, r.stderr
    r = run("info", url, "--json", env=env)
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["path"] == url and info["documents"] == 1
    r = run("verify", url, "--model", tiny_dir, env=env)
    assert r.returncode == 0, r.stdout + r.stderr


def _etags(s3, prefix="store/"):
    out = {}
    for page in s3.client.get_paginator("list_objects_v2").paginate(Bucket=s3.bucket, Prefix=prefix):
        for o in page.get("Contents", []):
            out[o["Key"]] = o["ETag"]
    return out


def test_snapshots_on_s3_bound_what_an_open_reads(s3, tmp_path, monkeypatch):
    from kvmemory.store import log as log_mod
    from kvmemory.store.log import read_manifest
    from kvmemory.store.manifest import SNAPSHOT_EVERY

    gen = torch.Generator().manual_seed(6)
    store = make_remote(s3.url(), tmp_path / "w1", shard_blocks=1)
    kept = {}
    for i in range(SNAPSHOT_EVERY + 3):
        t, kv = random_state(gen, 1 + i % 3)
        kept[commit_state(store, t, kv)] = kv
    assert f"store/log/snapshot-{SNAPSHOT_EVERY:08d}.json" in s3.keys("store/log/")
    opened: list[str] = []
    real = log_mod._read_text
    monkeypatch.setattr(log_mod, "_read_text", lambda f, key: opened.append(key) or real(f, key))
    m = read_manifest(open_files(s3.url()))
    assert len(opened) <= 2 + 3 + 1 and m.commit == SNAPSHOT_EVERY + 3 and sorted(m.states) == sorted(kept)
    fresh = open_remote(s3.url(), tmp_path / "w2")
    for sid, kv in list(kept.items())[::16]:
        assert torch.equal(read_state(fresh, sid), kv)


def test_gc_on_s3_is_a_typed_error_and_changes_nothing(s3, tmp_path):
    gen = torch.Generator().manual_seed(7)
    store = make_remote(s3.url(), tmp_path / "w1")
    commit_state(store, *random_state(gen, 5))
    before = _etags(s3)
    with pytest.raises(StoreError, match="not supported"):
        store.gc(grace_s=0)
    assert _etags(s3) == before


@pytest.mark.real_model
def test_bench_library_tier_runs(tmp_path):
    """benchmarks/bench_library_tier.py end to end (its own moto server): warm solves take the
    examples' blocks from the pager's RAM tier, cold ones none, and the answers are the same."""
    root = Path(__file__).resolve().parents[2]
    p = subprocess.run([sys.executable, "benchmarks/bench_library_tier.py", "--problems", "2", "--seeded", "3",
                        "--out", str(tmp_path)], cwd=root, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(next(tmp_path.glob("library-tier-*.json")).read_text())
    assert res["same_answers"] and res["cold"]["blocks_from_ram"] == 0
    assert res["warm"]["blocks_from_ram"] >= 2 * 3                 # 2 problems, k = 3 examples of >= 1 block each
    assert res["warm"]["ttft_median"] > 0 and res["cold"]["ttft_median"] > 0
