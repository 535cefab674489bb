"""Invariant mode (kvmemory/model/invariant.py): the same bytes whatever the chunking, the batch or
the thread count. torch.equal throughout: one pass against chunkings {256, 100, 1, random},
batched decoding against alone, one thread against two; a restored state continues bit for bit
like one plain forward pass of the same (invariant) model; the mode is part of the fingerprint."""

import copy
import random
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kvmemory
from kvmemory import batching
from kvmemory.config import StoreConfig
from kvmemory.errors import ModelMismatchError
from kvmemory.kv import make_cache
from kvmemory.model import fingerprint
from kvmemory.model import invariant as inv
from tests.bounds import bound


def _invariant_copy(model_and_tokenizer):
    """A copy of a session-wide model put in invariant mode (the original stays as it is)."""
    model, tok = model_and_tokenizer
    m = copy.deepcopy(model)
    inv.install(m)
    return m, tok


@pytest.fixture(scope="module")
def inv_tiny(tiny):
    return _invariant_copy(tiny)


@pytest.fixture
def threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def _kv(cache) -> torch.Tensor:
    return torch.stack([torch.stack([layer.keys, layer.values]) for layer in cache.layers])


@torch.inference_mode()
def _chunked(model, ids: list[int], cuts: list[int]):
    """KV and every position's logits of ids fed in pieces ending at `cuts`."""
    cache = make_cache(None, model.config)
    logits, s = [], 0
    for e in cuts:
        out = model(input_ids=torch.tensor([ids[s:e]]), past_key_values=cache, use_cache=True)
        logits.append(out.logits[0])
        s = e
    return _kv(cache), torch.cat(logits)


def _cuts(n: int, how) -> list[int]:
    if how == "random":
        rng, cuts, s = random.Random(n), [], 0
        while s < n:
            s = min(n, s + rng.randint(1, 300))
            cuts.append(s)
        return cuts
    return list(range(how, n, how)) + [n]


class _OneLinear(nn.Module):
    """What check() reads of a model: its Linear shapes and its head size."""

    def __init__(self, out_f: int, in_f: int):
        super().__init__()
        self.proj = nn.Linear(in_f, out_f, bias=False)
        self.config = SimpleNamespace(head_dim=64)


@pytest.fixture(scope="module")
def mlp_scheme():
    """The scheme this machine keeps for the default model's MLP shape."""
    return inv.choose(_OneLinear(1536, 576))


@pytest.mark.parametrize("m", [1, 3, 5, 11, 12, 13, 16, 17, 32, 57, 100, 257, 4100])
def test_a_linear_row_is_the_same_whatever_the_rows_around_it(m, threads, mlp_scheme):
    torch.manual_seed(m)
    w, x = torch.randn(1536, 576), torch.randn(m, 576)
    rows = []
    for n in (1, 2):
        torch.set_num_threads(n)
        full = inv.linear(x, w, scheme=mlp_scheme)
        alone = torch.cat([inv.linear(x[i:i + 1], w, scheme=mlp_scheme) for i in range(m)])
        assert torch.equal(full, alone)
        rows.append(full)
    assert torch.equal(rows[0], rows[1])
    torch.testing.assert_close(rows[0], F.linear(x, w), rtol=1e-5, atol=1e-4)   # and it is a linear


def test_a_machine_whose_gemm_is_not_row_invariant_is_refused(tiny, monkeypatch):
    """install() checks this machine's kernels first: one whose rounding of a row depends on how
    many rows the product has (simulated), under every scheme, gets InvariantUnavailableError, and
    the model is left as it was."""
    model, _ = tiny
    m = copy.deepcopy(model)
    real = F.linear

    def skewed(x, w, b=None):
        return real(x, w, b) * (1 + 1e-5 * (x.shape[0] % 3))
    monkeypatch.setattr(inv.F, "linear", skewed)
    with pytest.raises(inv.InvariantUnavailableError, match="invariant mode cannot be used here"):
        inv.install(m)
    assert not inv.installed(m) and not any(isinstance(x, inv.InvariantLinear) for x in m.modules())


