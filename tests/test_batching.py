"""Continuous batching (kvmemory/batching.py): one decode step for several sequences, each over its
own cache, against the same sequences decoded alone; the Batcher's loop with sequences from
several threads joining and leaving, stop callbacks, cancellation and seeded sampling; and the
server with several requests in flight (the official openai client against a live uvicorn)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from kvmemory import kv as kvops
from kvmemory.batching import Batcher, forward_many, llama_like, reserve, room_of, serving, step
from kvmemory.decode import greedy, sampler
from kvmemory.model.invariant import InvariantUnavailableError


def _prefill(model, ids):
    cache = kvops.make_cache(None, model.config)
    with torch.inference_mode():
        out = model(input_ids=torch.tensor([ids]), past_key_values=cache, use_cache=True)
    return cache, out.logits[0, -1]


def _prompts(rng, n, lo=3, hi=40, vocab=2000):
    return [[rng.randrange(5, vocab) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


def in_mode(model, mode: str):
    """The model as `mode` computes: default (itself), bfloat16 (a bf16 copy with its float32
    attention, as Memory installs it), invariant or invariant-bfloat16 (a copy in invariant mode;
    skipped where this machine's kernels cannot be)."""
    import copy

    from kvmemory.model import half, invariant as inv
    if mode == "default":
        return model
    model = copy.deepcopy(model)
    if "bfloat16" in mode:
        model = model.to(torch.bfloat16)
    if mode == "bfloat16":
        half.install(model)
        assert half.installed(model)
    if "invariant" in mode:
        try:
            inv.install(model)
        except inv.InvariantUnavailableError as e:
            pytest.skip(f"{mode}: {e}")
    return model


def _decoded_alone(model, prompts, lengths):
    """Each prompt's greedy reply of its length, decoded alone."""
    return [greedy(model, *_prefill(model, p), n, {0}) for p, n in zip(prompts, lengths)]


def test_a_batched_step_is_each_sequence_decoded_alone(tiny, rng):
    model, _ = tiny
    assert llama_like(model)
    prompts = _prompts(rng, 5)
    alone = []
    for p in prompts:
        c, lg = _prefill(model, p)
        t = int(lg.argmax())
        with torch.inference_mode():
            alone.append(model(input_ids=torch.tensor([[t]]), past_key_values=c, use_cache=True).logits[0, -1])
    pairs = [_prefill(model, p) for p in prompts]
    caches = [c for c, _ in pairs]
    out = step(model, caches, [int(lg.argmax()) for _, lg in pairs])
    for a, b, c, p in zip(alone, out, caches, prompts):
        assert c.get_seq_length() == len(p) + 1              # each cache grew by its own token
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    # one sequence: the model's own forward, bit for bit
    c, lg = _prefill(model, prompts[0])
    assert torch.equal(step(model, [c], [int(lg.argmax())])[0], alone[0])


@pytest.mark.parametrize("mode", ["default", "invariant", "invariant-bfloat16"])
def test_forward_many_is_each_sequence_prefilled_alone(tiny, rng, mode):
    """Several sequences' multi-token prefills in one pass: each one's kept logits and its cache
    as its own forward after its own cache gives them (bit for bit in invariant mode, float32 or
    bfloat16, to the last bits of a GEMM over more rows otherwise); one sequence: the model's own
    forward, bit for bit."""
    model = in_mode(tiny[0], mode)
    prompts = _prompts(rng, 4, lo=20, hi=300)
    news = _prompts(rng, 4, lo=1, hi=16)
    keep = [rng.randrange(1, len(t) + 1) for t in news]
    alone, alone_caches = [], []
    for p, t, k in zip(prompts, news, keep):
        c, _ = _prefill(model, p)
        with torch.inference_mode():
            alone.append(model(input_ids=torch.tensor([t]), past_key_values=c, use_cache=True,
                               logits_to_keep=k).logits[0])
        alone_caches.append(c)
    caches = [_prefill(model, p)[0] for p in prompts]
    out = forward_many(model, caches, news, keep)
    for a, b, c, ca, p, t, k in zip(alone, out, caches, alone_caches, prompts, news, keep):
        assert b.shape == (k, model.config.vocab_size) and c.get_seq_length() == len(p) + len(t)
        ka, kb = torch.stack([l.keys for l in ca.layers]), torch.stack([l.keys for l in c.layers])
        if mode != "default":
            assert torch.equal(b, a) and torch.equal(kb, ka)
        else:
            torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(kb, ka, rtol=1e-4, atol=1e-4)
    # windows with room for the new tokens (as the re-rank builds them): written in place, the
    # same logits and KV as through the concatenating caches
    roomy = []
    for p in prompts:
        c, _ = _prefill(model, p)
        kv = torch.stack([torch.stack([l.keys[0], l.values[0]]) for l in c.layers])    # [L, 2, H, T, D]
        buf = kv.new_empty((*kv.shape[:3], kv.shape[3] + 16, kv.shape[4]))
        buf[:, :, :, :kv.shape[3]] = kv
        rc = kvops.make_cache(buf[:, :, :, :kv.shape[3]], model.config, copy=False)
        room_of(rc, buf)
        roomy.append((rc, buf))
    out2 = forward_many(model, [rc for rc, _ in roomy], news, keep)
    for (rc, buf), a, b, t, p in zip(roomy, out, out2, news, prompts):
        n = len(p) + len(t)
        assert rc.layers[0].keys.data_ptr() == buf.data_ptr()          # still views of the buffer
        assert rc.get_seq_length() == n
        reserve(rc, 16 - len(t))                                      # room enough: nothing copied
        assert rc.layers[-1].values.data_ptr() == buf[-1, 1].data_ptr()
        if mode != "default":
            assert torch.equal(b, a)
        else:
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    c, _ = _prefill(model, prompts[0])
    assert torch.equal(forward_many(model, [c], [news[0]], [keep[0]])[0], alone[0])
    for bad in (([], [1]), ([[1, 2]], [3]), ([[1]], [0])):
        with pytest.raises(ValueError, match="forward_many"):
            forward_many(model, [c] * len(bad[0]) or [c], *bad)


def _one_sequence_is_the_models_forward(model, rng, vocab=2000):
    """forward_many / step with one cache (its layer loop: the KV written into reserved room) against
    the model's own forward on a copy: logits and KV equal, bit for bit, for a prompt fed whole on
    an empty cache, a tail of several tokens after a cache, and decode steps in room."""
    import copy
    for _ in range(3):
        p = [rng.randrange(5, vocab) for _ in range(rng.randrange(2, 120))]
        tail = [rng.randrange(5, vocab) for _ in range(rng.randrange(2, 20))]
        ours, theirs = kvops.make_cache(None, model.config), kvops.make_cache(None, model.config)
        with torch.inference_mode():
            for i, ids in enumerate([p, tail] + [[rng.randrange(5, vocab)] for _ in range(4)]):
                if i == 2:
                    reserve(ours, 4)                       # decode steps written in place from here
                a = model(input_ids=torch.tensor([ids]), past_key_values=theirs, use_cache=True,
                          logits_to_keep=1).logits[0, -1]
                b = forward_many(model, [ours], [ids], [1])[0][-1] if len(ids) > 1 else step(model, [ours], ids)[0]
                assert torch.equal(a, b)
                for la, lb in zip(theirs.layers, ours.layers):
                    assert torch.equal(la.keys, lb.keys) and torch.equal(la.values, lb.values)
            assert ours.layers[0].keys.data_ptr() == ours._kvmemory_room[0][0].data_ptr()   # in its room
            assert copy.deepcopy(ours).get_seq_length() == len(p) + len(tail) + 4


@pytest.mark.parametrize("mode", ["default", "invariant", "bfloat16"])
def test_one_sequence_through_the_layer_loop_is_the_models_own_forward(tiny, rng, mode):
    _one_sequence_is_the_models_forward(in_mode(tiny[0], mode), rng)


@pytest.mark.real_model
def test_one_sequence_through_the_layer_loop_is_the_real_models_own_forward(real_model, rng):
    _one_sequence_is_the_models_forward(real_model[0], rng, vocab=40000)


def test_a_step_writes_into_reserved_room_the_same_numbers_as_it_appends(tiny, rng):
    """reserve(): the batched step writes each token's KV in place instead of concatenating the cache;
    logits and caches are bit for bit those of the appending step, also across a step of one (the
    model's own forward, which appends) and a cache that outgrows its room (it appends again)."""
    model, _ = tiny
    prompts = _prompts(rng, 4)
    plain = [_prefill(model, p) for p in prompts]
    roomy = [_prefill(model, p) for p in prompts]
    for (c, _), extra in zip(roomy, (3, 10, 10, 10)):        # the first outgrows its room at the 4th step
        reserve(c, extra)
    toks = [int(lg.argmax()) for _, lg in plain]
    for s_ in range(8):
        idx = [0] if s_ == 4 else range(4)                      # a step of one in between
        a = step(model, [plain[i][0] for i in idx], [toks[i] for i in idx])
        b = step(model, [roomy[i][0] for i in idx], [toks[i] for i in idx])
        assert all(torch.equal(x, y) for x, y in zip(a, b))
        for i, x in zip(idx, a):
            toks[i] = int(x.argmax())
    for (cp, _), (cr, _), p in zip(plain, roomy, prompts):
        assert cr.get_seq_length() == cp.get_seq_length() > len(p)
        assert all(torch.equal(x.keys, y.keys) and torch.equal(x.values, y.values)
                   for x, y in zip(cp.layers, cr.layers))
    room = roomy[1][0]._kvmemory_room                          # the rest still decode in their room
    assert room[0][0].data_ptr() == roomy[1][0].layers[0].keys.data_ptr()


def test_a_fed_prompt_token_decodes_in_the_batch_as_its_own_forward_would(tiny, rng):
    """greedy(feed=): the prompt's last token not yet in the cache. Alone: the model's forward of it,
    then decoding (the same tokens as from its logits); in a batcher: the first row of a step."""
    model, _ = tiny
    prompts = _prompts(rng, 5)
    lengths = [rng.randrange(1, 20) for _ in prompts]
    alone = _decoded_alone(model, prompts, lengths)
    for p, n, a in zip(prompts, lengths, alone):
        assert greedy(model, _prefill(model, p[:-1])[0], None, n, {0}, feed=p[-1]) == a
    with pytest.raises(ValueError, match="feed"):
        greedy(model, _prefill(model, prompts[0])[0], None, 3, {0})
    b = Batcher(model, threading.RLock(), max_batch=8)
    try:
        out = [None] * len(prompts)
        start = threading.Barrier(len(prompts))

        def run(i):
            serving(b)
            c, _ = _prefill(model, prompts[i][:-1])
            start.wait()
            out[i] = greedy(model, c, None, lengths[i], {0}, feed=prompts[i][-1])
        ts = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
        for t in ts:
            t.start()
        for t in ts:
            t.join(timeout=120)
        assert b.widest > 1
        assert [len(o) for o in out] == [len(a) for a in alone]
        assert sum(o == a for o, a in zip(out, alone)) >= len(prompts) - 1, (out, alone)
    finally:
        b.close()


@pytest.mark.parametrize("mode", ["default", "invariant"])
def test_a_fed_prompt_tail_of_several_tokens_decodes_in_the_batch_as_alone(tiny, rng, mode):
    """greedy(feed=[...]): a prompt's last tokens (an ask's question) not yet in the cache: alone,
    kv.last_logits of them then decoding; in a batcher, rows of a step (forward_many) beside the
    others' one-token rows. Some prompts are fed whole, on an empty cache (a chat too short to save
    a forward): after their first step they get reserved room like the others (no concatenation of
    the cache a step). Invariant mode: every reply is the one decoded alone, token for token."""
    import copy

    from kvmemory.model import invariant as inv
    model = tiny[0]
    if mode == "invariant":
        model = copy.deepcopy(model)
        inv.install(model)
    prompts = _prompts(rng, 6, lo=20, hi=60)
    tails = [rng.randrange(2, 15) if i % 3 == 0 else 1 if i % 3 == 1 else len(prompts[i]) for i in range(len(prompts))]
    lengths = [rng.randrange(2, 20) for _ in prompts]

    def prefix(i):                               # the cache before the fed tail (a whole prompt: empty)
        k = tails[i]
        return kvops.make_cache(None, model.config) if k == len(prompts[i]) else _prefill(model, prompts[i][:-k])[0]
    firsts_alone = [[] for _ in prompts]
    alone = [greedy(model, prefix(i), None, n, {0}, feed=p[-k:], first=f)
             for i, (p, k, n, f) in enumerate(zip(prompts, tails, lengths, firsts_alone))]
    if mode == "invariant":                     # the tail fed or prefilled with the rest: the same reply
        assert alone == _decoded_alone(model, prompts, lengths)
    b = Batcher(model, threading.RLock(), max_batch=8)
    try:
        out = [None] * len(prompts)
        firsts = [[] for _ in prompts]
        caches = [prefix(i) for i in range(len(prompts))]
        start = threading.Barrier(len(prompts))

        def run(i):
            serving(b)
            c = caches[i]
            start.wait()
            k = tails[i]
            out[i] = greedy(model, c, None, lengths[i], {0}, feed=prompts[i][-k:] if k > 1 else prompts[i][-1],
                            first=firsts[i])
        _each_in_a_thread(len(prompts), run, timeout=120)
        assert b.widest > 1 and b.rows > b.steps
        assert [len(o) for o in out] == [len(a) for a in alone]
        assert all(len(f) == 1 for f in firsts)             # the logits each first token came from
        decoded_on = [i for i, o in enumerate(out) if len(o) >= 2]     # still in the loop after a step
        assert any(tails[i] == len(prompts[i]) for i in decoded_on)
        assert all(getattr(caches[i], "_kvmemory_room", None) is not None for i in decoded_on)
        if mode == "invariant":
            assert out == alone
            assert all(torch.equal(f[0], a[0]) for f, a in zip(firsts, firsts_alone))
        else:
            assert sum(o == a for o, a in zip(out, alone)) >= len(prompts) - 1, (out, alone)
            for f, a in zip(firsts, firsts_alone):
                torch.testing.assert_close(f[0], a[0], rtol=1e-4, atol=1e-4)
    finally:
        b.close()


def _each_in_a_thread(n: int, fn, timeout: float = 300) -> None:
    """fn(0) .. fn(n - 1), each on a thread of its own, all started before any is joined."""
    ts = [threading.Thread(target=fn, args=(i,)) for i in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout=timeout)


def _run_threads(batcher, jobs):
    """jobs: [(cache, logits, max_new, on_token, pick)] decoded from one thread each -> replies."""
    out = [None] * len(jobs)
    lock = batcher.lock
    start = threading.Barrier(len(jobs))

    def run(i, job):
        serving(batcher)
        start.wait()
        with lock:                                           # as a request holds the Memory's lock
            out[i] = greedy(batcher.model, job[0], job[1], job[2], {0}, on_token=job[3], pick=job[4])
    ts = [threading.Thread(target=run, args=(i, j)) for i, j in enumerate(jobs)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout=120)
    return out


def test_sequences_from_many_threads_decode_together_as_they_would_alone(tiny, rng):
    model, _ = tiny
    prompts = _prompts(rng, 6)
    lengths = [rng.randrange(1, 30) for _ in prompts]
    alone = _decoded_alone(model, prompts, lengths)
    b = Batcher(model, threading.RLock(), max_batch=4)
    try:
        got = _run_threads(b, [(*_prefill(model, p), n, None, None) for p, n in zip(prompts, lengths)])
        assert b.widest > 1 and b.rows > b.steps                   # several decoded in one step
        assert b.widest <= 4                                       # never more than max_batch
        assert [len(g) for g in got] == [len(a) for a in alone]
        same = sum(g == a for g, a in zip(got, alone))
        assert same >= len(prompts) - 1, (got, alone)            # greedy replies unchanged (ties aside)
    finally:
        b.close()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_invariant_rows_make_a_batched_step_each_sequence_alone_bit_for_bit(tiny, rng, dtype):
    """forward_many(rows=the machine's row scheme): every Linear reduces a row the same way whatever
    the number of rows, so each sequence's logits and KV in a batch (decode rows beside prompt
    tails) are the bits it gets through the same loop alone; a Batcher with invariant_rows decodes
    each sequence's greedy tokens and KV as it decodes them alone."""
    import copy

    from kvmemory.model import invariant as inv
    model = in_mode(tiny[0], dtype if dtype != "float32" else "default")
    scheme = inv.choose(model)
    prompts = _prompts(rng, 5, lo=20, hi=200)
    news = [[rng.randrange(5, 2000) for _ in range(1 if i % 2 else rng.randrange(2, 30))] for i in range(5)]
    keep = [1 if len(t) == 1 else rng.randrange(1, len(t) + 1) for t in news]
    caches = [_prefill(model, p)[0] for p in prompts]
    alone_caches = [copy.deepcopy(c) for c in caches]
    together = forward_many(model, caches, news, keep, scheme)
    for c, ca, t, k, b in zip(caches, alone_caches, news, keep, together):
        a = forward_many(model, [ca], [t], [k], scheme)[0]
        assert a.dtype == getattr(torch, dtype) and torch.equal(a, b)
        for la, lb in zip(ca.layers, c.layers):
            assert torch.equal(la.keys, lb.keys) and torch.equal(la.values, lb.values)
    lengths = [rng.randrange(8, 30) for _ in prompts]
    alone_b = Batcher(model, threading.RLock(), max_batch=1, invariant_rows=True)
    many_b = Batcher(model, threading.RLock(), max_batch=4, invariant_rows=True)
    assert alone_b.scheme == many_b.scheme == scheme
    try:
        alone = [_run_threads(alone_b, [(*_prefill(model, p), n, None, None)])[0] for p, n in zip(prompts, lengths)]
        got = _run_threads(many_b, [(*_prefill(model, p), n, None, None) for p, n in zip(prompts, lengths)])
        assert many_b.widest > 1 and alone_b.widest == 1
        assert got == alone
    finally:
        alone_b.close()
        many_b.close()
    with pytest.raises(ValueError, match="invariant_rows"):
        Batcher(torch.nn.Linear(2, 2), threading.RLock(), invariant_rows=True)


def test_a_stop_or_cancel_ends_one_sequence_and_not_the_others(tiny, rng):
    model, _ = tiny
    prompts = _prompts(rng, 3)
    b = Batcher(model, threading.RLock(), max_batch=8)
    seen = []
    try:
        cancel_at_3 = lambda ids: len(ids) >= 3                  # noqa: E731 -- a client that went away
        def fails(ids):
            if len(ids) == 2:
                raise ValueError("callback broke")
            return False
        jobs = [(*_prefill(model, prompts[0]), 40, cancel_at_3, None),
                (*_prefill(model, prompts[1]), 25, lambda ids: seen.append(len(ids)) and False, None),
                (*_prefill(model, prompts[2]), 40, fails, None)]
        errors = []

        def guarded(i, job, out):
            serving(b)
            try:
                out[i] = greedy(model, job[0], job[1], job[2], {0}, on_token=job[3])
            except ValueError as e:
                errors.append(str(e))
        out = [None] * 3
        ts = [threading.Thread(target=guarded, args=(i, j, out)) for i, j in enumerate(jobs)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(timeout=120)
        assert len(out[0]) == 3                                   # cancelled after its third token
        assert len(out[1]) == 25 and seen == list(range(1, 26))  # every token reported, in order
        assert errors == ["callback broke"] and out[2] is None   # its error reached its own caller
    finally:
        b.close()


def test_seeded_sampling_in_a_batch_is_reproducible(tiny, rng):
    model, _ = tiny
    prompts = _prompts(rng, 4)

    def once():
        b = Batcher(model, threading.RLock(), max_batch=4)
        try:
            return _run_threads(b, [(*_prefill(model, p), 20, None, sampler(1.0, 0.9, seed=100 + i))
                                    for i, p in enumerate(prompts)])
        finally:
            b.close()
    first, second = once(), once()
    assert first == second
    assert len({tuple(x) for x in first}) > 1                      # each has its own generator


def test_an_error_in_the_step_reaches_every_sequence_of_it(tiny, rng):
    model, _ = tiny
    b = Batcher(model, threading.RLock(), max_batch=4)
    try:
        c, lg = _prefill(model, _prompts(rng, 1)[0])
        serving(b)
        try:
            # a cache of another geometry: the forward fails, the caller gets the error, the loop lives on
            wrong = kvops.make_cache(torch.zeros((1, 2, 1, 3, 5)), model.config)
            with pytest.raises(Exception):
                greedy(model, wrong, lg, 5, {0})
            assert len(greedy(model, c, lg, 5, set())) == 5
        finally:
            serving(None)
    finally:
        b.close()


@pytest.mark.parametrize("mode", ["default", "invariant", "bfloat16", "invariant-bfloat16"])
def test_the_server_decodes_requests_in_flight_together(tmp_path, tiny, rng, mode):
    """Several clients at once (the official openai client, plain and streamed, greedy and seeded,
    with stop strings, one that goes away mid-stream): each gets what it gets served alone; in
    invariant mode (float32 or bfloat16), and in bfloat16 (whose server reduces a batch's rows
    alike by default: create_app's invariant_rows), every one of them, with no near-tie allowed
    to flip."""
    openai = pytest.importorskip("openai")
    pytest.importorskip("uvicorn")
    import kvmemory
    from kvmemory.server import create_app
    from tests.server.test_server import _start, words

    invariant = "invariant" in mode
    model = (in_mode(tiny[0], mode), tiny[1])         # installed in a copy (idempotent: Memory installs it again)
    mem = kvmemory.Memory(tmp_path / "b.kvm", model=model, invariant=invariant)
    assert mem.kv_dtype == (torch.bfloat16 if "bfloat16" in mode else torch.float32)
    app = create_app(mem, queue_size=16, batch=4)
    assert (app.state.worker.batcher.scheme is not None) == (mode == "bfloat16")   # the default by dtype
    srv, t, url = _start(app)
    try:
        import httpx
        health = httpx.get(url + "/health").json()
        assert health["dtype"] == str(mem.kv_dtype).removeprefix("torch.")
        assert health["invariant_rows"] == (mode == "bfloat16")
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        reqs = [dict(messages=[{"role": "user", "content": words(rng, rng.randrange(5, 60), f"q{i}")}],
                     max_tokens=rng.randrange(20, 48), temperature=0 if i % 2 == 0 else 0.9,
                     seed=None if i % 2 == 0 else 1000 + i, stream=i % 3 == 0) for i in range(6)]

        def call(r):
            if r["stream"]:
                s = client.chat.completions.create(model=mem.model_name, **r)
                return "".join(c.choices[0].delta.content or "" for c in s if c.choices)
            return client.chat.completions.create(model=mem.model_name, **r).choices[0].message.content

        alone = [call(r) for r in reqs]                              # one after another
        assert app.state.worker.batcher.widest == 1
        base = alone[0]
        assert len(base) > 4
        stop = base[2:5]
        stop_req = {k: v for k, v in reqs[0].items() if k != "stream"}
        cut = []
        out = [None] * len(reqs)
        gone = []

        def run(i):
            out[i] = call(reqs[i])

        def stopper():                                               # a stop string, among the others
            cut.append(client.chat.completions.create(model=mem.model_name, stop=[stop], **stop_req))

        def leaver():                                                # a stream dropped after one chunk
            with client.chat.completions.create(model=mem.model_name, stream=True, max_tokens=200,
                                                messages=[{"role": "user", "content": words(rng, 30)}]) as s:
                for _ in s:
                    gone.append(1)
                    break
        ts = [threading.Thread(target=run, args=(i,)) for i in range(len(reqs))] + [threading.Thread(target=leaver),
                                                                                   threading.Thread(target=stopper)]
        for th in ts:
            th.start()
        for th in ts:
            th.join(timeout=300)
        assert app.state.worker.batcher.widest > 1                  # they did decode together
        same = sum(a == b for a, b in zip(out, alone))
        assert same >= len(reqs) - (1 if mode == "default" else 0), list(zip(out, alone))
        assert gone == [1]
        # the stop string cut its reply where it starts, in the batch as alone
        assert cut[0].choices[0].message.content == base[:base.find(stop)]
        assert cut[0].choices[0].finish_reason == "stop"
        deadline = time.time() + 30
        while app.state.worker.pending and time.time() < deadline:
            time.sleep(0.05)
        assert app.state.worker.pending == 0                         # the leaver's slot came back
    finally:
        srv.should_exit = True
        t.join(timeout=10)
        mem.close()


@pytest.mark.parametrize("mode", ["default", "invariant", "invariant-bfloat16"])
def test_asks_in_flight_decode_together_as_each_would_alone(tmp_path, tiny, rng, mode):
    """Several asks at once through a live server: each one's question joins the decode loop as
    rows of a step (greedy's feed) beside the others' decoding; each answer is the one the same
    ask gets alone in-process (in invariant mode, float32 or bfloat16, every one, no near-tie
    allowed to flip), and its stats still time the question's prefill into its TTFT."""
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("uvicorn")
    import kvmemory
    from kvmemory.server import create_app
    from tests.server.test_server import _start, words

    invariant = mode != "default"
    model = (in_mode(tiny[0], mode), tiny[1])
    mem = kvmemory.Memory(tmp_path / "a.kvm", model=model, invariant=invariant)
    for d in range(3):
        mem.add(words(rng, 700, f"doc{d}"), doc_id=f"d{d}")
    qs = [dict(question=words(rng, rng.randrange(3, 12), f"q{i}") + "?", max_new_tokens=rng.randrange(4, 16),
               min_relevance=0.0, rerank=0 if i % 2 else 4) for i in range(6)]
    alone = [mem.ask(q["question"], **{k: v for k, v in q.items() if k != "question"}).text for q in qs]
    app = create_app(mem, queue_size=16, batch=4)
    srv, t, url = _start(app)
    try:
        out = [None] * len(qs)
        start = threading.Barrier(len(qs))

        def run(i):
            start.wait()
            r = httpx.post(url + "/v1/ask", json=qs[i], timeout=300)
            r.raise_for_status()
            out[i] = r.json()
        ts = [threading.Thread(target=run, args=(i,)) for i in range(len(qs))]
        for th in ts:
            th.start()
        for th in ts:
            th.join(timeout=300)
        assert app.state.worker.batcher.widest > 1                  # they did decode together
        same = sum(o["answer"] == a for o, a in zip(out, alone))
        assert same >= len(qs) - (0 if invariant else 1), [(o["answer"], a) for o, a in zip(out, alone)]
        for o in out:
            tm = o["stats"]["timings_s"]
            assert 0 < tm["first_token"] <= tm["ttft"] and tm["decode"] >= 0
    finally:
        srv.should_exit = True
        t.join(timeout=10)
        mem.close()


def test_a_deposit_gives_way_to_a_question_between_blocks(tmp_path, tiny, rng):
    """A long deposit on a thread that defers (as the server's deposit thread does): a prompt saved
    meanwhile from another thread finishes while the deposit is still running, and the deposit's
    blocks are the bytes of the same deposit run alone."""
    import kvmemory
    from tests.server.test_server import words
    text = words(rng, 6000)
    ref = kvmemory.Memory(tmp_path / "ref.kvm", model=tiny, segment_blocks=1)
    ref.add(text, doc_id="long")
    want = [bytes(b) for b in ref.store.block_meta(ref.store.manifest.docs["long"].rows)["block_id"]]
    ref.close()

    mem = kvmemory.Memory(tmp_path / "m.kvm", model=tiny, segment_blocks=1)
    waiting = threading.Event()
    started, done = threading.Event(), []

    class Progress:
        total = None

        def refresh(self):
            pass

        def update(self, n):
            started.set()

    def deposit():
        mem.defer_to(waiting.is_set)
        mem.add(text, doc_id="long", progress=Progress())
        done.append(time.monotonic())
    t = threading.Thread(target=deposit)
    t.start()
    assert started.wait(60)
    waiting.set()
    st = mem.save(words(rng, 40), label="meanwhile")
    saved_at = time.monotonic()
    waiting.clear()
    t.join(timeout=300)
    assert done and saved_at < done[0]                      # the question did not wait for the document
    assert st.n_tokens > 0
    got = [bytes(b) for b in mem.store.block_meta(mem.store.manifest.docs["long"].rows)["block_id"]]
    assert got == want                                      # paused or not: the same blocks
    mem.close()


def test_a_reply_is_saved_after_its_response_once_with_the_next_turn_or_when_idle(tmp_path, tiny, rng):
    """The save of a session's conversation with its reply waits until after the response: it is
    folded into the session's next turn (whose prompt holds the reply), or runs once the server has
    been idle a moment, or at shutdown; a next turn that does not extend it (a trimmed history)
    drops it. It stores what a later turn restores (ChatService.restorable: here whole 8-token
    blocks), nothing when that is no more than the prompt saved. The replies are those of a server
    that saves every reply before the next turn."""
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("uvicorn")
    import kvmemory
    from kvmemory.config import StoreConfig
    from kvmemory.server import create_app
    from kvmemory.server.chat import IDLE_GRACE_S
    from tests.server.test_server import _start, words

    system = {"role": "system", "content": words(rng, 80, "Be brief.")}
    asks = [words(rng, 12, f"turn{i}") for i in range(3)]

    def settle(c, deadline=30):
        end = time.time() + deadline
        while c.later and time.time() < end:       # idle: the flusher saves it
            time.sleep(0.05)

    def conversation(app, url, busy):
        c = app.state.ctx.chat
        real = c.pending
        history, replies, deferred, lens = [system], [], [], []
        for i, a in enumerate(asks):
            history.append({"role": "user", "content": a})
            c.pending = (lambda: 2) if busy else real            # another request waiting, or none
            r = httpx.post(url + "/v1/chat/completions", timeout=120, json={
                "model": "kvmemory", "messages": history, "temperature": 0, "max_tokens": 12,
                "prompt_cache_key": "s1"}).json()
            # answered before its save: the flusher waits IDLE_GRACE_S after the request left
            n = len(c.later)
            deferred.append(n if busy or time.monotonic() - app.state.worker.released_at < IDLE_GRACE_S else None)
            if not busy:
                settle(c)
            replies.append(r["choices"][0]["message"]["content"])
            lens.append((r["usage"]["prompt_tokens"], r["usage"]["completion_tokens"]))
            history.append({"role": "assistant", "content": replies[-1]})
        return replies, deferred, history, real, lens

    def adds(c, n, k):          # whether the save of a prompt of n tokens and its reply of k stores more
        return c.restorable(n + k) > c.saved_part(n)

    small = StoreConfig(block_tokens=8)
    m1 = kvmemory.Memory(tmp_path / "idle.kvm", model=tiny, store_config=small)
    app1 = create_app(m1)
    srv, t, url = _start(app1)
    try:
        want, was_deferred, history, _, lens = conversation(app1, url, busy=False)
        assert [d for d in was_deferred if d is not None] and all(d in (1, None) for d in was_deferred)
        c = app1.state.ctx.chat
        assert not c.later                                        # each saved while idle, before the next turn
        n, k = lens[-1]                                           # the last prompt and its reply
        assert k >= 9 and adds(c, n, k)                           # a reply of 9+ tokens completes a block
        assert max(s.n_tokens for s in m1.states()) == c.restorable(n + k) >= n
        assert httpx.get(url + "/v1/sessions/s1").json()["turns"] == 3
        # a next turn that trims the history: the first turn's save (deferred, busy) is dropped
        c.pending = lambda: 2
        first = [system, {"role": "user", "content": words(rng, 12, "another")}]   # no state of it yet
        httpx.post(url + "/v1/chat/completions", timeout=120, json={
            "model": "kvmemory", "messages": first, "temperature": 0, "max_tokens": 12,
            "prompt_cache_key": "s3"}).raise_for_status()
        assert "s3" in c.later
        before = {s.id for s in m1.states()}
        trimmed = [system, {"role": "user", "content": asks[2]}]
        r2 = httpx.post(url + "/v1/chat/completions", timeout=120, json={
            "model": "kvmemory", "messages": trimmed, "temperature": 0, "max_tokens": 12,
            "prompt_cache_key": "s3"}).json()
        assert c.dropped == 1 and "s3" in c.later                 # the first's dropped; the second's waits
        new = [s for s in m1.states() if s.id not in before]
        k = c.saved_part(len(c.ids(trimmed)))
        assert [s.n_tokens for s in new] == ([k] if k else [])   # only the trimmed turn's prompt
        rec = httpx.get(url + "/v1/sessions/s3").json()
        assert rec["turns"] == 2                                  # both recorded when answered
        assert len(rec["states"]) == bool(k) + bool(c.saved_part(len(c.ids(first))))
        c.pending = lambda: 0
        settle(c)
        after = httpx.get(url + "/v1/sessions/s3").json()
        last = [s for s in m1.states() if s.id == after["states"][-1]]
        n2, k2 = r2["usage"]["prompt_tokens"], r2["usage"]["completion_tokens"]
        assert k2 >= 9 and adds(c, n2, k2)
        assert not c.later and after["turns"] == 2 and len(after["states"]) == len(rec["states"]) + 1
        assert last and last[0].n_tokens == c.restorable(n2 + k2) > len(c.ids(trimmed)) - 1   # the second's save added
    finally:
        srv.should_exit = True
        t.join(timeout=10)
        m1.close()

    m2 = kvmemory.Memory(tmp_path / "busy.kvm", model=tiny, store_config=small)
    app2 = create_app(m2)
    srv, t, url = _start(app2)
    try:
        got, deferred, history, real, lens = conversation(app2, url, busy=True)
        assert got == want                                        # the same replies, each save folded
        assert deferred == [1, 1, 1]                              # each turn's save waits (one a session)
        rec = httpx.get(url + "/v1/sessions/s1").json()
        assert rec["turns"] == 3                                  # recorded when answered; two saves folded
        prompts = {app2.state.ctx.chat.saved_part(len(app2.state.ctx.chat.ids(history[:j])))
                   for j in (2, 4, 6)} - {0}
        assert len(rec["states"]) == len(prompts)                 # the prompts' states, no reply's yet
        ids = app2.state.ctx.chat.ids(history[:-1])
        assert max((s.n_tokens for s in m2.states()), default=0) < len(ids)    # the last reply is not saved yet
        app2.state.ctx.chat.pending = real                        # the server is idle again
        deadline = time.time() + 30
        while app2.state.ctx.chat.later and time.time() < deadline:   # idle: the flusher saves it
            time.sleep(0.05)
        assert not app2.state.ctx.chat.later
        rec = httpx.get(url + "/v1/sessions/s1").json()
        n, k = lens[-1]
        assert adds(app2.state.ctx.chat, n, k)
        assert rec["turns"] == 3 and len(rec["states"]) == len(prompts) + 1   # the last reply's state added
        assert max(s.n_tokens for s in m2.states()) == app2.state.ctx.chat.restorable(n + k) >= len(ids)
        # deferred at shutdown: saved before the server stops
        history.append({"role": "user", "content": words(rng, 12, "last")})
        app2.state.ctx.chat.pending = lambda: 2
        r = httpx.post(url + "/v1/chat/completions", timeout=120, json={
            "model": "kvmemory", "messages": history, "temperature": 0, "max_tokens": 12,
            "prompt_cache_key": "s1"}).json()
        assert len(app2.state.ctx.chat.later) == 1
        final = app2.state.ctx.chat.ids(history) + []
        # a session forgotten while its first turn's save waits: gone, and not brought back later
        httpx.post(url + "/v1/chat/completions", timeout=120, json={
            "model": "kvmemory", "messages": [system, {"role": "user", "content": "hello"}], "max_tokens": 4,
            "prompt_cache_key": "s2"})
        assert "s2" in app2.state.ctx.chat.later
        d = httpx.delete(url + "/v1/sessions/s2").json()
        c2 = app2.state.ctx.chat
        assert d["deleted"] is True and d["states"] == bool(c2.saved_part(len(c2.ids(
            [system, {"role": "user", "content": "hello"}]))))
        assert "s2" not in app2.state.ctx.chat.later
        assert httpx.get(url + "/v1/sessions/s2").status_code == 404
    finally:
        srv.should_exit = True
        t.join(timeout=10)
    assert not app2.state.ctx.chat.later
    n, k = r["usage"]["prompt_tokens"], r["usage"]["completion_tokens"]
    assert k >= 9 and n == len(final)
    assert max(s.n_tokens for s in m2.states()) == app2.state.ctx.chat.restorable(n + k) > len(final)   # prompt + reply
    m2.close()


def test_a_chat_saves_its_prompts_whole_forwards_and_feeds_the_rest_to_the_batch(tmp_path, tiny, rng, monkeypatch):
    """A chat request saves its prompt up to its last whole forward of the store's prefill (the part
    a later turn restores) and decodes the rest as rows of the batched steps; every block stored,
    before and after the deferred saves, is the canonical computation's (verify recompute); a
    deferred save stores the conversation with its reply up to its last whole forward; the
    same prompt again, alone, restores the same part and gives the same reply, bit for bit; the
    deferred saves of requests without a session are bounded."""
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("uvicorn")
    import kvmemory
    from kvmemory.config import StoreConfig
    from kvmemory.server import chat as chat_mod, create_app
    from tests.server.test_server import _start, words

    C, Q = 64, 16
    mem = kvmemory.Memory(tmp_path / "q.kvm", model=tiny, store_config=StoreConfig(block_tokens=C, prefill_tokens=Q))
    app = create_app(mem, batch=8)
    srv, t, url = _start(app)
    c = app.state.ctx.chat
    real = c.pending
    convs = [[{"role": "system", "content": words(rng, rng.randrange(20, 90), "Be brief.")},
              {"role": "user", "content": words(rng, rng.randrange(3, 30), f"q{i}")}] for i in range(6)]
    try:
        c.pending = lambda: 2                                   # busy: nothing deferred runs yet
        out = [None] * len(convs)

        def send(i):
            out[i] = httpx.post(url + "/v1/chat/completions", timeout=120, json={
                "model": "kvmemory", "messages": convs[i], "temperature": 0, "max_tokens": Q,
                "prompt_cache_key": f"c{i}"}).json()
        ts = [threading.Thread(target=send, args=(i,)) for i in range(len(convs))]
        for th in ts:
            th.start()
        for th in ts:
            th.join()
        assert all(o["usage"]["completion_tokens"] > 0 for o in out)
        sizes = [len(c.ids(m)) for m in convs]
        cuts = {c.saved_part(n) for n in sizes} - {0}
        assert all(0 <= n - 1 - c.saved_part(n) < Q for n in sizes)
        assert {st.n_tokens for st in mem.states()} == cuts          # only whole forwards saved so far
        assert len(mem.states()) == sum(c.saved_part(n) > 0 for n in sizes)
        assert any(n - 1 - c.saved_part(n) >= 2 for n in sizes)      # some fed several rows to the batch
        assert len(c.later) == len(convs)
        assert mem.verify(recompute=True) == []
        c.pending = real
        end = time.time() + 60
        while c.later and time.time() < end:
            time.sleep(0.05)
        assert not c.later
        replies = [c.restorable(n + o["usage"]["completion_tokens"]) for n, o in zip(sizes, out)]
        assert all(r % Q == 0 for r in replies)                    # whole forwards only
        grew = sum(r > c.saved_part(n) for r, n in zip(replies, sizes))
        assert all(r > c.saved_part(n) for r, n, o in zip(replies, sizes, out)       # Q new tokens: a forward more
                   if o["usage"]["completion_tokens"] == Q) and grew > 0
        assert len(mem.states()) == sum(c.saved_part(n) > 0 for n in sizes) + grew   # + each reply that completed a forward
        assert {st.n_tokens for st in mem.states()} == cuts | {r for r, n in zip(replies, sizes) if r > c.saved_part(n)}
        assert mem.verify(recompute=True) == []                       # canonical, every block
        # alone, twice: the second restores what the first saved and computes the rest the same way
        more = convs[0] + [{"role": "user", "content": words(rng, 9, "more")}]
        alone = [httpx.post(url + "/v1/chat/completions", timeout=120, json={
            "model": "kvmemory", "messages": more, "temperature": 0, "max_tokens": 8}).json() for _ in range(2)]
        assert [a["usage"]["prompt_tokens_details"]["cached_tokens"] for a in alone][1] == c.saved_part(
            alone[1]["usage"]["prompt_tokens"])
        assert alone[0]["choices"][0]["message"]["content"] == alone[1]["choices"][0]["message"]["content"]
        # requests without a session: their deferred saves are bounded, the oldest dropped
        monkeypatch.setattr(chat_mod, "MAX_DEFERRED", 2)
        c.pending = lambda: 2

        def whole(i):       # a prompt of a multiple of Q tokens: its save stores one more forward, reply or not
            for n_words in range(3, 60):
                for _ in range(4):      # several draws a length: a word of two tokens can step over a multiple
                    m = [{"role": "user", "content": words(rng, n_words, f"n{i}")}]
                    if len(c.ids(m)) % Q == 0:
                        return m
            raise AssertionError("no prompt of a multiple of Q tokens drawn")
        for i in range(4):
            httpx.post(url + "/v1/chat/completions", timeout=120, json={
                "model": "kvmemory", "messages": whole(i), "max_tokens": 2}).raise_for_status()
        assert len(c.later) == 2 and c.dropped >= 2                # two of these four
        # a deferred save that fails is reported and dropped; the others still run
        real_save = mem.save

        def failing(ids, *a, **k):
            if mem.save is failing and len(c.later) == 2:
                raise OSError("disk full")
            return real_save(ids, *a, **k)
        monkeypatch.setattr(mem, "save", failing)
        n_states = len(mem.states())
        assert c.flush(all_=True) == 2 and c.failed == 1 and not c.later
        assert len(mem.states()) == n_states + 1
    finally:
        c.pending = real
        srv.should_exit = True
        t.join(timeout=10)
    mem.close()


def test_the_real_model_decodes_the_same_greedy_replies_batched(real_model, rng):
    """The default model: six prompts of real text decoded together, as they would be alone."""
    model, tok = real_model
    topics = ["the harbour at dawn", "a recipe for bread", "why the sky is blue", "the rules of chess",
              "a letter to a friend", "the history of maps", "how bees make honey", "a trip to the mountains"]
    prompts = [tok.apply_chat_template([{"role": "user", "content": f"Write two sentences about {t}."}],
                                       tokenize=True, add_generation_prompt=True, return_dict=False)
               for t in rng.sample(topics, 6)]
    alone = []
    for p in prompts:
        c, lg = _prefill(model, p)
        alone.append(greedy(model, c, lg, 24, {tok.eos_token_id}))
    b = Batcher(model, threading.RLock(), max_batch=6)
    try:
        out = [None] * len(prompts)
        start = threading.Barrier(len(prompts))

        def run(i, p):
            serving(b)
            c, lg = _prefill(model, p)
            start.wait()
            out[i] = greedy(model, c, lg, 24, {tok.eos_token_id})
        ts = [threading.Thread(target=run, args=(i, p)) for i, p in enumerate(prompts)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(timeout=300)
        assert b.widest > 1
        assert sum(o == a for o, a in zip(out, alone)) >= len(prompts) - 1, [tok.decode(x) for x in out + alone]
    finally:
        b.close()


@pytest.mark.real_model
def test_the_real_model_in_bfloat16_decodes_every_greedy_reply_batched_as_alone(real_model, rng):
    """The default model in bfloat16, prompts fed whole (as a chat's) joining a batch at staggered
    steps: with invariant rows (the server's default for bfloat16) every reply is the one decoded
    alone through the same loop, token for token. Without them a one-row product of the MLP's
    down projection rounds ~10% of rows unlike a longer one, and about 1 reply in 3 differed in
    the server (bench_serve; docs/concepts/precision.md)."""
    model, tok = in_mode(real_model[0], "bfloat16"), real_model[1]
    topics = ["the harbour at dawn", "a recipe for bread", "why the sky is blue", "the rules of chess",
              "a letter to a friend", "the history of maps", "how bees make honey", "a trip to the mountains"]
    prompts = [tok.apply_chat_template([{"role": "user", "content": f"Write two sentences about {t}."}],
                                       tokenize=True, add_generation_prompt=True, return_dict=False)
               for t in rng.sample(topics, 8)]

    def decode(b, delays):
        out = [None] * len(prompts)

        def run(i):
            serving(b)
            time.sleep(delays[i])
            out[i] = greedy(model, kvops.make_cache(None, model.config), None, 24, {tok.eos_token_id},
                            feed=prompts[i])
        _each_in_a_thread(len(prompts), run)
        return out
    try:
        alone_b = Batcher(model, threading.RLock(), max_batch=1, invariant_rows=True)
    except InvariantUnavailableError as e:       # the server then says so and runs plain (test_dtype)
        pytest.skip(f"invariant rows in bfloat16 on this machine: {e}")
    many_b = Batcher(model, threading.RLock(), max_batch=8, invariant_rows=True)
    try:
        out_alone = [None] * len(prompts)
        for i in range(len(prompts)):                                 # one after another
            serving(alone_b)
            out_alone[i] = greedy(model, kvops.make_cache(None, model.config), None, 24, {tok.eos_token_id},
                                  feed=prompts[i])
            serving(None)
        out = decode(many_b, [0.0, 0.0, 0.05, 0.1, 0.1, 0.2, 0.3, 0.45])
        assert many_b.widest > 1 and alone_b.widest == 1
        assert out == out_alone, [tok.decode(x) for x in out + out_alone]
    finally:
        alone_b.close()
        many_b.close()
