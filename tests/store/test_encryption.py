"""Encryption at rest (kvmemory/store/seal.py, kvmemory/keys.py): nothing of a user's words is found
in an encrypted store's files (and everything is found in a plain one's, so the scan can fail); a
copy taken before a forget cannot be read for the forgotten user afterwards; exactness, verify and
audit hold; a flipped byte, a wrong or missing key is a typed error that changes nothing."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from kvmemory.errors import InputError, KeyDestroyedError, StoreCorruptError, StoreKeyError, WrongKeyError
from kvmemory.keys import LocalKeyProvider, new_master_key, parse_master_key

SECRET = "My locker code is zebra-quartz-7731 and my cat is called Pomegranate."
OTHER = "I am allergic to walnuts and I cycle to work along the Vltava every morning."


def provider(ring: Path, master: str | None = None) -> LocalKeyProvider:
    return LocalKeyProvider(ring, parse_master_key(master or MASTER, "test"))


MASTER = new_master_key()


@pytest.fixture
def ring(tmp_path) -> Path:
    return tmp_path / "keyring"


def tell(cm, text: str, session: str = "s1") -> None:
    cm.remember([{"role": "user", "content": text}, {"role": "assistant", "content": "Noted."}], session=session)


def files_of(root: Path) -> list[Path]:
    return [p for p in Path(root).rglob("*") if p.is_file()]


def contents(data: bytes) -> list[bytes]:
    """A file's bytes, and decompressed too where it is a zstd frame (Zarr's metadata chunks)."""
    out = [data]
    if data[:4] == b"\x28\xb5\x2f\xfd":
        from numcodecs import Zstd                  # zarr's own codec package
        out.append(bytes(Zstd().decode(data)))
    return out


def scan(blobs: list[bytes], needles: dict[str, bytes]) -> set[str]:
    """Which needles occur in any of the blobs (the word: in any case)."""
    found = set()
    for data in blobs:
        for part in contents(data):
            low = part.lower()
            for name, needle in needles.items():
                if needle in (low if name == "word" else part):
                    found.add(name)
    return found


def secret_needles(mem, cm) -> dict[str, bytes]:
    """The secret as a word (its BM25 term, in its text too), as its token ids, and as the bytes of its block's KV."""
    store = mem.store
    (hit,) = [r for r in cm.recall("locker code cat", k=3) if "Pomegranate" in r.text]
    row = hit.rows[-1]
    n = int(store.block_meta([row])["n_tokens"][0])
    toks = np.asarray(store.block_meta([row])["tokens"][0][:n], "<i4")
    kv, _ = store.read_kv([row])
    from kvmemory.index.lexical import terms
    return {"word": terms("Pomegranate")[0].encode(), "token ids": toks[n - 12:n - 2].tobytes(),
            "kv bytes": np.ascontiguousarray(kv[0][0, 0, 0, n - 4]).tobytes()}


@pytest.mark.parametrize("encrypt", [False, True])
def test_a_scan_of_every_file_finds_the_secret_only_where_it_is_not_encrypted(make_memory, ring, encrypt):
    mem = make_memory(encrypt=encrypt, keys=provider(ring) if encrypt else None)
    mem.add("A shared handbook: the office opens at nine and the canteen serves soup on Fridays.")
    alice, bob = mem.chat_memory("alice"), mem.chat_memory("bob")
    tell(alice, SECRET)
    tell(bob, OTHER)
    state = mem.save("Earlier: " + SECRET, owner=alice.key)
    needles = secret_needles(mem, alice)
    found = scan([p.read_bytes() for p in files_of(mem.path)], needles)
    if encrypt:
        assert found == set(), f"found {found} in an encrypted store"
        assert not any(ring.resolve() in p.resolve().parents for p in files_of(mem.path))
    else:
        assert found == set(needles)               # the scan finds what is there
    assert torch.equal(mem.load(state.id).kv, state.kv)


