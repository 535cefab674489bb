"""The model conformance suite: one set of tests every supported family runs (as tests/store/conformance.py
is for the store backends). Each family is a tiny random-weight model built from its real transformers
config class (tests/model/families.py), saved as a local directory and opened through Memory(path,
model=DIR) as a user's model would be. Held to: E1 and E2 (verify, verify --recompute), E3 (a restored
state + a suffix bit-identical to the canonical block-aligned prefill), E4 (a graft at another offset:
layer-0 keys as the model computes them there, the next-token KL reported and bounded), invariant mode
(one plain pass bit for bit, or a refusal naming why), batched prefill and decoding against each
sequence alone, re-rank scores against a fresh prefill, ask over a small document store, chat memory
recall, the server's chat completion through the official openai client, compact and audit. And the
refusals: every model the engine cannot keep exact is a ModelLoadError with its reason.

KVMEMORY_TEST_DEVICE=cuda runs the suite with every model on the GPU (benchmarks/gpu/run.sh); default cpu."""

from __future__ import annotations

import os
import random

import pytest
import torch

import kvmemory
from kvmemory import kv as kvops
from kvmemory.config import StoreConfig
from kvmemory.errors import ModelLoadError
from kvmemory.exactness import kl_divergence
from kvmemory.model.families import FAMILIES
from tests.bounds import FULL
from tests.model.families import build, configs, refused

DEVICE = os.environ.get("KVMEMORY_TEST_DEVICE", "cpu")
C = 16                        # tokens per block: several blocks from short states
# the suite's slower tests (a store of documents, a live server, invariant mode) run for every family in
# the full run (make test-full, KVMEMORY_FULL_TESTS=1) and for one family of each code path in the
# bounded one: the default Llama path, QK-norm with its own forward (Qwen3), fused projections (Phi-3),
# no selective recompute (Granite), sliding windows with two RoPE bases (Gemma 3)
SAMPLE = sorted(FAMILIES) if FULL else ["gemma3_text", "granite", "llama", "phi3", "qwen3"]


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory, tokenizer):
    """family -> a local transformers directory of its tiny model (with the real tokenizer)."""
    root = tmp_path_factory.mktemp("families")
    out = {}
    for name, cfg in configs(len(tokenizer), tokenizer.bos_token_id, tokenizer.eos_token_id).items():
        d = root / name
        build(cfg, seed=len(out)).save_pretrained(d)
        tokenizer.save_pretrained(d)
        out[name] = d
    return out


def test_the_suite_builds_every_family_the_engine_names():
    tok_vocab = 100
    assert set(configs(tok_vocab, 1, 2)) == set(FAMILIES)
    assert len(FAMILIES) >= 10


def _fresh(model, ids, chunk=C):
    cache = kvops.make_cache(None, model.config)
    with torch.inference_mode():
        for s in range(0, len(ids), chunk):
            model(input_ids=_t([ids[s:s + chunk]]), past_key_values=cache, use_cache=True)
    return cache


def _t(rows) -> torch.Tensor:
    """Token ids on the suite's device."""
    return torch.tensor(rows, device=DEVICE)


