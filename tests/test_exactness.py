"""The exactness contract with the real default model (SmolLM2-135M-Instruct, fp32).

E3 is checked on fresh random states each run (random token ids and real text; lengths:
the boundaries 1, C-1, C, C+1 and 2,000, then a third uniform and two thirds log-uniform in
1..2,000; the last fifth extend an earlier state so restored parents are exercised): 12 in the
bounded suite (fresh ones every run), 50 with KVMEMORY_FULL_TESTS=1 (the README's run) or
KVMEMORY_E3_STATES=N. The figures are printed (run with -s) and
the assertions are exact.
"""

import glob
import math
import os
import random
import sys

import pytest
import torch

import kvmemory
from kvmemory.exactness import kl_divergence, max_abs_diff
from tests.bounds import bound

pytestmark = pytest.mark.real_model


def _real_text(rng: random.Random, tokenizer, n: int) -> list[int]:
    """n tokens of real English/prose-and-code text drawn from files on this machine."""
    files = sorted(glob.glob(os.path.join(sys.prefix, "lib", "python3*", "site-packages", "*.dist-info", "LICENSE*")))
    files += sorted(glob.glob(os.path.join(os.path.dirname(os.__file__), "*.py")))
    while True:
        text = open(rng.choice(files), encoding="utf-8", errors="ignore").read()
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) >= n:
            s = rng.randrange(len(ids) - n + 1)
            return ids[s:s + n]


def _fresh_prefill(model, ids, C):
    """Compute a prefix from scratch, block-aligned, independently of kvmemory's code."""
    from transformers import DynamicCache
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        for s in range(0, len(ids), C):
            model(input_ids=torch.tensor([ids[s:s + C]]), past_key_values=cache, use_cache=True)
    return cache


def _graft_and_fresh(model, st, ids, suffix, C):
    """Logits of `suffix` after the restored state `st` (of `ids`), and after a clean block-aligned
    prefill of the same ids; the state's token ids are checked first."""
    assert st.token_ids == ids
    with torch.inference_mode():
        s = torch.tensor([suffix])
        graft = model(input_ids=s, past_key_values=st.cache()).logits[0]
        fresh = model(input_ids=s, past_key_values=_fresh_prefill(model, ids, C)).logits[0]
    return graft, fresh


def test_e3_same_position_graft_is_bit_exact(tmp_path, real_model, rng):
    model, tok = real_model
    path = tmp_path / "e3.kvm"
    samples = []
    with kvmemory.Memory(path, model=real_model) as mem:
        C = mem.block_tokens
        fixed = [1, C - 1, C, C + 1, 2000]
        n_states = max(len(fixed) + 1, bound("KVMEMORY_E3_STATES", 10, 50))
        for i in range(n_states):
            if i < len(fixed):
                n = fixed[i]
            elif i % 3 == 0:
                n = rng.randint(1, 2000)
            else:
                n = max(1, min(2000, int(math.exp(rng.uniform(0, math.log(2000))))))
            if i >= n_states * 4 // 5:   # extend an earlier state: its blocks come back from disk as the parent
                base = samples[rng.randrange(len(samples))][0]
                ids = base + [rng.randrange(49152) for _ in range(rng.randrange(1, 300))]
                ids = ids[:2000]
            elif i % 2:
                ids = _real_text(rng, tok, n)
            else:
                ids = [rng.randrange(49152) for _ in range(n)]
            suffix = [rng.randrange(49152) for _ in range(rng.randrange(1, 17))]
            samples.append((ids, suffix, mem.save(ids).id))
    rows = []
    with kvmemory.Memory(path, model=real_model) as mem:      # a new Memory: every byte from disk
        for ids, suffix, sid in samples:
            graft, fresh = _graft_and_fresh(model, mem.load(sid), ids, suffix, C)
            with torch.inference_mode():
                single = model(input_ids=torch.tensor([ids + suffix])).logits[0, len(ids):]
            rows.append((len(ids), torch.equal(graft, fresh), kl_divergence(fresh, graft),
                         max_abs_diff(graft, single), kl_divergence(single, graft)))
    lengths = [r[0] for r in rows]
    print(f"\nE3: {len(rows)} states, lengths {min(lengths)}..{max(lengths)} (median {sorted(lengths)[len(lengths) // 2]}, mean {sum(lengths) / len(lengths):.0f}); "
          f"bit-exact {sum(r[1] for r in rows)}/{len(rows)}; max KL {max(r[2] for r in rows):.3g}; "
          f"vs one single forward pass: max |dlogit| {max(r[3] for r in rows):.3g}, max KL {max(r[4] for r in rows):.3g}")
    assert all(r[1] for r in rows), [r for r in rows if not r[1]]
    assert all(r[2] == 0.0 for r in rows)


def test_e2_verify_recompute_passes_then_fails_after_a_flipped_byte(tmp_path, real_model, rng):
    path = tmp_path / "e2.kvm"
    with kvmemory.Memory(path, model=real_model) as mem:
        ids = [rng.randrange(49152) for _ in range(600)]
        mem.save(ids)
        mem.save(ids[:300])                 # a branch: shares block 0, adds a partial block
        assert mem.store.n_blocks == 4
        assert mem.verify(recompute=True) == []
    shard = sorted(p for p in (path / "data" / "kv").rglob("*") if p.is_file() and p.name != "zarr.json")[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 3] ^= 0x10
    shard.write_bytes(bytes(data))
    with kvmemory.Memory(path, model=real_model) as mem:
        bad = mem.verify(recompute=True)
        assert bad and all("block" in why for _, why in bad)
        assert mem.verify() != []           # E1 alone catches it too


def test_fingerprint_covers_weight_bytes(tmp_path, real_model):
    model, tok = real_model
    path = tmp_path / "fp.kvm"
    with kvmemory.Memory(path, model=real_model) as mem:
        mem.save("A state written by the real model.")
        fp = mem.fingerprint
    w = model.model.layers[17].mlp.down_proj.weight
    old = w.data[3, 5].item()
    try:
        with torch.no_grad():
            w.data[3, 5] = torch.nextafter(w.data[3, 5], torch.tensor(1.0))   # one ulp
        with pytest.raises(kvmemory.ModelMismatchError) as e:
            kvmemory.Memory(path, model=real_model)
        assert fp in str(e.value) and e.value.model_fingerprint != fp
    finally:
        with torch.no_grad():
            w.data[3, 5] = old
    with kvmemory.Memory(path, model=real_model) as mem:
        assert mem.fingerprint == fp


def test_cached_conversion_equals_gguf_load(tmp_path, real_model):
    """The cached safetensors are the GGUF's dequantized weights, byte for byte."""
    from transformers import AutoModelForCausalLM

    from kvmemory.model import fingerprint
    from kvmemory.model.loader import _gguf_path, default_model_dir

    gguf = _gguf_path()
    direct = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    assert fingerprint(direct) == fingerprint(real_model[0])
    converted = default_model_dir(tmp_path / "cache")        # a first conversion into an empty cache
    assert (converted / "model.safetensors").is_file()
    assert default_model_dir(tmp_path / "cache") == converted   # second call: cache hit


def test_generate_from_restored_state_continues_the_text(tmp_path, real_model):
    with kvmemory.Memory(tmp_path / "g.kvm", model=real_model) as mem:
        st = mem.save(mem.system_prompt("You are a helpful assistant. The secret code word is PELICAN."))
        again = mem.load(st.id)
        a = mem.generate(again, "What is the secret code word?", max_new_tokens=12, chat=True)
        b = mem.generate(st, "What is the secret code word?", max_new_tokens=12, chat=True)
    assert a == b and a.strip()
