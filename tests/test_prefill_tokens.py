"""A store whose canonical prefill runs in forwards of prefill_tokens Q < block_tokens C: a state that
extends a stored one inside a block (a conversation's next turn) restores the stored start of that
block up to its last whole forward and computes only the rest, and every block it commits is byte
for byte the block a fresh store of the same setting computes from nothing (E2 holds)."""

import json
import random

import pytest
import torch

import kvmemory
from kvmemory import kv as kvops
from kvmemory.config import StoreConfig
from kvmemory.errors import InputError, ModelMismatchError


def _block_bytes(mem, state_id: str) -> list[bytes]:
    store = mem.store
    rows = store.chain(store.manifest.states[state_id].last_row)
    return [store.read_state_kv([r]).tobytes() for r in rows]


@pytest.mark.real_model
def test_a_next_turn_restores_whole_prefill_forwards_of_its_partial_block_and_matches_a_fresh_store(tmp_path,
                                                                                                    real_model):
    model, tok = real_model
    C, Q = 64, 16
    cfg = StoreConfig(block_tokens=C, prefill_tokens=Q)
    rng = random.Random(11)
    ids = [rng.randrange(100, 40000) for _ in range(3 * C + 40)]
    # each ends inside a block; some cross one, one ends on a forward's edge, one just past one
    turns = [C + 10, C + 30, C + 48, 2 * C + 1, 2 * C + 50, 3 * C + 17, 3 * C + 40]
    mem = kvmemory.Memory(tmp_path / "grow.kvm", model=model, tokenizer=tok, store_config=cfg)
    assert mem.prefill_tokens == Q and mem.block_tokens == C
    prev = 0
    for n in turns:
        st = mem.save(ids[:n])
        have = prev // C                        # the earlier turn's whole blocks, then its partial one's forwards
        assert st.reused_tokens == have * C + (prev % C) // Q * Q, (n, prev)
        fresh = kvmemory.Memory(tmp_path / f"fresh-{n}.kvm", model=model, tokenizer=tok, store_config=cfg)
        whole = fresh.save(ids[:n])             # the state computed from nothing, block by block
        assert whole.reused_tokens == 0 and whole.id == st.id and torch.equal(whole.kv, st.kv)
        assert _block_bytes(mem, st.id) == _block_bytes(fresh, whole.id)
        fresh.close()
        prev = n
    assert mem.verify(recompute=True) == []
    # documents take the same computation: deposited, verified by recomputation, asked
    mem.add(" ".join(["The ferry leaves pier nine at dawn."] * 30), doc_id="ferry")
    assert mem.verify(recompute=True) == []
    mem.close()

    # the chunking changes the bytes (so the setting must name the blocks): one forward a block
    # gives other KV for the same tokens, under another fingerprint
    plain = kvmemory.Memory(tmp_path / "plain.kvm", model=model, tokenizer=tok, store_config=StoreConfig(block_tokens=C))
    a = plain.save(ids[:2 * C + 50])
    assert plain.save(ids[:3 * C]).reused_tokens == 2 * C       # one forward a block: whole blocks only
    again = kvmemory.Memory(tmp_path / "grow.kvm", model=model, tokenizer=tok)   # reopened: its setting is read
    b = again.load(again.save(ids[:2 * C + 50]).id)
    assert again.prefill_tokens == Q and again.fingerprint != plain.fingerprint
    assert a.id != b.id and not torch.equal(a.kv, b.kv)
    cache = kvops.make_cache(None, model.config)              # b is the Q-chunked canonical computation
    ref = torch.cat([kv for _, kv, _ in kvops.prefill_blocks(model, ids[:2 * C + 50], C, cache, chunk_tokens=Q)], 3)
    assert torch.equal(ref, b.kv)
    again.close()
    plain.close()


def test_the_setting_is_checked_recorded_and_guarded(tmp_path, tiny):
    with pytest.raises(InputError, match="prefill_tokens"):
        StoreConfig(block_tokens=64, prefill_tokens=24)
    with pytest.raises(InputError, match="prefill_tokens"):
        StoreConfig(block_tokens=64, prefill_tokens=128)
    with kvmemory.Memory(tmp_path / "d.kvm", model=tiny, store_config=StoreConfig(block_tokens=64)) as d:
        model_fp = d.fingerprint
        assert d.prefill_tokens == 64 and d.info()["prefill_tokens"] == 64
    # a default store's header is as it always was (no new field), so earlier stores open unchanged
    assert "prefill_tokens" not in json.loads((tmp_path / "d.kvm" / "manifest.json").read_text())
    same = StoreConfig(block_tokens=64, prefill_tokens=64)       # its own block size: the default
    with kvmemory.Memory(tmp_path / "s.kvm", model=tiny, store_config=same) as s:
        assert s.fingerprint == model_fp
    with kvmemory.Memory(tmp_path / "q.kvm", model=tiny, store_config=StoreConfig(block_tokens=64,
                                                                                  prefill_tokens=16)) as q:
        assert q.fingerprint != model_fp and q.info()["prefill_tokens"] == 16
        q.save(list(range(100, 190)))
    header = tmp_path / "q.kvm" / "manifest.json"
    raw = json.loads(header.read_text())
    assert raw["prefill_tokens"] == 16
    # a reader that ignored the setting would compute the model's own fingerprint: the store refuses it
    header.write_text(json.dumps({k: v for k, v in raw.items() if k != "prefill_tokens"}))
    with pytest.raises(ModelMismatchError):
        kvmemory.Memory(tmp_path / "q.kvm", model=tiny)