def test_a_machine_that_rounds_short_products_apart_gets_the_tiled_scheme(tiny, monkeypatch):
    """A BLAS that rounds products of fewer than 16 rows unlike longer ones (simulated; seen on an
    Intel Xeon for the default model's shapes) fails the first two schemes and is given the tiled one:
    short products padded to 16 rows, long ones in 32-row products. Every row then has the bits
    of a long plain product, so the model computes the same logits in any chunking."""
    model, tok = tiny
    real = F.linear

    def short_apart(x, w, b=None):
        return real(x, w, b) * (1 + 1e-5) if x.shape[0] < 16 else real(x, w, b)
    monkeypatch.setattr(inv.F, "linear", short_apart)
    for scheme in (inv.PAIRS, inv.REFERENCE):
        with pytest.raises(inv.InvariantUnavailableError):
            inv.check(model, scheme=scheme)
    m = copy.deepcopy(model)
    inv.install(m)
    assert inv.installed(m) and all(getattr(x, inv.SCHEME_ATTR) == inv.TILED for x in m.modules())
    ids = [random.Random(2).randrange(100, 5000) for _ in range(90)]
    with torch.inference_mode():
        kv1, one = _chunked(m, ids, [90])
        kv2, pieces = _chunked(m, ids, _cuts(90, 1))                 # every token alone: 1-row products
    assert torch.equal(kv1, kv2) and torch.equal(one, pieces)


def test_attention_matches_sdpa_and_a_query_does_not_depend_on_later_keys():
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 9, 700, 64), torch.randn(1, 3, 700, 64), torch.randn(1, 3, 700, 64)
    out, _ = inv.attention(None, q, k, v, scaling=0.125)
    ref = F.scaled_dot_product_attention(q, k.repeat_interleave(3, 1), v.repeat_interleave(3, 1), is_causal=True,
                                         scale=0.125)
    torch.testing.assert_close(out, ref.transpose(1, 2), rtol=1e-5, atol=1e-5)
    # queries 300..399 over keys 0..399 (a chunk after a cache) == the same rows of the one pass
    part, _ = inv.attention(None, q[:, :, 300:400], k[:, :, :400], v[:, :, :400], scaling=0.125)
    assert torch.equal(part, out[:, 300:400])
    one, _ = inv.attention(None, q[:, :, 555:556], k[:, :, :556], v[:, :, :556], scaling=0.125)
    assert torch.equal(one, out[:, 555:556])
    with pytest.raises(ValueError, match="mask"):
        inv.attention(None, q, k, v, attention_mask=torch.ones(1, 1, 700, 700))


@pytest.mark.parametrize("how", [256, 100, 1, "random"])
def test_kv_and_logits_are_the_same_bytes_in_any_chunking(inv_tiny, how):
    model, tok = inv_tiny
    rng = random.Random(7)
    ids = [rng.randrange(100, 5000) for _ in range(777 if how != 1 else 300)]
    kv1, lg1 = _chunked(model, ids, [len(ids)])
    kv2, lg2 = _chunked(model, ids, _cuts(len(ids), how))
    assert torch.equal(kv1, kv2) and torch.equal(lg1, lg2)


def test_default_kernels_do_differ_by_chunking(tiny):
    """What the mode is for: without it the same prompt chunked differently is other bytes."""
    model, _ = tiny
    rng = random.Random(7)
    ids = [rng.randrange(100, 5000) for _ in range(777)]
    kv1, lg1 = _chunked(model, ids, [len(ids)])
    kv2, lg2 = _chunked(model, ids, _cuts(len(ids), 100))
    assert not (torch.equal(kv1, kv2) and torch.equal(lg1, lg2))
    torch.testing.assert_close(kv1, kv2, rtol=1e-4, atol=1e-4)


def test_one_thread_and_two_compute_the_same_bytes(inv_tiny, threads):
    model, _ = inv_tiny
    rng = random.Random(3)
    ids = [rng.randrange(100, 5000) for _ in range(600)]
    torch.set_num_threads(1)
    a = _chunked(model, ids, [256, 512, 600])
    torch.set_num_threads(2)
    b = _chunked(model, ids, [600])
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@torch.inference_mode()
def test_a_batched_decode_step_equals_each_sequence_alone(inv_tiny):
    model, _ = inv_tiny
    rng = random.Random(5)
    prompts = [[rng.randrange(100, 5000) for _ in range(n)] for n in (40, 300, 7, 129)]

    def fresh():
        caches, last = [], []
        for p in prompts:
            c = make_cache(None, model.config)
            model(input_ids=torch.tensor([p[:-1]]), past_key_values=c, use_cache=True)
            caches.append(c)
            last.append(p[-1])
        return caches, last
    caches, last = fresh()
    together = batching.step(model, caches, last)
    alone_caches, _ = fresh()
    for i, (c, t) in enumerate(zip(alone_caches, last)):
        out = model(input_ids=torch.tensor([[t]]), past_key_values=c, use_cache=True).logits[0, -1]
        assert torch.equal(out, together[i])
        assert torch.equal(_kv(c), _kv(caches[i]))