def test_a_copy_taken_before_a_forget_cannot_be_read_for_the_forgotten_user(make_memory, tmp_path, ring):
    keys = provider(ring)
    mem = make_memory(encrypt=True, keys=keys)
    alice, bob = mem.chat_memory("alice"), mem.chat_memory("bob")
    tell(alice, SECRET)
    tell(bob, OTHER)
    a_state = mem.save("Earlier: " + SECRET, owner=alice.key)
    b_state = mem.save("Earlier: " + OTHER, owner=bob.key)
    a_rows = [r for d, e in mem.store.manifest.docs.items() if d.startswith("user:" + alice.key) for r in e.rows]
    backup = tmp_path / "backup.kvm"
    shutil.copytree(mem.path, backup)               # a backup (or an S3 version) taken before the forget
    assert alice.forget().turns == 1
    assert alice.recall("locker code") == []
    mem.close()

    import kvmemory
    old = kvmemory.Memory(backup, model=(mem.model, mem.tokenizer), read_only=True, keys=provider(ring))
    try:
        with pytest.raises(KeyDestroyedError):
            old.load(a_state.id)
        with pytest.raises(KeyDestroyedError):
            old.store.read_kv(a_rows)
        with pytest.raises(KeyDestroyedError):
            old.chat_memory("alice").recall("locker code")
        assert torch.equal(old.load(b_state.id).kv, b_state.kv)      # bob's, bit for bit
        assert [r.text for r in old.chat_memory("bob").recall("walnuts")][0].endswith(OTHER + "\n")
    finally:
        old.close()


def test_exactness_verify_and_audit_hold_on_an_encrypted_store(make_memory, ring):
    enc = make_memory("enc.kvm", encrypt=True, keys=provider(ring))
    plain = make_memory("plain.kvm")
    text = "The quick brown fox jumps over the lazy dog near the river bank. " * 25
    a, b = enc.save(text), plain.save(text)
    assert a.id == b.id and a.n_tokens > 256                     # whole and partial blocks
    got = enc.load(a.id).kv
    assert torch.equal(got, plain.load(b.id).kv) and torch.equal(got, a.kv)   # the same bytes as unencrypted
    assert enc.verify() == [] and enc.verify(recompute=True) == []
    _, rows = enc.audit(samples=2, seed=1)
    assert rows and all(r.ok for r in rows)


def test_a_flipped_ciphertext_byte_is_caught_and_names_the_block(make_memory, ring):
    mem = make_memory(encrypt=True, keys=provider(ring))
    st = mem.save("Some words that fill a block or two of the store. " * 8)
    store = mem.store
    row = store.row_of(bytes.fromhex(st.id))
    shard = next(p for p in files_of(mem.path / "data" / "kv" / "c") if p.stat().st_size > 1000)
    data = bytearray(shard.read_bytes())
    data[100] ^= 0x01
    shard.write_bytes(bytes(data))
    mem.rt.handle.forget_blocks(store.manifest.committed_rows())
    with pytest.raises(StoreCorruptError, match="block [0-9a-f]{32}"):
        store.read_kv(store.chain(row))
    assert mem.verify()                                   # reported, row by row
    # the GCM tag is checked after the digest: a seal row that does not match its ciphertext
    meta = store.block_meta([row])
    seal = meta["seal"][0].copy()
    seal[30] ^= 0x01
    kv = np.zeros((1,), np.uint8)
    with pytest.raises(StoreCorruptError, match="authentication tag"):
        store.sealer.open_kv(seal, meta["block_id"][0].tobytes(), kv, "test block")


