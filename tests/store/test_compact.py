"""The compact tier: `kvmemory compact` / Memory.compact, a lossy (bf16, fp16) copy of an exact store
with every block's error measured against its exact KV, reported by every graft, never written to."""

import json
import random

import numpy as np
import pytest
import torch

import kvmemory
from kvmemory.errors import CompactStoreError, InputError, StoreCorruptError, StoreExistsError
from kvmemory.store import BlockStore, encoding as encodings
from kvmemory.store.manifest import MANIFEST_NAME

ENCODINGS = ("bf16", "fp16")
UNIT = {"bf16": 2.0 ** -8, "fp16": 2.0 ** -11}    # largest relative rounding error a word (round to nearest)
TINY = {"bf16": 0.0, "fp16": 2.0 ** -25}          # fp16's subnormals: half its smallest step, absolute


def _exact_store(path, model):
    mem = kvmemory.Memory(path, model=model)
    rng = random.Random(7)
    base = [rng.randrange(100, 5000) for _ in range(300)]
    sids = [mem.save(x).id for x in (base, base + [rng.randrange(100, 5000) for _ in range(90)], base[:40])]
    mem.add(" ".join(f"Entry {i}: the vault code of room {i} is {rng.randrange(10**5)}." for i in range(120)),
            doc_id="vault")
    return mem, sids


@pytest.fixture(scope="module")
def pair(tmp_path_factory, tiny):
    d = tmp_path_factory.mktemp("compact")
    mem, sids = _exact_store(d / "exact.kvm", tiny)
    reports = {e: mem.compact(d / f"{e}.kvm", e) for e in ENCODINGS}
    return d, mem, sids, reports


@pytest.mark.parametrize("enc", ENCODINGS)
def test_a_compact_copy_is_half_the_bytes_and_every_block_is_its_exact_block_rounded(pair, tiny, enc):
    d, mem, sids, reports = pair
    rep = reports[enc]
    assert rep.blocks == mem.store.n_blocks and rep.tokens == mem.store.manifest.stored_tokens
    assert 0.45 < rep.disk_bytes / rep.source_disk_bytes < 0.56 and rep.bytes_saved > 0
    assert rep.chains >= 3 and 0 < rep.kl_max and rep.kl_mean <= rep.kl_max
    with kvmemory.Memory(d / f"{enc}.kvm", model=tiny, read_only=True) as c:
        info = c.info()
        assert info["encoding"] == enc and info["blocks"] == mem.store.n_blocks
        m = mem.store.manifest
        assert info["bytes_saved"] == m.n_blocks * m.block_tokens * info["kv_bytes"] // m.stored_tokens // 2
        err = info["encoding_error"]
        assert err["blocks"] == m.n_blocks and err["kl_max"] == pytest.approx(rep.kl_max, rel=1e-6)
        assert 0 < err["key_rel_error_max"] <= UNIT[enc] and 0 < err["value_rel_error_max"] <= UNIT[enc]
        rows = m.committed_rows()
        exact, n = mem.store.read_kv(rows)
        got, n2 = c.store.read_kv(rows)
        assert list(n) == list(n2) and got.dtype == np.float32
        # each word is its exact word rounded to nearest: within half a step of the narrow format
        assert np.all(np.abs(got - exact) <= np.abs(exact) * UNIT[enc] + TINY[enc])
        assert not np.array_equal(got, exact)
        for sid in sids:                      # the same states, by the same ids, with their error
            st, ex = c.load(sid), mem.load(sid)
            assert st.token_ids == ex.token_ids and ex.encoding_error is None
            assert st.encoding_error["encoding"] == enc and st.encoding_error["kl_max"] <= rep.kl_max
            assert torch.allclose(st.kv, ex.kv, rtol=UNIT[enc], atol=TINY[enc])
        # E1 over the encoded words; E2: every block recomputed and encoded again is the stored words
        assert c.store.verify_all() == [] and c.verify(recompute=True) == []