def test_memory_in_invariant_mode_restores_like_one_plain_pass(tmp_path, tiny):
    model, tok = tiny
    m = copy.deepcopy(model)
    mem = kvmemory.Memory(tmp_path / "inv.kvm", model=m, tokenizer=tok, invariant=True)
    assert inv.installed(m) and mem.fingerprint != fingerprint(model) and mem.info()["kernels"] == inv.MODE
    rng = random.Random(11)
    ids = [rng.randrange(100, 5000) for _ in range(600)]
    st = mem.save(ids)
    cont = [rng.randrange(100, 5000) for _ in range(5)]
    with torch.inference_mode():
        cache = mem.load(st.id).cache()
        got = m(input_ids=torch.tensor([cont]), past_key_values=cache, use_cache=True).logits[0]
        plain = m(input_ids=torch.tensor([ids + cont])).logits[0, len(ids):]
    assert torch.equal(got, plain)
    mem.close()
    # the store records the mode: the default kernels do not open it, nor it a default store
    with pytest.raises(ModelMismatchError, match="invariant-v1 kernels.*invariant=True"):
        kvmemory.Memory(tmp_path / "inv.kvm", model=tiny)
    kvmemory.Memory(tmp_path / "plain.kvm", model=tiny).close()
    with pytest.raises(ModelMismatchError):
        kvmemory.Memory(tmp_path / "plain.kvm", model=copy.deepcopy(model), tokenizer=tok, invariant=True)


def _block_bytes(mem, state_id: str) -> list[bytes]:
    store = mem.store
    rows = store.chain(store.manifest.states[state_id].last_row)
    return [store.read_state_kv([r]).tobytes() for r in rows]


def test_a_partly_stored_block_is_restored_not_recomputed_and_comes_out_the_same_bytes(tmp_path, tiny):
    """Invariant mode: a state that extends a shorter one inside a block (a conversation's next turn)
    restores the stored start of that block and computes only the new tokens; every block it
    commits is byte for byte the block a fresh store computes whole (the canonical computation),
    and verify --recompute (E2) finds nothing. The default kernels compute the block whole."""
    model, tok = tiny
    C = 64
    cfg = StoreConfig(block_tokens=C)
    rng = random.Random(5)
    ids = [rng.randrange(100, 5000) for _ in range(3 * C + 40)]
    turns = [C + 10, C + 30, 2 * C + 1, 2 * C + 50, 3 * C + 40]        # each ends inside a block; two cross one
    m = copy.deepcopy(model)
    mem = kvmemory.Memory(tmp_path / "grow.kvm", model=m, tokenizer=tok, invariant=True, store_config=cfg)
    before = 0
    for n in turns:
        st = mem.save(ids[:n])
        assert st.reused_tokens == before                 # every token of the last turn restored, none computed again
        fresh = kvmemory.Memory(tmp_path / f"fresh-{n}.kvm", model=m, tokenizer=tok, invariant=True,
                                store_config=cfg)          # the state computed from nothing, block by block
        whole = fresh.save(ids[:n])
        assert whole.reused_tokens == 0 and whole.id == st.id and torch.equal(whole.kv, st.kv)
        assert _block_bytes(mem, st.id) == _block_bytes(fresh, whole.id)
        fresh.close()
        before = n
    assert mem.verify(recompute=True) == []
    mem.close()
    plain = kvmemory.Memory(tmp_path / "plain.kvm", model=tiny[0], tokenizer=tok, store_config=cfg)
    plain.save(ids[:C + 10])
    assert plain.save(ids[:C + 30]).reused_tokens == C    # the default kernels: whole blocks only
    plain.close()