def tree_digest(root: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(files_of(root)):
        if p.name != ".lock":
            h.update(str(p.relative_to(root)).encode() + p.read_bytes())
    return h.hexdigest()


def test_a_wrong_or_missing_master_key_refuses_to_open_and_changes_nothing(make_memory, tmp_path, ring, monkeypatch):
    mem = make_memory(encrypt=True, keys=provider(ring))
    mem.save("Private words.")
    path, model = mem.path, (mem.model, mem.tokenizer)
    mem.close()
    before, ring_before = tree_digest(path), tree_digest(ring)
    import kvmemory
    with pytest.raises(WrongKeyError, match="master key"):
        kvmemory.Memory(path, model=model, keys=provider(ring, new_master_key()))
    for var in ("KVMEMORY_KEYRING", "KVMEMORY_MASTER_KEY", "KVMEMORY_MASTER_KEY_FILE"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(StoreKeyError, match="KVMEMORY_KEYRING"):
        kvmemory.Memory(path, model=model)
    with pytest.raises(StoreKeyError, match="no key"):
        kvmemory.Memory(path, model=model, keys=provider(tmp_path / "another-ring"))
    with pytest.raises(StoreKeyError, match="apart"):
        kvmemory.Memory(tmp_path / "outer" / "x.kvm", model=model, encrypt=True, keys=provider(tmp_path / "outer"))
    assert tree_digest(path) == before and tree_digest(ring) == ring_before
    # the environment's provider: the same keys open it
    monkeypatch.setenv("KVMEMORY_KEYRING", str(ring))
    key_file = tmp_path / "master.key"
    key_file.write_text(MASTER + "\n")
    monkeypatch.setenv("KVMEMORY_MASTER_KEY_FILE", str(key_file))
    with kvmemory.Memory(path, model=model) as again:
        assert [s.n_tokens for s in again.states()] == [len(again.tokenize("Private words."))]
    with pytest.raises(InputError, match="not encrypted"):
        kvmemory.Memory(tmp_path / "plain.kvm", model=model).close()
        kvmemory.Memory(tmp_path / "plain.kvm", model=model, encrypt=True)


def test_rotating_the_master_key_rewraps_the_data_keys_and_leaves_the_data(make_memory, ring):
    import kvmemory
    mem = make_memory(encrypt=True, keys=provider(ring))
    st = mem.save("Rotate me.")
    path, model = mem.path, (mem.model, mem.tokenizer)
    mem.close()
    before = tree_digest(path)
    new = new_master_key()
    assert provider(ring).rotate(parse_master_key(new, "new")) == len(provider(ring, new).names()) >= 1
    assert tree_digest(path) == before                            # the data was not touched
    with pytest.raises(WrongKeyError):
        provider(ring)                                            # the old master key no longer opens it
    with kvmemory.Memory(path, model=model, keys=provider(ring, new)) as again:
        assert torch.equal(again.load(st.id).kv, st.kv)


@pytest.mark.parametrize("encrypt", [False, True])
def test_two_users_sending_the_same_prefix_each_write_it_and_read_only_their_own(make_memory, ring, encrypt):
    mem = make_memory(encrypt=encrypt, keys=provider(ring) if encrypt else None)
    store = mem.store
    written: list[int] = []
    read: list[list[int]] = []
    append, read_state = store._append, store.read_state_kv

    def counting_append(start, blocks):
        written.append(len(blocks))
        return append(start, blocks)

    def recording_read(rows):
        read.append(list(rows))
        return read_state(rows)
    store._append, store.read_state_kv = counting_append, recording_read
    text = "The same long system prompt that both users send first. " * 30
    a = mem.save(text, owner="alice")
    b = mem.save(text, owner="bob")
    assert len(written) == 2 and written[0] == written[1] > 1          # bob's write did all of alice's work
    a_rows = set(store.chain(store.manifest.states[a.id].last_row))
    b_rows = set(store.chain(store.manifest.states[b.id].last_row))
    assert not a_rows & b_rows
    read.clear()
    mem.rt.handle.forget_blocks(list(a_rows | b_rows))
    assert torch.equal(mem.load(b.id).kv, b.kv)
    assert read and all(set(r) <= b_rows for r in read)                 # bob's read touched none of alice's
    mem.save(text + " And more.", owner="bob")
    assert all(set(r) <= b_rows for r in read)


def test_a_forget_cut_short_after_its_key_was_destroyed_is_finished_by_the_next_open(make_memory, ring):
    import kvmemory
    mem = make_memory(encrypt=True, keys=provider(ring))
    alice, bob = mem.chat_memory("alice"), mem.chat_memory("bob")
    tell(alice, SECRET)
    tell(bob, OTHER)
    key = alice.key
    path, model = mem.path, (mem.model, mem.tokenizer)
    assert (path / "users" / key).is_dir()
    mem.store.sealer.destroy(key)                  # the commit point, then a crash
    mem.close()
    with kvmemory.Memory(path, model=model, keys=provider(ring)) as again:
        assert not any(d.startswith(f"user:{key}:") for d in again.store.manifest.docs)
        assert not (path / "users" / key).exists()
        assert again.chat_memory("bob").recall("walnuts")
        assert again.verify() == []               # the forgotten blocks await gc; nothing is bad
        again.gc(grace_s=0)
        tell(again.chat_memory("alice"), "A new start.")      # a returning user gets a new key
        assert again.chat_memory("alice").recall("new start")[0].text.endswith("A new start.\n")


def test_the_command_line_creates_opens_and_rotates_an_encrypted_store(tmp_path, tiny_dir):
    import os

    from tests.cli.test_cli import _one_line_error, run
    r = run("keys", "new")
    master = r.stdout.decode().strip()
    assert r.returncode == 0 and len(bytes.fromhex(master)) == 32
    env = {**os.environ, "KVMEMORY_KEYRING": str(tmp_path / "ring"), "KVMEMORY_MASTER_KEY": master}
    store, text = tmp_path / "s.kvm", tmp_path / "t.txt"
    text.write_text("The lighthouse keeper wrote in the log every night. " * 8)

    def kvm(*args, env=env):
        return run(*args, env=env)
    r = kvm("save", store, text, "--model", tiny_dir, "--encrypt")
    assert r.returncode == 0, r.stderr
    r = kvm("info", store, "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["encryption"] == "AES-256-GCM"
    assert kvm("verify", store, "--recompute", "--model", tiny_dir).returncode == 0
    bare = {k: v for k, v in env.items() if not k.startswith("KVMEMORY_MASTER")}
    assert "KVMEMORY_MASTER_KEY" in _one_line_error(kvm("info", store, env=bare))
    new = tmp_path / "new.key"
    new.write_text(run("keys", "new").stdout.decode())
    assert kvm("keys", "rotate", "--new-key-file", new).returncode == 0
    assert "master key" in _one_line_error(kvm("info", store))
    assert kvm("verify", store, env={**env, "KVMEMORY_MASTER_KEY": new.read_text().strip()}).returncode == 0
    assert "--new-key-file" in _one_line_error(kvm("keys", "rotate"))


def test_the_keyring_creates_destroys_and_refuses_damaged_keys(tmp_path, ring):
    keys = provider(ring)
    a = keys.create("store1-aa")
    assert keys.get("store1-aa") == a == keys.create("store1-aa") and len(a) == 32
    assert keys.get("store1-bb") is None and not keys.destroyed("store1-bb")
    assert a.hex() not in "".join(p.read_text() for p in ring.glob("*"))      # wrapped, never in plain
    assert keys.destroy("store1-aa") and keys.get("store1-aa") is None and keys.destroyed("store1-aa")
    b = keys.create("store1-aa")                     # a returning owner: a new key, the tombstone cleared
    assert b != a and not keys.destroyed("store1-aa")
    (ring / "store1-aa.key").write_text((ring / "store1-aa.key").read_text().replace('"key": "', '"key": "00'))
    with pytest.raises(WrongKeyError):
        keys.get("store1-aa")
    with pytest.raises(InputError):
        keys.get("../escape")
    with pytest.raises(StoreKeyError, match="64 hex digits"):
        parse_master_key("not a key", "KVMEMORY_MASTER_KEY")


def test_a_users_sealed_indexes_written_in_several_writes_reload_from_disk(make_memory, ring):
    import kvmemory
    mem = make_memory(encrypt=True, keys=provider(ring))
    alice = mem.chat_memory("alice")
    for i, fact in enumerate(["I keep bees on the roof.", SECRET, "My sister lives in Porto."]):
        tell(alice, fact, session=f"s{i}")             # later writes append to the sealed BM25 log
    index = mem.path / "users" / alice.key / "index"
    assert any(p.name.endswith(".log") for p in index.iterdir())
    path, model = mem.path, (mem.model, mem.tokenizer)
    mem.close()
    with kvmemory.Memory(path, model=model, read_only=True, keys=provider(ring)) as again:
        docs = again.chat_memory("alice").docs
        assert len(docs.index("bm25").ids()) == len(docs._load_index("bm25").ids()) > 0     # read, not rebuilt
        assert "Pomegranate" in again.chat_memory("alice").recall("what is my cat called", k=1)[0].text