def test_every_graft_from_a_compact_store_reports_its_error_and_an_exact_store_says_exact(pair, tiny):
    d, mem, _, reports = pair
    q = "What is the vault code of room 17?"
    exact = mem.ask(q, max_new_tokens=4)
    assert exact.stats["encoding"] == "exact" and exact.stats["encoding_error"] is None
    with kvmemory.Memory(d / "bf16.kvm", model=tiny, read_only=True) as c:
        a = c.ask(q, max_new_tokens=4)
        err = a.stats["encoding_error"]
        assert a.stats["encoding"] == "bf16" and err["encoding"] == "bf16"
        assert err["blocks"] >= a.stats["blocks"] and 0 < err["kl_max"] <= reports["bf16"].kl_max
        assert a.sources == exact.sources           # the same selection: the copied indexes, the same rows


def test_an_exact_store_keeps_its_header_and_a_compact_one_names_its_encoding(pair):
    d, mem, _, _ = pair
    assert "encoding" not in json.loads((d / "exact.kvm" / MANIFEST_NAME).read_text())
    assert json.loads((d / "fp16.kvm" / MANIFEST_NAME).read_text())["encoding"] == "fp16"
    assert mem.store.error_report(mem.store.manifest.committed_rows()) is None


def test_a_compact_store_takes_no_new_blocks_and_loses_nothing(pair, tiny):
    d, _, sids, _ = pair
    with kvmemory.Memory(d / "bf16.kvm", model=tiny) as c:
        before = c.store.manifest.commit
        with pytest.raises(CompactStoreError, match="kvmemory compact"):
            c.save([11, 12, 13] * 100)
        with pytest.raises(CompactStoreError):
            c.add("a new document that would need new blocks " * 20, doc_id="new")
        with pytest.raises(CompactStoreError, match="E3"):
            c.audit(2)
        with pytest.raises(InputError, match="already compact"):
            c.compact(d / "again.kvm")
        assert c.save(c.load(sids[2]).token_ids).id == sids[2]    # all its blocks are there: nothing new
        assert c.store.manifest.commit == before and not (d / "again.kvm").exists()
        assert len(c.states()) == len(sids) + 1 and [x.doc_id for x in c.docs()] == ["vault"]


def test_bad_requests_are_typed_errors_and_a_failed_compaction_leaves_nothing(pair, tmp_path, monkeypatch):
    _, mem, _, _ = pair
    with pytest.raises(InputError, match="encoding must be"):
        mem.compact(tmp_path / "x.kvm", "int3")
    with pytest.raises(InputError, match="lossy"):
        mem.compact(tmp_path / "x.kvm", "exact")
    with pytest.raises(InputError, match="local directory"):
        mem.compact("s3://bucket/cold")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    with pytest.raises(StoreExistsError):
        mem.compact(tmp_path / "full")
    assert (tmp_path / "full" / "keep.txt").read_text() == "mine"
    calls = []
    real = encodings.Encoding.encode

    def failing(self, words):
        calls.append(1)
        if len(calls) > 3:
            raise encodings.EncodingRangeError("simulated: a word out of range")
        return real(self, words)
    monkeypatch.setattr(encodings.Encoding, "encode", failing)
    with pytest.raises(encodings.EncodingRangeError):
        mem.compact(tmp_path / "y.kvm", "fp16")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["full"]     # no store, no half-built directory
    assert mem.store.verify_all() == []


def test_fp16_refuses_words_it_cannot_hold_and_bf16_keeps_the_range():
    e16, bf = encodings.get("fp16", "float32"), encodings.get("bf16", "float32")
    big = np.array([1.0, -70000.0, 3.0], np.float32)
    with pytest.raises(encodings.EncodingRangeError, match="65504"):
        e16.encode(big)
    assert bf.roundtrip(big)[1] == -70144.0 or abs(bf.roundtrip(big)[1] + 70000) <= 70000 * 2 ** -8
    with pytest.raises(encodings.EncodingRangeError, match="finite"):
        bf.encode(np.array([np.inf], np.float32))
    x = np.random.default_rng(3).standard_normal(10_000).astype(np.float32)
    for e in (e16, bf):                  # deterministic; decoding is exact (a second roundtrip is the first)
        assert np.array_equal(e.encode(x), e.encode(x)) and np.array_equal(e.roundtrip(e.roundtrip(x)), e.roundtrip(x))
    with pytest.raises(InputError, match="fp32"):
        encodings.get("bf16", "bfloat16")