def test_a_served_conversation_restores_its_last_turn_whole_and_answers_as_from_nothing(tmp_path, tiny):
    """`serve --invariant`, the official openai client: a session's next turn restores every token
    of the conversation saved at the last turn (it ends inside a block: the default kernels would
    compute that block again), and its reply is the one a fresh server computes from nothing."""
    openai = pytest.importorskip("openai")
    pytest.importorskip("uvicorn")
    from kvmemory.server import create_app
    from tests.server.test_server import _start, words

    rng = random.Random(3)
    model, tok = copy.deepcopy(tiny[0]), tiny[1]
    convo = [{"role": "system", "content": words(rng, 40, "You are terse.")},
             {"role": "user", "content": words(rng, 12)}]
    replies, cached = [], []
    for name in ("served.kvm", "fresh.kvm"):
        mem = kvmemory.Memory(tmp_path / name, model=model, tokenizer=tok, invariant=True)
        srv, t, url = _start(create_app(mem, queue_size=4, batch=2))
        try:
            client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
            msgs = list(convo)
            if name == "served.kvm":                        # a first turn, its reply, then the next turn
                a = client.chat.completions.create(model=mem.model_name, messages=msgs, max_tokens=6,
                                                   temperature=0, prompt_cache_key="s1")
                msgs += [{"role": "assistant", "content": a.choices[0].message.content},
                         {"role": "user", "content": words(rng, 8)}]
                convo = msgs
            else:
                msgs = convo
            r = client.chat.completions.create(model=mem.model_name, messages=msgs, max_tokens=12,
                                               temperature=0, prompt_cache_key="s1")
            replies.append(r.choices[0].message.content)
            cached.append(r.usage.prompt_tokens_details.cached_tokens)
            first = len(mem.tokenizer.apply_chat_template(msgs[:2], tokenize=True, add_generation_prompt=True,
                                                          return_dict=False))
            C = mem.block_tokens
        finally:
            srv.should_exit = True
            t.join(timeout=10)
            mem.close()
    assert first < C                                          # the whole conversation is inside its first block
    # the first turn's saved prompt (all but its last token) restored, not computed; the reply's
    # tokens too where the random model's reply tokenizes back the same (the default kernels: 0)
    assert cached[0] >= first - 1 and cached[1] == 0
    assert replies[0] == replies[1]


@pytest.fixture(scope="module")
def inv_real(real_model):
    return _invariant_copy(real_model)


@pytest.mark.real_model
def test_the_default_model_is_invariant_to_chunking_tokens_and_threads(inv_real, threads):
    """The default model, a prompt past 1K tokens (2,100 in the full run: several 256-key blocks,
    the default kernels' 512-key tiles crossed): one pass == 256-token chunks == random chunks ==
    256-chunked then token by token for the last 24, and one thread == two."""
    model, _ = inv_real
    rng = random.Random(2024)
    ids = [rng.randrange(200, 40000) for _ in range(bound("KVMEMORY_INVARIANT_TOKENS", 1100, 2100))]
    kv1, lg1 = _chunked(model, ids, [len(ids)])
    for cuts in (_cuts(len(ids), 256), _cuts(len(ids), "random"),
                 _cuts(len(ids) - 24, 256) + list(range(len(ids) - 23, len(ids) + 1))):
        kv2, lg2 = _chunked(model, ids, cuts)
        assert torch.equal(kv1, kv2) and torch.equal(lg1, lg2), cuts[:4]
    torch.set_num_threads(1)
    kv3, lg3 = _chunked(model, ids[:700], [300, 700])
    assert torch.equal(kv3, kv1[:, :, :, :, :700]) and torch.equal(lg3, lg1[:700])


@pytest.mark.real_model
def test_the_default_model_decodes_batched_as_alone(inv_real):
    model, _ = inv_real
    rng = random.Random(99)
    starts = []
    for n in (300, 41, 700, 129, 5, 256):
        c = make_cache(None, model.config)
        with torch.inference_mode():
            out = model(input_ids=torch.tensor([[rng.randrange(200, 40000) for _ in range(n)]]), past_key_values=c,
                        use_cache=True)
        starts.append((c, int(out.logits[0, -1].argmax())))
    together = [copy.deepcopy(c) for c, _ in starts]
    toks = [[t] for _, t in starts]
    with torch.inference_mode():
        for _ in range(6):
            outs = batching.step(model, together, [t[-1] for t in toks])
            for t, lg in zip(toks, outs):
                t.append(int(lg.argmax()))
        for (c, t0), t, cb in zip(starts, toks, together):
            alone = [t0]
            for _ in range(6):
                alone.append(int(model(input_ids=torch.tensor([[alone[-1]]]), past_key_values=c,
                                       use_cache=True).logits[0, -1].argmax()))
            assert alone == t and torch.equal(_kv(c), _kv(cb))


def test_through_the_batcher_every_greedy_reply_is_the_one_decoded_alone(inv_tiny):
    """The server's decode loop in invariant mode: sequences from several threads joining and
    leaving its steps decode exactly what each decodes alone (no tie may flip)."""
    import threading

    from kvmemory.decode import greedy
    from tests.test_batching import _prefill, _prompts, _run_threads
    model, _ = inv_tiny
    rng = random.Random(17)
    prompts = _prompts(rng, 8, hi=300)
    lengths = [rng.randrange(1, 30) for _ in prompts]
    alone = [greedy(model, *_prefill(model, p), n, {0}) for p, n in zip(prompts, lengths)]
    b = batching.Batcher(model, threading.RLock(), max_batch=5)
    try:
        got = _run_threads(b, [(*_prefill(model, p), n, None, None) for p, n in zip(prompts, lengths)])
        assert b.widest > 1 and got == alone
    finally:
        b.close()
