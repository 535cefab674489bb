"""A model computing in bfloat16 (Memory(dtype=...), --dtype, KVMEMORY_DTYPE): its stores hold
bfloat16 KV (half the bytes), the exactness contract holds against the bfloat16 computation, a
store opens only in its own dtype, and bad input is a typed error that loses nothing stored."""

import json

import pytest
import torch

import kvmemory
from kvmemory.errors import InputError, ModelMismatchError
from kvmemory.prompts import chat_ids
from tests.cli.test_cli import _one_line_error, run, saved
from tests.test_exactness import _fresh_prefill


@pytest.mark.real_model
def test_bfloat16_states_restore_bit_exact_against_the_bfloat16_computation(tmp_path, cache_dir, rng):
    """E3 in bfloat16 with the real model: a restored state + a suffix gives the logits of a clean
    block-aligned bfloat16 prefill of the same tokens, bit for bit (KL 0), after a reopen (every
    byte from disk); the store's KV takes half the bytes of the float32 model's."""
    path = tmp_path / "bf16.kvm"
    samples = []
    with kvmemory.Memory(path, dtype=torch.bfloat16, cache_dir=cache_dir) as mem:
        C = mem.block_tokens
        assert mem.kv_dtype == torch.bfloat16 and next(mem.model.parameters()).dtype == torch.bfloat16
        for n in (1, C - 1, C, C + 1, rng.randint(2, 3 * C)):
            ids = [rng.randrange(49152) for _ in range(n)]
            samples.append((ids, [rng.randrange(49152) for _ in range(rng.randrange(1, 9))], mem.save(ids).id))
        per_token = mem.geometry.bytes_per_token
    with kvmemory.Memory(path, dtype="bfloat16", cache_dir=cache_dir) as mem:
        model = mem.model
        info = mem.info()
        assert info["kv_dtype"] == "bfloat16"
        for ids, suffix, sid in samples:
            st = mem.load(sid)
            assert st.token_ids == ids
            with torch.inference_mode():
                s = torch.tensor([suffix])
                graft = model(input_ids=s, past_key_values=st.cache()).logits[0]
                fresh = model(input_ids=s, past_key_values=_fresh_prefill(model, ids, C)).logits[0]
            assert graft.dtype == torch.bfloat16 and torch.equal(graft, fresh), (len(ids), (graft - fresh).abs().max())
        assert mem.verify(recompute=True) == []                    # E2: every block recomputes to its bytes
    with kvmemory.Memory(tmp_path / "f32.kvm", cache_dir=cache_dir) as f32:
        assert f32.geometry.bytes_per_token == 2 * per_token


def test_a_store_opens_only_in_its_dtype_and_bad_dtypes_are_typed_errors(tmp_path, tiny_dir, tiny, monkeypatch):
    path = tmp_path / "s.kvm"
    text = "The ferry leaves the pier at dawn and the keeper rings the bell. " * 20
    with kvmemory.Memory(path, model=tiny_dir, dtype="bfloat16") as mem:
        sid = mem.save(text).id
        ids = mem.load(sid).token_ids
        kv = torch.stack([torch.stack([layer.keys, layer.values]) for layer in mem.load(sid).cache().layers])
    assert kv.dtype == torch.bfloat16
    with pytest.raises(ModelMismatchError, match="dtype='bfloat16'"):
        kvmemory.Memory(path, model=tiny_dir)                      # float32 by default: not this store's blocks
    with pytest.raises(InputError, match="dtype must be one of"):
        kvmemory.Memory(path, model=tiny_dir, dtype="int8")
    with pytest.raises(InputError, match="dtype must be a torch dtype"):
        kvmemory.Memory(path, model=tiny_dir, dtype=16)
    with pytest.raises(InputError, match="computes in float32"):   # a loaded model keeps its own dtype
        kvmemory.Memory(path, model=tiny, dtype="bfloat16")
    monkeypatch.setenv("KVMEMORY_DTYPE", "half-ish")
    with pytest.raises(InputError, match="KVMEMORY_DTYPE"):
        kvmemory.Memory(path, model=tiny_dir)
    monkeypatch.setenv("KVMEMORY_DTYPE", "bfloat16")               # the environment's dtype opens it
    with kvmemory.Memory(path, model=tiny_dir) as mem:
        st = mem.load(sid)                                          # nothing lost, every byte verified
        assert st.token_ids == ids
        again = torch.stack([torch.stack([layer.keys, layer.values]) for layer in st.cache().layers])
        assert torch.equal(again, kv)
        assert mem.verify(recompute=True) == []