def _ids(rng, n):
    return [rng.randrange(100, 5000) for _ in range(n)]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_exactness_contract(family, family_dirs, tmp_path, rng):
    """E1, E2 and E3 on states of the block boundaries, a branch and an extension; a flipped byte is caught."""
    path = tmp_path / "e.kvm"
    states = []
    with kvmemory.Memory(path, model=str(family_dirs[family]), device=DEVICE,
                         store_config=StoreConfig(block_tokens=C)) as mem:
        assert mem.model_name == family
        base = _ids(rng, 3 * C + 5)
        for ids in (base[:1], base[:C - 1], base[:C], base[:C + 1], base, base + _ids(rng, 9)):
            states.append((ids, _ids(rng, rng.randrange(1, 6)), mem.save(ids).id))
        assert mem.verify() == [] and mem.verify(recompute=True) == []
        fp = mem.fingerprint
    with kvmemory.Memory(path, model=str(family_dirs[family]), device=DEVICE) as mem:      # every byte from disk
        assert mem.fingerprint == fp
        for ids, suffix, sid in states:
            st = mem.load(sid)
            assert st.token_ids == ids
            with torch.inference_mode():
                graft = mem.model(input_ids=_t([suffix]), past_key_values=st.cache()).logits[0]
                fresh = mem.model(input_ids=_t([suffix]), past_key_values=_fresh(mem.model, ids)).logits[0]
            assert torch.equal(graft, fresh), (family, len(ids))
    shard = sorted(p for p in (path / "data" / "kv").rglob("*") if p.is_file() and p.name != "zarr.json")[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x10
    shard.write_bytes(bytes(data))
    with kvmemory.Memory(path, model=str(family_dirs[family]), device=DEVICE) as mem:
        assert mem.verify() != []


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_offset_graft(family, family_dirs, tmp_path, rng):
    """E4: a state's blocks grafted behind another prefix: its layer-0 keys are the ones the model
    computes for those tokens at the new positions (RoPE layout, partial rotary, scaling: all the
    re-rotation must get right), to float rounding; the next token's KL against computing the whole
    text is reported and bounded."""
    from kvmemory import graft

    with kvmemory.Memory(tmp_path / "o.kvm", model=str(family_dirs[family]), device=DEVICE,
                         store_config=StoreConfig(block_tokens=C)) as mem:
        ids, prefix = _ids(rng, 2 * C + 3), _ids(rng, 7)
        st = mem.save(ids)
        store = mem.require_store()
        rows = store.chain(store.manifest.states[st.id].last_row)
        pre = _fresh(mem.model, prefix)
        pre_kv = torch.stack([torch.stack([layer.keys[0], layer.values[0]]) for layer in pre.layers])
        kv, grafted, rerotated = graft.after(mem.rt, pre_kv, rows)
        assert grafted == rerotated == len(ids)
        whole = _fresh(mem.model, prefix + ids, chunk=len(prefix) + len(ids))
        k0 = whole.layers[0].keys[0]                                         # [H, T, D]
        torch.testing.assert_close(kv[0, 0], k0, rtol=1e-4, atol=1e-5)
        nxt = _ids(rng, 1)
        with torch.inference_mode():
            a = mem.model(input_ids=_t([nxt]), past_key_values=kvops.make_cache(kv, mem.model.config)).logits[0, -1]
            b = mem.model(input_ids=_t([nxt]), past_key_values=whole).logits[0, -1]
        kl = float(kl_divergence(b, a))
        print(f"\nE4 {family}: KL {kl:.3g} after a {len(ids)}-token graft at offset {len(prefix)}")
        assert 0.0 <= kl < 0.05


@pytest.mark.parametrize("family", SAMPLE)
def test_invariant_mode_is_one_plain_pass_or_refused_with_its_reason(family, family_dirs, tmp_path):
    from kvmemory.model.invariant import InvariantUnavailableError
    try:
        mem = kvmemory.Memory(tmp_path / "i.kvm", model=str(family_dirs[family]), device=DEVICE, invariant=True,
                              store_config=StoreConfig(block_tokens=C))
    except (InvariantUnavailableError, ModelLoadError) as e:
        assert str(e)
        pytest.skip(f"{family}: invariant mode refused: {e}")
    with mem:
        rng = random.Random(3)
        for n in (C + 3, 2 * C):
            mem.save(_ids(rng, n))
        _, rows = mem.audit(2, seed=1)
        assert len(rows) == 2 and all(r.ok and r.exact and r.one_pass_exact for r in rows), rows


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_batched_prefill_and_decoding_equal_each_sequence_alone(family, family_dirs, cache_dir, rng):
    from kvmemory.batching import forward_many, step
    from kvmemory.model import load_model

    model, _, _ = load_model(str(family_dirs[family]), cache_dir=cache_dir, device=DEVICE)
    prompts = [_ids(rng, rng.randrange(3, 40)) for _ in range(3)]
    news = [_ids(rng, rng.randrange(1, 6)) for _ in range(3)]
    alone = []
    for p, t in zip(prompts, news):
        with torch.inference_mode():
            alone.append(model(input_ids=_t([t]), past_key_values=_fresh(model, p, 64)).logits[0])
    caches = [_fresh(model, p, 64) for p in prompts]
    out = forward_many(model, caches, news, [len(t) for t in news])
    for a, b in zip(alone, out):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
    nxt = [int(lg[-1].argmax()) for lg in out]
    stepped = step(model, caches, nxt)
    for p, t, n, s in zip(prompts, news, nxt, stepped):
        with torch.inference_mode():
            want = model(input_ids=_t([[n]]), past_key_values=_fresh(model, p + t, 64)).logits[0, -1]
        torch.testing.assert_close(s, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_selective_recompute_reproduces_the_forward_or_is_refused(family, family_dirs, cache_dir, rng):
    """The blend (kvmemory/blend.py) at r = 1 recomputes every token of the window: the logits of a fresh
    prefill of the same text. A family whose forward it cannot reproduce is refused with the reason."""
    from kvmemory.blend import blend_prefill, supported
    from kvmemory.errors import InputError
    from kvmemory.model import load_model

    model, _, _ = load_model(str(family_dirs[family]), cache_dir=cache_dir, device=DEVICE)
    ctx, q = _ids(rng, 40), _ids(rng, 5)
    c = _fresh(model, ctx, 64)
    kv = torch.stack([torch.stack([layer.keys[0], layer.values[0]]) for layer in c.layers])
    why = supported(model)
    if why is not None:
        assert family in ("granite", "mistral_sliding", "gemma2", "gemma3_text"), why
        with pytest.raises(InputError, match="not available"):
            blend_prefill(model, kv, ctx, q, 1.0)
        return
    logits, _, stats = blend_prefill(model, kv, ctx, q, 1.0)
    with torch.inference_mode():
        fresh = model(input_ids=_t([ctx + q])).logits[0, -1]
    torch.testing.assert_close(logits, fresh, rtol=1e-4, atol=1e-4)
    assert stats.recomputed == len(ctx)


def _doc(rng) -> str:
    words = ["harbour", "lantern", "meadow", "copper", "orchard", "violet", "glacier", "thistle", "saddle", "quarry"]
    return " ".join(rng.choice(words) for _ in range(120))


@pytest.mark.parametrize("family", SAMPLE)
def test_rerank_ask_chat_memory_compact_and_audit(family, family_dirs, tmp_path, rng):
    """The re-rank's scores against a fresh prefill of each candidate's segment prefix; ask over a
    small document store grafts the block holding the question's words and is the same answer twice;
    a user's told fact is recalled in a new session; compact and audit run over the store."""
    from kvmemory.rerank import question_loglik, rerank
    from kvmemory.retrieve import rank_blocks

    with kvmemory.Memory(tmp_path / "a.kvm", model=str(family_dirs[family]), device=DEVICE, segment_blocks=2) as mem:
        mem.add(_doc(rng) + " The vault code is 4417. " + _doc(rng), doc_id="a")
        mem.add(_doc(rng), doc_id="b")
        docs = mem.documents
        q = "What is the vault code?"
        q_ids = docs.prelude.question_ids(q)
        pool = rank_blocks(mem.rt, docs, q, "text", n=8)
        out, _ = rerank(mem.rt, docs, q_ids, pool, 3)
        live = docs.live_map()
        for h in out:
            doc_id, _, i = live[h.row]
            rows = mem.store.manifest.docs[doc_id].rows
            first = i - i % docs.segment_blocks
            meta = mem.store.block_meta(rows[first:i + 1])
            ids = [int(t) for j in range(i + 1 - first) for t in meta["tokens"][j][: int(meta["n_tokens"][j])]]
            cache = _fresh(mem.model, docs.prelude.ids, mem.block_tokens)
            with torch.inference_mode():
                for s in range(0, len(ids), mem.block_tokens):
                    mem.model(input_ids=_t([ids[s:s + mem.block_tokens]]), past_key_values=cache)
            assert abs(question_loglik(mem.model, cache, q_ids, docs.prelude.question_span(q_ids)) - h.score) < 1e-3
        a1, a2 = mem.ask(q, max_new_tokens=4), mem.ask(q, max_new_tokens=4)
        assert a1.text == a2.text and any(src[0] == "a" for src in a1.sources)
        assert any("4417" in p["text"] for p in mem.passages(a1))
        cm = mem.chat_memory("ada")
        cm.reply([{"role": "user", "content": "Please remember: my locker combination is 52917."}], session="s1",
                 max_new_tokens=3)
        cm.reply([{"role": "user", "content": "I like walking by the river."}], session="s2", max_new_tokens=3)
        got = cm.recall("What is my locker combination?", exclude_session="s9")
        assert got and "52917" in got[0].text
        # recalled as KV (the default: every recalled token prefilled after the restored conversation, no
        # blend, so every family; but a first message's first turn, restored as computed: the lead): the
        # window quoting the same turns shows, up to float rounding
        from kvmemory.chat_memory.window import build
        assert cm.recompute == 1.0 and cm.exact_lead
        ask_ = [{"role": "user", "content": "What is my locker combination?"}]
        kv = build(mem.rt, cm, ask_, "s9", 3, "kv", owner=cm.key)
        text = build(mem.rt, cm, ask_, "s9", 3, "text", owner=cm.key)
        assert kv.hits and kv.stats["tokens_grafted"] == sum(h.n_tokens for h in kv.hits) > 0
        assert kv.stats["tokens_recomputed"] == kv.stats["tokens_grafted"] - kv.hits[0].n_tokens    # the lead
        assert kv.cache.get_seq_length() == text.cache.get_seq_length()
        assert torch.allclose(kv.logits.float(), text.logits.float(), atol=1e-3)
        _, rows = mem.audit(3, seed=5)
        assert rows and all(r.ok and r.exact for r in rows)
        rep = mem.compact(tmp_path / "c.kvm", "bf16")
        assert rep.blocks == mem.store.n_blocks


@pytest.mark.parametrize("family", SAMPLE)
def test_the_server_answers_a_chat_completion(family, family_dirs, tmp_path):
    openai = pytest.importorskip("openai")
    from tests.server.test_server import serving

    mem = kvmemory.Memory(tmp_path / "s.kvm", model=str(family_dirs[family]), device=DEVICE)
    with serving(mem) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        msgs = [{"role": "user", "content": "Name a colour."}]
        r1 = client.chat.completions.create(model="kvmemory", messages=msgs, temperature=0, max_tokens=4)
        r2 = client.chat.completions.create(model="kvmemory", messages=msgs, temperature=0, max_tokens=4)
    assert r1.choices[0].message.content == r2.choices[0].message.content
    assert r1.usage.completion_tokens >= 1 and r1.usage.prompt_tokens == r2.usage.prompt_tokens > 0


@pytest.mark.parametrize("name", sorted(refused(100)))
def test_a_model_the_engine_cannot_keep_exact_is_refused_with_its_reason(name, tmp_path, tokenizer):
    cfg, words = refused(len(tokenizer))[name]
    d = tmp_path / name
    cfg.save_pretrained(d)                  # the configuration alone: refused before any weight is read
    tokenizer.save_pretrained(d)
    with pytest.raises(ModelLoadError, match=words):
        kvmemory.Memory(tmp_path / "r.kvm", model=str(d))
    assert not (tmp_path / "r.kvm").exists()
    if name in ("dynamic-ntk", "longrope"):                      # a loaded model passed in: refused the same
        with pytest.raises(ModelLoadError, match=words):
            kvmemory.Memory(tmp_path / "r2.kvm", model=build(cfg), tokenizer=tokenizer)
