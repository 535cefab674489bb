"""Salted chains: an owner's states (a user's conversations) are blocks of their own. The same prompt
saved by two owners is two chains with no id in common, each written in full (no cache hit, no
shorter commit), with the same KV bytes; the roots are replayed from the log and from a snapshot,
every id still re-derives from what the store holds, and gc of one owner leaves the other's."""

import pytest
import torch

import kvmemory
from kvmemory import hashing
from kvmemory.config import StoreConfig
from kvmemory.errors import StoreCorruptError
from kvmemory.store import BlockStore

PROMPT = "The ferry to the outer islands leaves at seven; pack a coat, the wind is sharp. " * 12


def _rows(store, state_id):
    return store.chain(store.manifest.states[state_id].last_row)


def _ids(store, rows):
    return {store.manifest.id_of(r) for r in rows}


def test_two_owners_same_prompt_share_no_block_and_each_commit_writes_all(tmp_path, tiny):
    mem = kvmemory.Memory(tmp_path / "s.kvm", model=tiny, store_config=StoreConfig(block_tokens=32))
    n_tok = len(mem.tokenize(PROMPT))
    assert n_tok > 3 * 32
    plain = mem.save(PROMPT)
    before = mem.store.n_blocks
    a = mem.save(PROMPT, owner="alice")
    after_a = mem.store.n_blocks
    b = mem.save(PROMPT, owner="bob")
    store = mem.store
    blocks = -(-n_tok // 32)
    # each owner's commit wrote the whole chain: another's (or the unsalted) equal prefix was not found
    assert after_a - before == blocks and store.n_blocks - after_a == blocks
    assert a.reused_tokens == 0 and b.reused_tokens == 0
    chains = [_rows(store, s.id) for s in (plain, a, b)]
    ids = [_ids(store, rows) for rows in chains]
    assert not (ids[0] & ids[1]) and not (ids[0] & ids[2]) and not (ids[1] & ids[2])
    assert set(store.manifest.roots) == {chains[1][0], chains[2][0]}     # the unsalted root is the default
    # the salt changes ids, never bytes
    assert torch.equal(plain.kv, a.kv) and torch.equal(a.kv, b.kv)
    # the owner's own prefix is its cache hit
    again = mem.save(PROMPT + " And bring a flask of tea.", owner="alice")
    assert again.reused_tokens == (n_tok // 32) * 32
    assert set(_rows(store, again.id)[:n_tok // 32]) == set(chains[1][:n_tok // 32])
    assert store.verify_all() == []
    mem.close()


def test_roots_are_replayed_from_the_log_and_a_snapshot_and_verified(tmp_path, tiny, monkeypatch):
    path = tmp_path / "s.kvm"
    mem = kvmemory.Memory(path, model=tiny, store_config=StoreConfig(block_tokens=32))
    a = mem.save(PROMPT, owner="alice")
    mem.close()
    # a fresh open replays the roots from the commit records: the state loads, ids re-derived
    mem = kvmemory.Memory(path, model=tiny)
    assert torch.equal(mem.load(a.id).kv, a.kv)
    mem.close()
    # and from a snapshot (one after every commit here)
    monkeypatch.setattr("kvmemory.store.commit.SNAPSHOT_EVERY", 1)
    mem = kvmemory.Memory(path, model=tiny)
    b = mem.save(PROMPT, owner="bob")
    mem.close()
    assert list((path / "log").glob("snapshot-*.json"))
    store = BlockStore.open(path)
    assert len(store.manifest.roots) == 2 and store.verify_all() == []
    # without its root a salted block's id does not re-derive: a store that lost it is corrupt, not trusted
    row = _rows(store, b.id)[0]
    store.manifest.roots.pop(row)
    with pytest.raises(StoreCorruptError, match="does not match"):
        store.verified_meta([row])
    assert [r for r, _ in store.verify_all()] == [row]


def test_gc_of_one_owner_frees_its_rows_and_roots_and_keeps_the_other(tmp_path, tiny):
    path = tmp_path / "s.kvm"
    mem = kvmemory.Memory(path, model=tiny, store_config=StoreConfig(block_tokens=32))
    a = mem.save(PROMPT, owner="alice")
    b = mem.save(PROMPT, owner="bob")
    rows_a, rows_b = _rows(mem.store, a.id), _rows(mem.store, b.id)
    assert mem.forget_states([a.id]) == 1
    mem.gc(grace_s=0)
    store = mem.store
    assert all(not store.is_committed(r) for r in rows_a) and rows_a[0] not in store.manifest.roots
    assert store.manifest.roots == {rows_b[0]: hashing.salt_root("kvmemory-owner:bob")}
    assert torch.equal(mem.load(b.id).kv, b.kv) and store.verify_all() == []
    mem.close()


def test_a_salt_is_a_non_empty_string():
    assert hashing.salt_root("a") != hashing.salt_root("b") != hashing.ROOT_PARENT
    with pytest.raises(ValueError):
        hashing.salt_root("")