def test_a_bfloat16_model_on_cpu_computes_attention_in_float32(tmp_path, tiny_dir, tiny, rng, monkeypatch):
    """kvmemory/model/half.py: a bf16 Memory's model attends through the float32 kernel (the bf16
    one is 4-10x slower for a decode step's one query on CPU): its output is the float32 kernel's
    on the same numbers, rounded once to bf16, for a decode step and for a causal chunk, through
    the model and through forward_many's loop. It is in the fingerprint and the header: a bf16
    store made with bf16 attention (before 2026-12-04) does not open, the error says why, and
    nothing in it is lost (it opens and verifies with the attention that made it)."""
    import copy

    import torch.nn.functional as F

    from kvmemory import kv as kvops
    from kvmemory.batching import forward_many
    from kvmemory.model import half
    path = tmp_path / "s.kvm"
    with kvmemory.Memory(path, model=tiny_dir, dtype="bfloat16") as mem:
        model = mem.model
        assert half.installed(model) and mem.info()["attention"] == "float32"
        sid = mem.save([rng.randrange(5, 2000) for _ in range(rng.randrange(300, 600))]).id
    attn = model.model.layers[0].self_attn
    for T, L in ((1, rng.randrange(2, 700)), (rng.randrange(2, 300), rng.randrange(300, 700))):
        q, k, v = (torch.randn(1, h, n, 16).to(torch.bfloat16) for h, n in ((4, T), (2, L), (2, L)))
        mask = torch.ones(T, L, dtype=torch.bool).tril(diagonal=L - T)[None, None]
        want = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask, scale=0.25,
                                              enable_gqa=True).transpose(1, 2).to(torch.bfloat16)
        got, _ = half.attention(attn, q, k, v, mask, scaling=0.25)
        assert got.dtype == torch.bfloat16 and torch.equal(got, want)
        assert torch.equal(half.sdpa32(q.float(), k, v, mask, 0.25).to(torch.bfloat16), want)
    with torch.inference_mode():         # the model's forward (its masks) = forward_many's loop (causal masks of its own)
        c1, c2 = kvops.make_cache(None, model.config), kvops.make_cache(None, model.config)
        for ids in ([rng.randrange(5, 2000) for _ in range(rng.randrange(20, 200))],     # a prefill
                    [rng.randrange(5, 2000) for _ in range(rng.randrange(2, 100))],      # a chunk after it
                    [7]):                                                                # a decode step
            a = model(input_ids=torch.tensor([ids]), past_key_values=c1, use_cache=True).logits[0]
            assert torch.equal(a, forward_many(model, [c2], [ids], [len(ids)])[0])
    f32 = copy.deepcopy(tiny[0])                      # and it is the float32 model's attention on the same numbers:
    with torch.inference_mode():                      # a chunked prefill lands near the float32 one (no mask lost)
        ids = [rng.randrange(5, 2000) for _ in range(300)]
        cb, cf = kvops.make_cache(None, model.config), kvops.make_cache(None, f32.config)
        for lo, hi in ((0, 100), (100, 300)):
            lb = model(input_ids=torch.tensor([ids[lo:hi]]), past_key_values=cb, use_cache=True).logits[0].float()
            lf = f32(input_ids=torch.tensor([ids[lo:hi]]), past_key_values=cf, use_cache=True).logits[0]
        assert float((lb - lf).norm() / lf.norm()) < 0.05
    # a store made with bf16 attention: another computation, refused with the reason
    old = tmp_path / "old.kvm"
    with monkeypatch.context() as m:
        m.setattr(half, "wanted", lambda model: False)
        with kvmemory.Memory(old, model=tiny_dir, dtype="bfloat16") as mem:
            assert not half.installed(mem.model) and mem.info()["attention"] == "bfloat16"
            oid = mem.save("The keeper lights the lamp at dusk. " * 12).id
    with pytest.raises(ModelMismatchError, match="bfloat16 attention.*float32 attention.*new store"):
        kvmemory.Memory(old, model=tiny_dir, dtype="bfloat16")
    with monkeypatch.context() as m:
        m.setattr(half, "wanted", lambda model: False)
        with kvmemory.Memory(old, model=tiny_dir, dtype="bfloat16") as mem:
            assert mem.load(oid).n_tokens > 0 and mem.verify(recompute=True) == []
    with kvmemory.Memory(path, model=tiny_dir, dtype="bfloat16") as mem:   # and the new one reopens
        assert mem.load(sid).n_tokens > 0 and mem.verify(recompute=True) == []
    with kvmemory.Memory(tmp_path / "f.kvm", model=tiny_dir) as mem:       # float32: its own attention
        assert not half.installed(mem.model) and mem.info()["attention"] == "float32"


