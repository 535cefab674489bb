"""Chat memory over HTTP, from the official openai client against a live server: a user's earlier
sessions recalled as KV into a new one (the response says what), isolation between users (no
recall, no cache hit), forgetting a session and a user, and the memory surviving a SIGKILL."""

import signal

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

import kvmemory  # noqa: E402
from kvmemory.chat_memory.memory import RECOMPUTE  # noqa: E402
from tests.server.test_server import _free_port, _spawn_server, _start  # noqa: E402


@pytest.fixture(params=[False, True], ids=["plain", "encrypted"])
def served(request, tmp_path, tiny):
    from kvmemory.server import create_app
    from tests.store.test_encryption import provider
    keys = provider(tmp_path / "keyring") if request.param else None
    mem = kvmemory.Memory(tmp_path / "s.kvm", model=tiny, encrypt=request.param, keys=keys)
    srv, t, url = _start(create_app(mem, queue_size=4))
    yield url, mem
    srv.should_exit = True
    t.join(timeout=10)
    mem.close()


def ask(client, user, session, text, **kw):
    return client.chat.completions.create(model="kvmemory", messages=[{"role": "user", "content": text}],
                                          temperature=0, max_tokens=4, user=user, prompt_cache_key=session, **kw)


def test_recall_across_sessions_isolation_and_forgetting(served):
    url, mem = served
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    first = ask(client, "alice", "s1", "Remember this: my locker code is tamarind 4417 at the harbour gym.")
    assert first.model_extra["kvmemory"]["recalled"] == []             # nothing kept yet
    ask(client, "alice", "s3", "I enjoy long walks along the river in autumn.")
    r = ask(client, "alice", "s2", "What is my locker code at the harbour gym?")
    m = r.model_extra["kvmemory"]
    assert m["user"] == "alice" and any("4417" in x["text"] and x["session"] == "s1" for x in m["recalled"])
    # the default recomputes every recalled token in the window (RECOMPUTE 1.0) but, in a first message, the
    # first turn's: it sits where it was computed, restored as stored (the lead, ChatMemory.exact_lead)
    assert RECOMPUTE == 1.0 and m["tokens_grafted"] == sum(x["tokens"] for x in m["recalled"]) > 0
    assert m["tokens_recomputed"] == m["tokens_grafted"] - m["recalled"][0]["tokens"]
    assert r.usage.prompt_tokens_details.cached_tokens == m["tokens_restored"] >= m["tokens_grafted"] - m["tokens_recomputed"]
    assert r.usage.prompt_tokens == m["window_tokens"]
    # streamed: the memory object rides on the chunk with finish_reason
    chunks = list(client.chat.completions.create(
        model="kvmemory", messages=[{"role": "user", "content": "Which locker code did I give you?"}],
        temperature=0, max_tokens=4, user="alice", prompt_cache_key="s4", stream=True))
    last = next(c for c in chunks if c.choices and c.choices[0].finish_reason)
    assert any("4417" in x["text"] for x in last.model_extra["kvmemory"]["recalled"])
    # another user: recalls nothing of alice's, and alice's exact prompt is no cache hit for bob
    b = ask(client, "bob", "b1", "Remember this: my locker code is tamarind 4417 at the harbour gym.")
    assert b.model_extra["kvmemory"]["recalled"] == [] and b.usage.prompt_tokens_details.cached_tokens == 0
    assert first.usage.prompt_tokens == b.usage.prompt_tokens
    b2 = ask(client, "bob", "b2", "What is my locker code at the harbour gym?")
    assert all(x["session"] == "b1" for x in b2.model_extra["kvmemory"]["recalled"])
    kept = httpx.get(url + "/v1/users/alice/memory").json()
    assert {s["id"] for s in kept["sessions"]} == {"s1", "s2", "s3", "s4"} and kept["tokens"] > 0
    assert kept["kv_bytes"] > kept["tokens"]
    assert httpx.get(url + "/v1/documents").json()["data"] == []        # no user's turns among the documents
    # forgetting a session: the next request recalls nothing of it
    gone = httpx.delete(url + "/v1/users/alice/sessions/s1").json()
    assert gone["deleted"] and gone["turns"] == 1 and gone["states"] >= 1
    again = ask(client, "alice", "s5", "What is my locker code at the harbour gym?")
    assert all(x["session"] != "s1" for x in again.model_extra["kvmemory"]["recalled"])
    assert httpx.delete(url + "/v1/users/alice/sessions/nope").status_code == 404
    # forgetting the user: nothing is recalled, listed, or kept as a state
    out = httpx.delete(url + "/v1/users/alice").json()
    assert out["deleted"] and out["turns"] >= 3
    sealer = mem.store.sealer                    # encrypted: forgetting alice destroyed her data key
    assert sealer is None or sealer.destroyed(mem.chat_memory("alice").key)
    assert httpx.get(url + "/v1/users/alice/memory").json()["sessions"] == []
    assert not [s for s in mem.states() if "chat:" + mem.chat_memory("alice").key in s.label]
    last = ask(client, "alice", "s6", "What is my locker code at the harbour gym?")
    assert last.model_extra["kvmemory"]["recalled"] == []
    assert httpx.get(url + "/v1/users/bob/memory").json()["turns"] == 2     # bob's memory untouched
    # encrypted: no file beside or in the store holds the code told (as a word: in text, BM25 terms,
    # the server's session records); in a plain store they do. The needle is the code's word, not its
    # digits: "4417" turns up by chance in the plain log's timestamps and hex digests (CI, seed 922283318)
    from tests.store.test_encryption import files_of, scan
    found = scan([p.read_bytes() for p in files_of(mem.path)], {"word": b"tamarind"})
    assert found == (set() if sealer is not None else {"word"})