def test_a_damaged_compact_block_fails_its_digest(pair, tmp_path, tiny):
    import shutil
    d, mem, sids, _ = pair
    shutil.copytree(d / "bf16.kvm", tmp_path / "c.kvm")
    store = BlockStore.open(tmp_path / "c.kvm")
    shard = sorted((tmp_path / "c.kvm" / "data" / "kv" / "c").iterdir())[0]
    f = next(p for p in shard.rglob("*") if p.is_file())
    raw = bytearray(f.read_bytes())
    raw[1000] ^= 0x40
    f.write_bytes(bytes(raw))
    bad = store.verify_all()
    assert bad and "digest" in bad[0][1]
    with pytest.raises(StoreCorruptError, match="digest"):
        store.read_kv([bad[0][0]])


def test_the_command_line_compacts_and_shows_the_bytes_saved_and_the_error(pair, tmp_path, tiny_dir):
    from tests.clirun import run
    d, _, sids, _ = pair
    r = run("compact", d / "exact.kvm", tmp_path / "c.kvm", "--model", tiny_dir, "--json")
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    assert rep["encoding"] == "fp16" and rep["bytes_saved"] > 0 and rep["kl_max"] > 0
    out = run("info", tmp_path / "c.kvm").stdout.decode()
    assert "fp16" in out and "bytes_saved" in out and "next-token KL <=" in out
    r = run("generate", tmp_path / "c.kvm", sids[0][:12], "Hello", "--model", tiny_dir, "--max-new-tokens", "3")
    assert r.returncode == 0 and b"fp16-encoded" in r.stderr
    r = run("audit", tmp_path / "c.kvm", "--model", tiny_dir)
    assert r.returncode == 1 and b"E3 holds for exact stores only" in r.stderr
    r = run("compact", d / "exact.kvm", tmp_path / "c.kvm", "--model", tiny_dir)
    assert r.returncode == 1 and b"not empty" in r.stderr


def test_a_served_compact_store_answers_with_its_error_and_refuses_writes_with_409(pair, tiny):
    import httpx

    from kvmemory.server import create_app
    from tests.server.test_server import _start
    d, _, _, _ = pair
    mem = kvmemory.Memory(d / "fp16.kvm", model=tiny)
    srv, t, url = _start(create_app(mem))
    try:
        r = httpx.post(url + "/v1/ask", json={"question": "What is the vault code of room 3?", "max_new_tokens": 3},
                       timeout=60)
        assert r.status_code == 200, r.text
        stats = r.json()["stats"]
        assert stats["encoding"] == "fp16" and stats["encoding_error"]["kl_max"] > 0
        r = httpx.post(url + "/v1/chat/completions", timeout=60, json={
            "model": "kvmemory", "max_tokens": 3, "messages": [{"role": "user", "content": "a new conversation " * 5}]})
        assert r.status_code == 409 and r.json()["error"]["code"] == "compact_store", r.text
    finally:
        srv.should_exit = True
        t.join(timeout=10)
        mem.close()


def test_a_compact_store_still_drops_documents_and_states_and_gc_keeps_it_whole(pair, tmp_path, tiny):
    import shutil
    d, _, sids, _ = pair
    shutil.copytree(d / "fp16.kvm", tmp_path / "c.kvm")
    with kvmemory.Memory(tmp_path / "c.kvm", model=tiny) as c:
        kept = c.load(sids[0]).kv
        c.remove("vault")
        assert c.forget_states([sids[1]]) == 1 and c.docs() == []
        c.gc(grace_s=0)
        assert c.store.verify_all() == [] and c.verify(recompute=True) == []
        assert torch.equal(c.load(sids[0]).kv, kept) and c.info()["encoding"] == "fp16"