def test_the_cli_creates_a_bfloat16_store_and_opens_it_in_its_dtype(tmp_path, tiny_dir):
    store = tmp_path / "cli.kvm"
    text = tmp_path / "p.txt"
    sid = saved(store, text, "The harbour master posts the tide tables at noon. " * 25, "--model", tiny_dir,
                "--dtype", "bfloat16")
    info = json.loads(run("info", store, "--json").stdout)
    assert info["kv_dtype"] == "bfloat16" and info["attention"] == "float32"   # kvmemory/model/half.py
    assert b"attention          float32" in run("info", store).stdout
    # without --dtype, a command opens the store in its own dtype
    r = run("generate", store, sid[:12], "And then", "--model", tiny_dir, "--max-new-tokens", "4")
    assert r.returncode == 0, r.stderr
    r = run("verify", store, "--recompute", "--model", tiny_dir)
    assert r.returncode == 0 and b"E2 recompute" in r.stdout, r.stdout + r.stderr
    # another dtype asked for: one line saying which opens it
    assert "--dtype bfloat16" in _one_line_error(run("generate", store, sid[:12], "x", "--model", tiny_dir,
                                                      "--dtype", "float32"))
    r = run("save", store, text, "--model", tiny_dir, "--dtype", "int4")
    assert r.returncode == 2 and b"invalid choice" in r.stderr
    assert b"--dtype" in run("serve", "--help").stdout