def test_the_server_guards_a_reply_that_recalled_turns(served, monkeypatch):
    """A chat request whose window recalled the user's turns picks through a Guard (ChatMemory.guard, on
    by default: the reply does not open as a remembered turn reads), inside the logprobs it reports;
    one that recalled nothing does not."""
    from kvmemory.server import chat
    from tests.chat_memory.test_guard import _Spy
    monkeypatch.setattr(_Spy, "made", [])
    monkeypatch.setattr(chat, "Guard", _Spy)
    url, _ = served
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    first = ask(client, "carol", "c1", "Remember this: my bike is called Comet.")
    assert first.model_extra["kvmemory"]["recalled"] == [] and _Spy.made == []
    r = ask(client, "carol", "c2", "What is my bike called?", logprobs=True, top_logprobs=2)
    assert r.model_extra["kvmemory"]["recalled"] and len(_Spy.made) == 1
    assert len(_Spy.made[0].out) >= r.usage.completion_tokens == len(r.choices[0].logprobs.content) > 0


def test_a_users_memory_survives_a_sigkill(tmp_path, tiny_dir):
    """A real `kvmemory serve` process: alice's first session, SIGKILL, a fresh process on the same
    store, and a new session of alice's recalls the first one."""
    store = tmp_path / "k.kvm"
    port = _free_port()
    p = _spawn_server(store, port, model=tiny_dir)
    try:
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=120)
        ask(c, "alice", "s1", "Remember: the boat is called Sea Lantern and is moored at pier 9.")
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()
    port = _free_port()
    p = _spawn_server(store, port, model=tiny_dir)
    try:
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=120)
        r = ask(c, "alice", "s2", "What is my boat called, and where is it moored?")
        assert any("Sea Lantern" in x["text"] and x["session"] == "s1" for x in r.model_extra["kvmemory"]["recalled"])
    finally:
        p.send_signal(signal.SIGTERM)
        p.wait()


@pytest.mark.real_model
def test_a_fact_told_is_answered_in_a_new_session_after_a_restart(tmp_path):
    """The real default model in a real `kvmemory serve`, through the official client: a user tells a
    fact in their own words and the model replies (its own reply); the server is stopped and started
    again on the same store; in a new session the user asks for the fact in another form and the answer
    holds it: recalled from the user's memory as KV (kvmemory.chat_memory, keep="user")."""
    store = tmp_path / "k.kvm"
    port = _free_port()
    p = _spawn_server(store, port)
    try:
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=300)
        c.chat.completions.create(model="kvmemory", temperature=0, max_tokens=24, user="ada", prompt_cache_key="monday",
                                  messages=[{"role": "user", "content": "Please remember that my locker combination "
                                             "is 52917."}])
    finally:
        p.send_signal(signal.SIGTERM)
        p.wait()
    port = _free_port()
    p = _spawn_server(store, port)
    try:
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=300)
        r = c.chat.completions.create(model="kvmemory", temperature=0, max_tokens=32, user="ada", prompt_cache_key="friday",
                                      messages=[{"role": "user", "content": "What is my locker combination? Answer "
                                                 "with the number."}])
        assert any("52917" in x["text"] for x in r.model_extra["kvmemory"]["recalled"])
        assert "52917" in r.choices[0].message.content
        from kvmemory.chat_memory.guard import OPENINGS
        assert not r.choices[0].message.content.startswith(OPENINGS)    # an answer, not a remembered turn's frame
    finally:
        p.send_signal(signal.SIGTERM)
        p.wait()
