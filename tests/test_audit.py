"""`kvmemory audit` / Memory.audit: E3 on a store's own random states, restored against recomputed."""

import copy
import random

import pytest

import kvmemory
from kvmemory.errors import InputError, KVMemoryError


def _store(path, model, invariant=False):
    mem = kvmemory.Memory(path, model=model, invariant=invariant)
    rng = random.Random(4)
    base = [rng.randrange(100, 5000) for _ in range(300)]
    ids = [base, base + [rng.randrange(100, 5000) for _ in range(77)], base[:256], base[:5]]
    return mem, [mem.save(x).id for x in ids]


def test_every_state_restores_like_its_recompute_and_the_draw_is_reproducible(tmp_path, tiny):
    mem, sids = _store(tmp_path / "a.kvm", tiny)
    seed, rows = mem.audit(3, seed=11)
    assert seed == 11 and len(rows) == 3 and len({r.state for r in rows}) == 3
    assert {r.state for r in rows} <= set(sids)
    assert all(r.ok and r.exact and r.kl == 0.0 and not r.error for r in rows)
    assert [r.state for r in mem.audit(3, seed=11)[1]] == [r.state for r in rows]
    _, every = mem.audit(50)                         # more than there are: each state once
    assert sorted(r.state for r in every) == sorted(sids) and all(r.ok for r in every)
    with pytest.raises(InputError):
        mem.audit(0)
    mem.close()
    with pytest.raises(KVMemoryError, match="no states"):
        kvmemory.Memory(tmp_path / "empty.kvm", model=tiny).audit(2)


def test_in_invariant_mode_one_plain_pass_must_match_too(tmp_path, tiny):
    model, tok = tiny
    mem, sids = _store(tmp_path / "inv.kvm", (copy.deepcopy(model), tok), invariant=True)
    _, rows = mem.audit(4, seed=2)
    assert len(rows) == 4 and all(r.ok and r.one_pass_exact and r.vs_one_pass == 0.0 for r in rows)
    mem.close()


def test_a_damaged_block_makes_its_state_fail_and_the_rest_pass(tmp_path, tiny):
    path = tmp_path / "d.kvm"
    mem, sids = _store(path, tiny)
    mem.close()
    shard = sorted(p for p in (path / "data" / "kv").rglob("*") if p.is_file() and p.name != "zarr.json")[0]
    data = bytearray(shard.read_bytes())
    data[100] ^= 0x04                                 # row 0: the first block of the 300-, 377- and 256-token states
    shard.write_bytes(bytes(data))
    mem = kvmemory.Memory(path, model=tiny)
    _, rows = mem.audit(4, seed=0)
    bad = [r for r in rows if not r.ok]
    assert len(rows) == 4 and len(bad) == 3 and all("digest" in r.error for r in bad)
    assert [r.tokens for r in rows if r.ok] == [5]
    mem.close()