@pytest.mark.real_model
def test_the_real_model_in_bfloat16_answers_like_float32_where_float32_is_sure(tmp_path, cache_dir):
    """bfloat16 changes the computation (the weights and every product rounded to 8 bits of
    mantissa): its greedy replies are not float32's token for token, and which ones differ depends
    on the machine's bf16 kernels (AVX-512 BF16 or AMX). Where the float32 model is sure of its next
    token (probability >= 0.9, fed float32's greedy reply), the bfloat16 one picks the same; the
    share of replies that differ is measured in benchmarks (bench_serve --batch 8,8h)."""
    prompts = ["What is the capital of France?", "What is 2 + 2?", "Name the largest planet of the solar system."]
    steps = 6

    def chat(tok, p):
        return chat_ids(tok, [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": p}])
    with kvmemory.Memory(tmp_path / "f32.kvm", dtype="float32", cache_dir=cache_dir) as mem, torch.no_grad():
        ref = []                                  # (prompt ids, float32's greedy tokens, their probabilities)
        for p in prompts:
            ids, out, probs = chat(mem.tokenizer, p), [], []
            for _ in range(steps):
                pr = mem.model(torch.tensor([ids + out])).logits[0, -1].float().softmax(-1)
                out.append(int(pr.argmax()))
                probs.append(float(pr.max()))
            ref.append((ids, out, probs))
    with kvmemory.Memory(tmp_path / "bf16.kvm", dtype="bfloat16", cache_dir=cache_dir) as mem, torch.no_grad():
        assert next(mem.model.parameters()).dtype == torch.bfloat16
        sure = 0
        for ids, out, probs in ref:
            picks = mem.model(torch.tensor([ids + out])).logits[0, len(ids) - 1:-1].argmax(-1).tolist()
            for i, (a, b, pr) in enumerate(zip(out, picks, probs)):
                if pr >= 0.9:
                    sure += 1
                    assert a == b, (mem.tokenizer.decode(ids[-8:] + out[:i]), mem.tokenizer.decode([a, b]), pr)
        assert sure >= 3, f"float32 is sure of only {sure} of {len(prompts) * steps} tokens: the test says nothing"
        st = mem.save(mem.system_prompt("You are a helpful assistant."))
        assert mem.generate(st, prompts[0], max_new_tokens=8, chat=True).strip()


def test_a_bfloat16_server_without_a_row_scheme_says_so_and_runs_plain(tmp_path, tiny_dir, monkeypatch, caplog):
    """create_app's default for bfloat16 is invariant rows; on a machine whose kernels allow no row
    scheme it logs that replies may differ and batches plainly; asked for explicitly, it refuses."""
    from kvmemory.model import invariant as inv
    from kvmemory.server import create_app

    def none_here(model, threads=None):
        raise inv.InvariantUnavailableError("no scheme on this (simulated) machine")
    with kvmemory.Memory(tmp_path / "s.kvm", model=tiny_dir, dtype="bfloat16") as mem:
        assert create_app(mem, batch=4).state.worker.batcher.scheme is not None
        monkeypatch.setattr(inv, "choose", none_here)
        with caplog.at_level("WARNING", logger="kvmemory.server"):
            app = create_app(mem, batch=4)
        assert app.state.worker.batcher.scheme is None and "without invariant rows" in caplog.text
        with pytest.raises(inv.InvariantUnavailableError):
            create_app(mem, batch=4, invariant_rows=True)
        assert create_app(mem, batch=4, invariant_rows=False).state.worker.batcher.scheme is None


_AFTER_A_FLOAT32_GEMM = """
import hashlib, random, sys, torch
a, b = torch.randn(256, 1024), torch.randn(1024, 1024)
for x, y in ((a, b), (a.bfloat16(), b.bfloat16())) * 3:          # GEMMs first, as a start-up timing ran
    x @ y
import kvmemory
ids = [random.Random(int(sys.argv[2])).randrange(49152) for _ in range(256)]
with kvmemory.Memory(sys.argv[1], dtype="bfloat16", cache_dir=sys.argv[3]) as mem:
    print(hashlib.sha256(mem.save(ids).kv.float().numpy().tobytes()).hexdigest())
"""


@pytest.mark.real_model
def test_a_bfloat16_prefill_is_the_same_bytes_in_every_process(tmp_path, cache_dir, rng):
    """The real model in bfloat16, in four fresh processes that each ran float32 and bfloat16 GEMMs
    before it (as a start-up timing did): one 256-token prompt's KV is the same bytes in all (the loader's warm-up forward,
    kvmemory.model.loader.warm_up; without it the first bf16 forward after a float32 GEMM gave 3
    different values in 8 processes on the AMX Xeon). A server's restored and recomputed replies
    rest on this (tests/server/test_server.py, across SIGKILL)."""
    import subprocess
    import sys
    seed = rng.randrange(2**31)
    digests = [subprocess.run([sys.executable, "-c", _AFTER_A_FLOAT32_GEMM, str(tmp_path / f"p{i}.kvm"), str(seed),
                               str(cache_dir)], capture_output=True, text=True, check=True).stdout.strip()
               for i in range(4)]
    assert len(digests[0]) == 64 and len(set(digests)) == 1, digests
