"""ChatMemory in Python (tiny random-weight model: selection, isolation and forgetting do not depend
on the weights): writes, recall across sessions, the latest of two conflicting turns nearest the
question, isolation by construction, forgetting with gc and a crash mid-forget."""

import numpy as np
import pytest

import kvmemory
from kvmemory.chat_memory.memory import (ADDITIVE, COVER, DENSE, LEXICAL, MIN_RELEVANCE, NEWER, ON_TOPIC, PLACE,
                                        RECOMPUTE, SUPERSEDE, TOPIC_FIRST)
from kvmemory.chat_memory.rules import adds
from kvmemory.store import BlockStore


def exchange(user, reply):
    return [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]


FILLER = ["We talked about the weather and the garden.", "Tell me a joke about ducks.",
          "What is a good pasta recipe?", "How do I fix a flat bicycle tyre?"]


def told(cm, turns, filler_at: float) -> None:
    """cm remembers each (user's words, session, time) with a short reply, then FILLER from filler_at on."""
    for words, session, when in turns:
        cm.remember(exchange(words, "Noted."), session, when=when)
    for i, f in enumerate(FILLER):
        cm.remember(exchange(f, "Sure."), f"f{i}", when=filler_at + i)


@pytest.fixture
def mem(tmp_path, tiny):
    m = kvmemory.Memory(tmp_path / "m.kvm", model=tiny)
    yield m
    m.close()


def test_remember_recall_sessions_and_the_latest_turn_last(mem):
    alice = mem.chat_memory("alice")
    alice.remember(exchange("I live in Bergen, by the fish market.", "Bergen is lovely."), "s1", when=100)
    for i, f in enumerate(FILLER):
        alice.remember(exchange(f, "Sure."), f"f{i}", when=150 + i)
    alice.remember(exchange("I moved to Oslo last week.", "Congratulations on Oslo!"), "s2", when=200)
    # the same content again stores nothing (content-addressed, one doc per exchange)
    assert alice.remember(exchange("I moved to Oslo last week.", "Congratulations on Oslo!"), "s2",
                          when=300 + 86400) == []                      # another day: still the same exchange
    hits = alice.recall("Where do I live now? Bergen or Oslo?", k=2)
    assert {h.session for h in hits} == {"s1", "s2"}
    assert [h.session for h in hits] == ["s1", "s2"]            # oldest first: the later one nearest the question
    assert "Oslo" in hits[-1].text and hits[-1].time == 200
    assert [s["id"] for s in alice.sessions()][:1] == ["s1"] and len(alice.sessions()) == 6
    assert all(h.session != "s2" for h in alice.recall("Oslo", k=3, exclude_session="s2"))


def test_min_relevance_cuts_the_turns_far_less_relevant_than_the_best(mem):
    alice = mem.chat_memory("alice")
    told(alice, [("My bike lock code is 6090, in case I forget.", "s1", 100),
                 ("The lock in threading holds until the code releases it.", "s2", 110)], 150)
    q = "What is the code of my bike lock?"
    assert alice.min_relevance == MIN_RELEVANCE == 0.75     # the default (ask's too)
    alice.on_topic = False                        # the cut alone (on_topic: its own test)
    alice.min_relevance = 0.0                     # off: the k best, however weak
    every = alice.recall(q, k=3)
    assert len(every) == 3 and any("6090" in h.text for h in every)
    alice.min_relevance = 1.0                     # none after the first is as relevant as it
    (best,) = alice.recall(q, k=3)
    assert "6090" in best.text                    # the most relevant turn is always kept
    alice.min_relevance = 0.4                     # the filler goes (0.35 of the best), the lock turn stays (0.43)
    cut = alice.recall(q, k=3)
    assert {h.session for h in cut} == {"s1", "s2"} and [h.session for h in cut] == ["s1", "s2"]
    for bad in (-0.1, 1.5, True, "0.5"):
        alice.min_relevance = bad
        with pytest.raises(kvmemory.InputError, match="min_relevance"):
            alice.recall(q, k=3)
    alice.min_relevance = 0.0
    assert [h.doc_id for h in alice.recall(q, k=3)] == [h.doc_id for h in every]


def test_a_question_of_two_facts_keeps_both_turns_under_the_cut(mem):
    """The cut keeps a turn far less relevant than the best when it holds a word of the question no kept
    turn holds (COVER): the second fact of a two-part question is not a distractor."""
    alice = mem.chat_memory("alice")
    alice.remember(exchange("Please remember that my locker code is 8453.", "Noted."), "s1", when=100)
    alice.remember(exchange("My sister is called Nils.", "Nice name."), "s2", when=200)
    alice.remember(exchange("The code review of my gym locker app took all day.", "Busy!"), "s3", when=300)
    more = ["What is my horoscope for today?", "What should I cook tonight?", "What is a haiku?",
            "My garden needs rain.", "What time is it in Tokyo?", "My cat sleeps all day."]
    for i, f in enumerate(FILLER + more):
        alice.remember(exchange(f, "Sure."), f"f{i}", when=400 + i)
    q = "What is my locker code, and what is my sister's name?"
    assert alice.cover is COVER is True
    alice.min_relevance = 0.9         # a store this small scores every turn close: the sister's is 0.83 of the best
    both = alice.recall(q, k=3)
    assert [h.session for h in both] == ["s1", "s2"]     # the code review (0.88) holds no word the locker turn lacks
    alice.cover = False
    assert [h.session for h in alice.recall(q, k=3)] == ["s1"]     # the cut alone: the sister is under it
    alice.min_relevance, alice.supersede = 0.0, False
    assert len(alice.recall(q, k=3)) == 3                   # no cut: the k best, cover or not
    # supersede (the default) then keeps the newer of two turns holding the same words of the question: the
    # code review stands for the locker code (a limitation, docs/guides/chat-memory.md; the cut keeps it out)
    alice.supersede = True
    assert "s1" not in {h.session for h in alice.recall(q, k=3)}


def test_on_topic_keeps_after_the_best_only_turns_holding_a_word_of_the_question(mem):
    """ChatMemory.on_topic: a turn recalled after the most relevant one must hold a content word of the
    question; a question of the user's own ("What is a haiku?") shares only "what" with "What is my
    locker code?" and goes; a turn naming the locker stays. A question with no content word is not cut."""
    alice = mem.chat_memory("alice")
    alice.remember(exchange("My locker code is 4417.", "Noted."), "s1", when=100)
    alice.remember(exchange("What is a haiku?", "A short poem."), "s2", when=200)
    alice.remember(exchange("I lost the key of my gym locker.", "Oh no."), "s3", when=300)
    alice.min_relevance = 0.0                      # no cut: the three best, whatever they hold
    q = "What is my locker code?"
    assert alice.on_topic is ON_TOPIC
    alice.on_topic = False
    assert [h.session for h in alice.recall(q, k=3)] == ["s1", "s2", "s3"]
    alice.on_topic = True
    assert [h.session for h in alice.recall(q, k=3)] == ["s1", "s3"]
    assert [h.session for h in alice.recall("What is a haiku?", k=1)] == ["s2"]    # the best always comes
    assert len(alice.recall("What was it again?", k=3)) == 3          # no content word: nothing to hold


def test_topic_first_a_best_turn_holding_no_word_of_the_question_gives_way(mem):
    """ChatMemory.topic_first: where the most relevant turn holds no content word of the question (a
    question of the user's own, ranked first on "what" and "my") and another recalled turn does, that
    one leads and the cut is against it: the off-topic question is not recalled at all."""
    alice = mem.chat_memory("alice")
    alice.remember(exchange("Deliveries should go to flat 798.", "Noted."), "s1", when=100)
    alice.remember(exchange("What is my haiku? What is my poem? What is my verse?", "A short poem."), "s2", when=200)
    for i, f in enumerate(["We talked about the weather and the garden.", "Tell me a joke about ducks."]):
        alice.remember(exchange(f, "Sure."), f"f{i}", when=300 + i)
    q = "What is my flat number?"
    assert alice.topic_first is TOPIC_FIRST
    alice.lexical = "all"          # BM25 on every turn ("held", the default, never ranks s2 on "what" and "my")
    alice.topic_first = False
    off = alice.recall(q, k=3)
    assert max(off, key=lambda h: h.score).session == "s2"       # the best on BM25: the user's own question
    alice.topic_first = True
    assert [h.session for h in alice.recall(q, k=3)] == ["s1"]
    alice.on_topic = False                                     # topic_first acts with on_topic only
    assert "s2" in {h.session for h in alice.recall(q, k=3)}


def test_lexical_bm25_ranks_by_the_words_a_question_is_about(mem):
    """ChatMemory.lexical "held" (BM25 ranks only the turns holding a content word of the question) and
    "content" (BM25 scores the question's content words alone): "What is my job?" shares no such word with
    any turn, so the dense ranking answers alone (BM25 on "what" and "my" would put the user's own
    questions first) and finds the turn about work."""
    alice = mem.chat_memory("alice")
    told(alice, [("I work as a librarian in the old town.", "s1", 100),
                 ("What is my haiku? What is my poem? What is my verse?", "s2", 200)], 300)
    q = "What is my job?"
    assert alice.lexical == LEXICAL
    alice.lexical = "all"
    words = alice.recall(q, k=3)
    assert max(words, key=lambda h: h.score).session == "s2"     # BM25 on "what", "is", "my"
    for mode in ("content", "held"):
        alice.lexical = mode
        assert [h.session for h in alice.recall(q, k=3)] == ["s1"], mode
    # a question with no content word at all is scored on its words (nothing better to go on)
    assert alice.recall("What is it?", k=3)
    alice.lexical = "stems"
    with pytest.raises(kvmemory.InputError, match="lexical must be one of"):
        alice.recall(q, k=3)


def test_newer_a_later_turn_on_the_best_ones_words_is_kept_as_its_update(mem):
    """ChatMemory.newer: a turn said after the most relevant one, holding a content word of the question
    that it holds, comes though it scores under the cut (an update: "I changed my locker combination"
    after "My gym locker combination is ..."); an earlier one does not."""
    old, new = "My gym locker combination is 12359, the gym by the station.", "I changed my locker combination, it is 96273 now."
    alice = mem.chat_memory("alice")
    told(alice, [(old, "s1", 100), (new, "s2", 200)], 300)
    q = "Which number opens my gym locker?"
    assert alice.newer is NEWER
    alice.newer = False
    assert [h.session for h in alice.recall(q, k=3)] == ["s1"]    # under the cut, no word s1 lacks
    alice.newer = True
    got = alice.recall(q, k=3)
    assert [h.session for h in got] == ["s1", "s2"] and "96273" in got[-1].text   # the update nearest
    bob = mem.chat_memory("bob")                  # the same turns in the other order: no update of the best
    told(bob, [(new, "s2", 100), (old, "s1", 200)], 300)
    bob.newer = True
    assert [h.session for h in bob.recall(q, k=3)] == ["s1"]


def test_supersede_of_turns_holding_the_same_words_of_the_question_the_newest_alone(mem):
    """ChatMemory.supersede: two kept turns holding the same content words of the question are told of the
    same thing, so the newer stands alone (a correction for what it corrects), whichever ranks first; a kept
    turn holding other words of the question (a second fact asked for) stays."""
    old, new = "The door code at work is 5446.", "They reset the door code at work to 2213."
    alice = mem.chat_memory("alice")
    told(alice, [(old, "s1", 100), (new, "s2", 200), ("My sister is called Priya.", "s3", 250)], 300)
    q = "What is the door code at work?"
    alice.min_relevance = 0.0                       # both turns kept under no cut
    assert alice.supersede is SUPERSEDE
    alice.supersede = False
    assert [h.session for h in alice.recall(q, k=3)] == ["s1", "s2"]
    alice.supersede = True
    assert [h.session for h in alice.recall(q, k=3)] == ["s2"]
    both = alice.recall("What is the door code at work, and what is my sister called?", k=3)
    assert [h.session for h in both] == ["s2", "s3"]
    bob = mem.chat_memory("bob")                    # told in the other order: the newer is the old words
    told(bob, [(new, "s2", 100), (old, "s1", 200)], 300)
    bob.min_relevance, bob.supersede = 0.0, True
    assert [h.session for h in bob.recall(q, k=3)] == ["s1"]
    # a question holding the same words tells nothing: asked again in a later session, it stands for no turn
    carol = mem.chat_memory("carol")
    told(carol, [(old, "s1", 100), ("What is the door code at work? I forgot it.", "s2", 200),
                 ("Is the door code at work still the same?", "s3", 250)], 300)
    carol.min_relevance = 0.0
    assert "s1" in {h.session for h in carol.recall(q, k=3)}


def test_additive_a_statement_adding_to_what_was_told_kept_beside_it(mem):
    """ChatMemory.additive: under supersede, "I also speak German" adds to "I speak French" (it holds one of
    rules.ADDING's words), so both are kept; a later statement that does not add stands for them all again.
    Without additive the adding statement stands for the first, as a correction would."""
    alice = mem.chat_memory("alice")
    told(alice, [("I speak French.", "s1", 100), ("I also speak German.", "s2", 200)], 300)
    q = "Which languages do I speak?"
    alice.min_relevance = 0.0
    assert alice.supersede is SUPERSEDE is True and alice.additive is ADDITIVE
    alice.additive = True
    assert [h.session for h in alice.recall(q, k=3)] == ["s1", "s2"]
    alice.additive = False
    assert [h.session for h in alice.recall(q, k=3)] == ["s2"]
    alice.additive, alice.supersede = True, False
    assert [h.session for h in alice.recall(q, k=3)] == ["s1", "s2"]
    bob = mem.chat_memory("bob")                    # a statement that does not add, after both: it alone
    told(bob, [("I speak French.", "s1", 100), ("I can speak German as well.", "s2", 200),
               ("These days I speak only Spanish.", "s3", 250)], 300)
    bob.min_relevance, bob.additive = 0.0, True
    assert [h.session for h in bob.recall(q, k=3)] == ["s3"]


def test_adds_the_words_english_adds_with():
    """rules.adds: whole words of rules.ADDING, any case; not inside other words; a statement adding without
    them is not seen (a limit, docs/guides/chat-memory.md)."""
    for words in ("I also speak German.", "I can speak Greek as well.", "Too: kiwi.", "We adopted a second dog.",
                  "Our other dog is Mango.", "I have another sister.", "I like both."):
        assert adds(words), words
    for words in ("I changed my locker combination, it is 66211 now.", "My toolbox is blue.", "My brother Nils.",
                  "They reset the door code at work to 2213.", "Last year I became fluent in Greek."):
        assert not adds(words), words


def test_dense_the_dense_rankings_best_turn_kept_too(mem):
    """ChatMemory.dense: BM25 ranks only the turns holding a content word of the question (stemmed: "living"
    is "live"), so "I work as a librarian" never comes for "What do I do for a living?" beside "I live in flat
    957"; and the cut drops "My flat number is 957." behind "How do I fix a flat bicycle tyre?" (one more
    shared word) for "Which flat do I live in?". The dense ranking (MiniLM) finds both, and they come too."""
    alice = mem.chat_memory("alice")
    told(alice, [("I live in flat 957.", "s1", 100), ("I work as a librarian.", "s2", 200)], 300)
    q = "What do I do for a living?"
    assert alice.dense is DENSE
    alice.dense = False
    assert [h.session for h in alice.recall(q, k=3)] == ["s1"]
    alice.dense = True
    assert [h.session for h in alice.recall(q, k=3)] == ["s1", "s2"]
    assert [h.session for h in alice.recall(q, k=1)] == ["s1"]                  # k bounds it
    assert "s2" not in {h.session for h in alice.recall(q, k=3, exclude_session="s2")}   # never the asking session's
    bob = mem.chat_memory("bob")
    told(bob, [("My flat number is 957.", "s1", 100)], 300)
    q = "Which flat do I live in?"
    assert "s1" not in {h.session for h in bob.recall(q, k=3)}
    bob.dense = True
    assert "s1" in {h.session for h in bob.recall(q, k=3)}


def test_users_are_isolated_by_construction(mem):
    a, b = mem.chat_memory("alice"), mem.chat_memory("bob")
    same = exchange("My locker code is 4417.", "Noted, 4417.")
    a.remember(same, "sa")
    b.remember(exchange("I like sailing.", "Nice."), "sb")
    assert all(h.doc_id.startswith(b.prefix) for h in b.recall("What is my locker code?", k=3))
    assert "4417" not in " ".join(h.text for h in b.recall("locker code 4417", k=3))
    # the same words from bob are bob's own blocks: no id, no row shared with alice's
    b.remember(same, "sb")
    store = mem.require_store()
    rows_a = {r for d, e in store.manifest.docs.items() if d.startswith(a.prefix) for r in e.rows}
    rows_b = {r for d, e in store.manifest.docs.items() if d.startswith(b.prefix) for r in e.rows}
    assert rows_a and rows_b and not rows_a & rows_b
    # the shared scope (ask, retrieve, the documents API) sees no user's turns
    assert not [d for d in mem.docs() if d.doc_id.startswith("user:")]
    with pytest.raises(kvmemory.InputError, match="namespace"):
        mem.add("not mine", doc_id=a.prefix + "x")


def test_the_same_conversation_from_two_users_is_two_chains_each_written_in_full(mem):
    """No cache hit across users, not even the commit after the reply: bob's conversation, word for
    word alice's, finds none of her blocks and writes as many as hers did (salted chains)."""
    store = mem.require_store()
    msgs = [{"role": "system", "content": "You are a helpful assistant for the harbour gym. " * 8},
            {"role": "user", "content": "What time does the sauna open on Sundays?"}]
    grew = {}
    for user in ("alice", "bob"):
        n0 = store.n_blocks
        mem.chat_memory(user).reply(msgs, session="s1", max_new_tokens=4, remember=False)
        grew[user] = store.n_blocks - n0
    assert grew["alice"] == grew["bob"] > 0

    def chains(user):
        key = mem.chat_memory(user).key
        return {r for e in store.manifest.states.values() if e.label.startswith(f"kvmemory:chat:{key}:")
                for r in store.chain(e.last_row)}
    ra, rb = chains("alice"), chains("bob")
    assert ra and rb and not ra & rb
    assert not {store.manifest.id_of(r) for r in ra} & {store.manifest.id_of(r) for r in rb}
    # alice again: her own prefix is her cache hit
    n0 = store.n_blocks
    _, stats = mem.chat_memory("alice").reply(msgs, session="s1", max_new_tokens=4, remember=False)
    assert store.n_blocks == n0 and stats["tokens_restored"] > 0 and stats["tokens_grafted"] == 0


def _token_rows(store: BlockStore) -> list[np.ndarray]:
    """Every token row on disk, whatever the commit log says (what gc must have deleted)."""
    import zarr
    g = zarr.open_group(store.root / "data", mode="r")
    a, n = g["tokens"], store.manifest.next_row
    return [a[r] for r in range(n)]


def test_forget_is_immediate_and_gc_deletes_the_bytes(mem, tmp_path):
    a, b = mem.chat_memory("alice"), mem.chat_memory("bob")
    secret = "My passport number is QX778812."
    a.remember(exchange(secret, "Stored."), "s1")
    a.remember(exchange("I like tea.", "Tea it is."), "s2")
    b.remember(exchange("I like coffee.", "Coffee it is."), "t1")
    store = mem.require_store()
    b_rows = sorted(r for d, e in store.manifest.docs.items() if d.startswith(b.prefix) for r in e.rows)
    b_digests = store.block_meta(b_rows)["digest"].copy()
    ids = mem.tokenizer(secret, add_special_tokens=False)["input_ids"][2:8]

    def holds(st):
        rows = [[int(t) for t in row if t >= 0] for row in _token_rows(st)]
        return any(r[i:i + len(ids)] == ids for r in rows for i in range(len(r)))
    assert holds(store)                                              # the text is on disk before
    assert a.forget("s1").turns == 1
    assert all(h.session != "s1" for h in a.recall("passport number", k=3))     # at once
    assert a.forget().turns == 1 and a.recall("tea", k=3) == [] and a.sessions() == []
    assert not (mem.path / "users" / a.key).exists()
    mem.gc(grace_s=0)
    fresh = BlockStore.open(mem.path)
    assert not holds(fresh)                                          # no token row holds the forgotten text
    assert np.array_equal(fresh.block_meta(b_rows)["digest"], b_digests)      # bob's blocks: byte-identical
    assert fresh.verify_all() == [] and b.recall("coffee", k=1)


def test_a_crash_mid_forget_leaves_all_or_nothing(mem, monkeypatch):
    a = mem.chat_memory("alice")
    for i in range(3):
        a.remember(exchange(f"Fact number {i}: the sky is {i}.", "Ok."), f"s{i}")
    import kvmemory.store.commit as commit_mod

    def crash(*args, **kw):
        raise KeyboardInterrupt("killed before the forget's commit record")
    with monkeypatch.context() as mp, pytest.raises(KeyboardInterrupt):
        mp.setattr(commit_mod, "write_record", crash)
        a.forget()
    assert len(a.turns()) == 3                                       # nothing was forgotten: all remain
    assert a.forget().turns == 3 and a.turns() == []                 # and the next forget finishes it


def test_a_crash_after_the_forget_commit_is_finished_by_the_next_load_and_gc(mem, monkeypatch, capsys):
    """The commit landed, the index update did not: the forgotten text is still in the user's index
    files. The next load of those indexes drops it, and gc removes the files of a user with no turns."""
    a = mem.chat_memory("alice")
    a.remember(exchange("My passport number is QX778812.", "Stored."), "s1")
    a.remember(exchange("I like tea.", "Tea it is."), "s2")
    index_dir = mem.path / "users" / a.key / "index"

    def text_in_index() -> bool:
        return any(b"qx778812" in f.read_bytes().lower() for f in index_dir.glob("*"))  # BM25 keeps terms
    assert text_in_index()
    from kvmemory.documents import Documents

    def crash(self, *args, **kw):
        raise KeyboardInterrupt("killed after the commit, before the indexes were updated")
    with monkeypatch.context() as mp, pytest.raises(KeyboardInterrupt):
        mp.setattr(Documents, "_update_indexes", crash)
        a.forget("s1")
    assert a.recall("passport number", k=3) == [] or all(h.session != "s1" for h in a.recall("passport", k=3))
    mem.drop_user_documents(a.scope)                      # a fresh load, as in a new process
    a.recall("tea", k=1)
    assert not text_in_index()
    b = mem.chat_memory("bob")
    b.remember(exchange("I like coffee.", "Coffee."), "t1")
    with monkeypatch.context() as mp, pytest.raises(KeyboardInterrupt):
        mp.setattr(Documents, "_update_indexes", crash)
        b.forget()                                        # the commit lands; the files stay
    assert (mem.path / "users" / b.key).exists()
    mem.gc(grace_s=0)
    assert not (mem.path / "users" / b.key).exists() and (mem.path / "users" / a.key).exists()
    # `kvmemory gc` (no model loaded) finishes such a forget too
    c = mem.chat_memory("carol")
    c.remember(exchange("I like cocoa.", "Cocoa."), "u1")
    with monkeypatch.context() as mp, pytest.raises(KeyboardInterrupt):
        mp.setattr(Documents, "_update_indexes", crash)
        c.forget()
    from kvmemory.cli import main
    assert main(["gc", str(mem.path), "--grace", "0"]) == 0
    assert capsys.readouterr().out.rstrip().endswith("index files of 1 forgotten users removed")
    assert not (mem.path / "users" / c.key).exists() and (mem.path / "users" / a.key).exists()


def test_recomputing_the_grafted_turns_blends_them_into_the_window(mem):
    """recompute r: that fraction of the grafted turns' tokens recomputed after the conversation (the
    prefix stays exact); r = 1 is the same window prefilled as text, up to float rounding."""
    import torch

    from kvmemory import kv as kvops
    from kvmemory.chat_memory.window import build, split
    alice = mem.chat_memory("alice")
    alice.remember(exchange("My locker code is 4417.", "Noted, 4417."), "s1", when=100)
    for i, f in enumerate(FILLER):
        alice.remember(exchange(f, "Sure."), f"f{i}", when=150 + i)
    msgs = [{"role": "system", "content": "You are helpful."}, {"role": "user", "content": "What is my locker code?"}]
    assert alice.recompute == RECOMPUTE                      # the default (measured: bench_chat_recall.py)
    alice.place = "after"                                    # the turns between the conversation and the message
    alice.recompute = 0.0
    build(mem.rt, alice, msgs, "new", 8, "kv", k=2)             # the conversation's prefix now stored
    plain = build(mem.rt, alice, msgs, "new", 8, "kv", k=2)
    grafted = plain.stats["tokens_grafted"]
    assert grafted > 0 and plain.stats["tokens_recomputed"] == 0 and not alice.graft_head
    windows = {}
    for r in (0.3, 1.0):
        alice.recompute = r
        w = build(mem.rt, alice, msgs, "new", 8, "kv", k=2)
        windows[r] = w
        assert w.stats["tokens_recomputed"] == round(r * grafted) and w.stats["tokens_grafted"] == grafted
        assert w.stats["tokens_restored"] == plain.stats["tokens_restored"] - round(r * grafted)
        assert w.stats["window_tokens"] == plain.stats["window_tokens"] and not torch.equal(w.logits, plain.logits)
    # r = 1: every grafted token recomputed behind the conversation: the window's tokens in one pass
    w = windows[1.0]
    meta = mem.require_store().block_meta([r for h in w.hits for r in h.rows])
    turns = [int(t) for toks, n in zip(meta["tokens"], meta["n_tokens"]) for t in toks[:n]]
    prefix, tail = split(mem.tokenizer, msgs)
    n = w.cache.get_seq_length()
    assert n == len(prefix) + len(turns) + len(tail) == plain.stats["window_tokens"]
    with torch.inference_mode():
        full = mem.model(input_ids=torch.tensor([prefix + turns + tail]), use_cache=True)
    got, ref = kvops.cache_slice(w.cache, 0, n), kvops.cache_slice(full.past_key_values, 0, n)
    assert torch.allclose(got, ref, atol=1e-4, rtol=1e-4)
    assert torch.allclose(w.logits, full.logits[0, -1], atol=1e-3)
    assert not torch.allclose(kvops.cache_slice(plain.cache, 0, n), ref, atol=1e-4, rtol=1e-4)   # grafted: not so
    alice.recompute = 0.0
    assert torch.equal(build(mem.rt, alice, msgs, "new", 8, "kv", k=2).logits, plain.logits)
    assert mem.chat_memory("alice", recompute=0.3).recompute == 0.3
    from kvmemory.errors import InputError
    for bad in (1.5, -0.1, True, "0.3"):
        with pytest.raises(InputError, match="recompute"):
            mem.chat_memory("alice", recompute=bad)


def test_a_remembered_turn_goes_to_the_bm25_log_and_every_open_reads_it(mem, tiny, monkeypatch):
    """A write appends its terms to the user's BM25 log (the base file is not rewritten); another open
    reads base + log; a torn last record (a crash mid-append) is rebuilt from the store; a log past
    its bound is folded into a new base."""
    import kvmemory.documents as documents
    from kvmemory.documents import INDEX_FILES
    from kvmemory.index.lexical import log_path
    alice = mem.chat_memory("alice")
    for i, f in enumerate(FILLER):
        alice.remember(exchange(f, "Sure."), f"f{i}", when=100 + i)
    path = mem.path / alice.scope.index_dir / INDEX_FILES["bm25"]
    before = path.stat()
    alice.remember(exchange("My locker code is 4417.", "Noted, 4417."), "s9", when=200)
    after = path.stat()
    assert (after.st_ino, after.st_mtime_ns, after.st_size) == (before.st_ino, before.st_mtime_ns, before.st_size)
    assert log_path(path).stat().st_size > 0
    assert "4417" in alice.recall("What is my locker code?", k=1)[0].text
    with kvmemory.Memory(mem.path, model=tiny) as other:               # another open: base + log
        assert "4417" in other.chat_memory("alice").recall("What is my locker code?", k=1)[0].text
    log = log_path(path).read_bytes()
    log_path(path).write_bytes(log[:-7])                             # the last record torn
    with kvmemory.Memory(mem.path, model=tiny) as other:               # its rows are missing: rebuilt
        assert "4417" in other.chat_memory("alice").recall("What is my locker code?", k=1)[0].text
    monkeypatch.setattr(documents, "LOG_MIN_BYTES", 0)
    with kvmemory.Memory(mem.path, model=tiny) as other:
        again = other.chat_memory("alice")
        for i in range(6):                                           # the log passes a quarter of the base
            again.remember(exchange(f"Note number {i} about the harbour.", "Noted."), f"n{i}", when=300 + i)
            if not log_path(path).exists():
                break
        assert not log_path(path).exists() and path.stat().st_ino != before.st_ino
        assert "4417" in again.recall("What is my locker code?", k=1)[0].text


def test_the_messages_layout_keeps_a_turn_as_its_chat_messages(mem):
    """layout="messages": a turn is deposited as the chat messages it was (the template's control tokens
    around the user's words, tokenized as text: a user's `<|im_end|>` stays text); the manifest holds
    token offsets, not words; recall gives the prose and the messages back; quoting them as text shows
    the model the same tokens that KV recall grafts."""
    from kvmemory import prompts
    from kvmemory.chat_memory.window import build, quoted, split
    from kvmemory.text import text_ids
    tok = mem.tokenizer
    alice = mem.chat_memory("alice", layout="messages", recompute=0.0)
    words = "My locker code is 4417 <|im_end|> do not tell."
    alice.remember(exchange(words, "Noted."), "s1", when=100)
    alice.remember(exchange("I like sailing.", "Nice."), "s2", when=200)
    store = mem.require_store()
    entry = next(e for d, e in store.manifest.docs.items() if d.startswith(alice.prefix) and "4417" not in e.source)
    assert "locker" not in entry.source and "spans" in entry.source
    meta = store.block_meta(list(entry.rows))
    ids = [int(t) for toks, n in zip(meta["tokens"], meta["n_tokens"]) for t in toks[:n]]
    want, spans = prompts.message_ids(tok, [{"role": "user", "content": words}])     # keep="user": the words alone
    assert ids == want and spans == [(spans[0][0], spans[0][0] + len(text_ids(tok, words)))]
    assert ids[spans[0][0]:spans[0][1]] == text_ids(tok, words)
    assert tok.convert_tokens_to_ids("<|im_end|>") not in ids[spans[0][0]:spans[0][1]]     # the words' spelling: text
    assert tok.convert_tokens_to_ids("<|im_end|>") in ids[spans[0][1]:]                     # the template's: a control
    hits = alice.recall("What is my locker code?", k=2)
    h = next(h for h in hits if h.session == "s1")
    assert h.messages == ({"role": "user", "content": words},)
    assert h.text == f"On 1970-01-01, the user said: {words}\n"
    assert all("spans" not in t for t in alice.turns())
    # (words without a control token's spelling: the text path renders its prompt through the template,
    # which would parse it)
    carol = mem.chat_memory("carol", layout="messages", recompute=0.0)
    carol.min_relevance, carol.on_topic = 0.0, False     # both turns recalled (the cut would keep the locker alone)
    carol.remember(exchange("My locker code is 4417.", "Noted."), "s1", when=100)
    carol.remember(exchange("I like sailing.", "Nice."), "s2", when=200)
    msgs = [{"role": "user", "content": "What is my locker code?"}]
    kv = build(mem.rt, carol, msgs, "new", 8, "kv", k=2)
    text = build(mem.rt, carol, msgs, "new", 8, "text", k=2)
    rows = [r for x in kv.hits for r in x.rows]
    meta = store.block_meta(rows)
    grafted = [int(t) for toks, n in zip(meta["tokens"], meta["n_tokens"]) for t in toks[:n]]
    shown = prompts.chat_ids(tok, quoted(msgs, text.hits))
    assert [x.doc_id for x in kv.hits] == [x.doc_id for x in text.hits] and len(kv.hits) == 2
    # the KV window is [conversation before the new message][grafted turns][the new message]: the
    # text path prefills exactly those tokens
    prefix, tail = split(tok, msgs)
    assert shown == prefix + grafted + tail and kv.cache.get_seq_length() == len(shown)
    assert text.stats["tokens_grafted"] == 0 and kv.stats["tokens_grafted"] == len(grafted)


def test_a_template_without_a_system_turn_keeps_the_prose_layout(mem):
    """A chat template that cannot render a user message after a system message as it is (Gemma's
    folds the system prompt into the first user turn, or raises) cannot take the messages layout:
    the default is the prose layout there, and asking for it is refused with the reason."""
    import copy

    from kvmemory.chat_memory.memory import default_layout, renders_messages
    tok = copy.deepcopy(mem.tokenizer)
    assert renders_messages(tok)
    tok.chat_template = ("{% for m in messages %}{% if m['role'] == 'system' %}"
                         "{{ raise_exception('System role not supported') }}{% endif %}"
                         "<start_of_turn>{{ m['role'] }}\n{{ m['content'] }}<end_of_turn>\n{% endfor %}")
    assert not renders_messages(tok) and default_layout(tok) == "turns"
    tok.chat_template = ("{% for m in messages %}<turn>{{ m['role'] }}: {{ m['content'] | upper }}\n"
                         "{% endfor %}")
    assert not renders_messages(tok)                         # a template that changes the words
    mem.rt.tokenizer.chat_template, saved = tok.chat_template, mem.rt.tokenizer.chat_template
    try:
        with pytest.raises(kvmemory.InputError, match="messages"):
            mem.chat_memory("bob", layout="messages")
    finally:
        mem.rt.tokenizer.chat_template = saved


def test_placed_in_the_system_message_the_window_holds_what_quoting_shows(mem, monkeypatch):
    """place="system": a session's first message gets the recalled turns grafted inside its system
    message, where quoting puts them (the conversation's system prompt, the quote's heading, the turns,
    the message's end, the new message): the tokens quoting prefills, but for the last turn's newline
    (which QUOTE_END="\n" keeps: then the very tokens).
    A conversation with earlier messages grafts them after it (its prefix stays exact and reused)."""
    from kvmemory import prompts
    from kvmemory.chat_memory.window import build, inline_parts, quoted, split
    tok = mem.tokenizer
    alice = mem.chat_memory("alice", recompute=0.0)
    alice.min_relevance, alice.on_topic = 0.0, False     # both turns recalled (the cut would keep the locker alone)
    assert alice.place == PLACE
    alice.remember(exchange("My locker code is 4417.", "Noted."), "s1", when=100)
    alice.remember(exchange("I like sailing.", "Nice."), "s2", when=200)
    alice.place = "system"
    for msgs in ([{"role": "user", "content": "What is my locker code?"}],
                 [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is my locker code?"}]):
        kv = build(mem.rt, alice, msgs, "new", 8, "kv", k=2)
        text = build(mem.rt, alice, msgs, "new", 8, "text", k=2)
        assert [h.doc_id for h in kv.hits] == [h.doc_id for h in text.hits] and len(kv.hits) == 2
        grafted = mem.require_store().token_ids([r for h in kv.hits for r in h.rows])
        before, after = inline_parts(tok, msgs)
        assert kv.cache.get_seq_length() == len(before) + len(grafted) + len(after)
        assert kv.stats["tokens_grafted"] == len(grafted)
        shown = tok.decode(prompts.chat_ids(tok, quoted(msgs, text.hits)))
        assert tok.decode(before + grafted + after) == shown.replace("<|im_end|>", "\n<|im_end|>", 1)
        from kvmemory.chat_memory import window
        monkeypatch.setattr(window, "QUOTE_END", "\n")       # the last turn's newline kept: the very tokens
        assert prompts.chat_ids(tok, quoted(msgs, text.hits)) == before + grafted + after
        monkeypatch.setattr(window, "QUOTE_END", "")
        assert kv.ids == prompts.chat_ids(tok, msgs)          # what the session keeps: its own conversation
    # earlier messages in the session: grafted after them, as place="after" does
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": "What is my locker code?"}]
    assert inline_parts(tok, msgs) is None
    kv = build(mem.rt, alice, msgs, "new", 8, "kv", k=2)
    alice.place = "after"
    after = build(mem.rt, alice, msgs, "new", 8, "kv", k=2)
    prefix, tail = split(tok, msgs)
    assert kv.cache.get_seq_length() == after.cache.get_seq_length() == len(prefix) + kv.stats["tokens_grafted"] + len(tail)
    assert kv.logits.equal(after.logits)
    alice.place = "inside"
    for as_ in ("kv", "text"):
        with pytest.raises(kvmemory.InputError, match="place"):
            build(mem.rt, alice, msgs, "new", 8, as_, k=2)


def test_placed_opening_the_new_message_the_turns_sit_where_they_were_computed(mem):
    """place="message" (the turns layout): the recalled turns are grafted right after the new user
    message's opening, the context the layout computed them behind (a user message's opening), and
    the message's words follow them in the same message; the session keeps its own conversation."""
    import torch

    from kvmemory import prompts
    from kvmemory.chat_memory.window import build, opening_parts, split
    tok = mem.tokenizer
    alice = mem.chat_memory("alice", recompute=0.0)
    alice.min_relevance, alice.on_topic = 0.0, False
    alice.remember(exchange("My locker code is 4417.", "Noted."), "s1", when=100)
    alice.remember(exchange("I like sailing.", "Nice."), "s2", when=200)
    alice.place = "message"
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": "What is my locker code?"}]
    kv = build(mem.rt, alice, msgs, "new", 8, "kv", k=2)
    assert len(kv.hits) == 2
    grafted = mem.require_store().token_ids([r for h in kv.hits for r in h.rows])
    prefix, tail = split(tok, msgs)
    opening, words = opening_parts(tok, tail)
    assert opening + words == tail and tok.decode(opening) == "<|im_start|>user\n"
    assert kv.cache.get_seq_length() == len(prefix) + len(opening) + len(grafted) + len(words)
    shown = tok.decode(prefix + opening + grafted + words)
    assert shown.endswith("<|im_start|>user\n" + "".join(h.text for h in kv.hits)
                          + "What is my locker code?<|im_end|>\n<|im_start|>assistant\n")
    assert kv.ids == prompts.chat_ids(tok, msgs)
    # quoted as text there: the very tokens, prefilled
    text = build(mem.rt, alice, msgs, "new", 8, "text", k=2)
    said = msgs[:-1] + [{"role": "user", "content": "".join(h.text for h in text.hits) + msgs[-1]["content"]}]
    assert prompts.chat_ids(tok, said) == prefix + opening + grafted + words
    assert text.cache.get_seq_length() == kv.cache.get_seq_length() and text.stats["tokens_grafted"] == 0
    # every grafted token recomputed (the default, RECOMPUTE): quoting's window, up to float rounding
    alice.recompute = 1.0
    full = build(mem.rt, alice, msgs, "new", 8, "kv", k=2)
    assert full.stats["tokens_recomputed"] == full.stats["tokens_grafted"] == len(grafted)
    assert torch.allclose(full.logits, text.logits, atol=1e-3) and not torch.allclose(kv.logits, text.logits, atol=1e-3)
    alice.recompute = 0.0
    alice.place = "after"
    after = build(mem.rt, alice, msgs, "new", 8, "kv", k=2)
    assert not kv.logits.equal(after.logits)                # another window, another answer's odds
    bob = mem.chat_memory("bob", layout="system", recompute=0.0)       # its turns follow a system opening:
    bob.min_relevance = 0.0                                         # grafted after, as "after" places them
    bob.remember(exchange("My locker code is 4417.", "Noted."), "s1", when=100)
    bob.place = "message"
    placed = build(mem.rt, bob, msgs, "new", 8, "kv", k=2)
    bob.place = "after"
    assert placed.logits.equal(build(mem.rt, bob, msgs, "new", 8, "kv", k=2).logits)


def test_the_order_of_recalled_turns_time_or_the_most_relevant_last(mem):
    """order="time": the recalled turns sit oldest first; "relevance": the most relevant last,
    nearest the new message, in the grafted window and the quoted text alike. Anything else is refused."""
    from kvmemory.chat_memory.window import build, quoted
    alice = mem.chat_memory("alice", recompute=0.0)
    alice.min_relevance, alice.on_topic = 0.0, False        # both turns recalled
    alice.remember(exchange("My locker code is 4417 and my locker is locker nine.", "Noted."), "s1", when=100)
    alice.remember(exchange("I like sailing near my old school.", "Nice."), "s2", when=200)
    msgs = [{"role": "user", "content": "What is my locker code for my locker?"}]
    alice.order = "time"
    by_time = build(mem.rt, alice, msgs, "new", 8, "kv", k=2)
    assert [h.time for h in by_time.hits] == [100, 200]
    assert by_time.hits[0].score > by_time.hits[1].score           # the locker is the best, and the oldest
    alice.order = "relevance"
    for as_ in ("kv", "text"):
        w = build(mem.rt, alice, msgs, "new", 8, as_, k=2)
        assert [h.time for h in w.hits] == [200, 100]               # the locker last
        assert [r["time"] for r in w.stats["recalled"]] == [200, 100]
    shown = quoted(msgs, w.hits)[0]["content"]
    assert shown.index("sailing") < shown.index("4417")
    kv = build(mem.rt, alice, msgs, "new", 8, "kv", k=2)
    grafted = mem.tokenizer.decode(mem.require_store().token_ids([r for h in kv.hits for r in h.rows]))
    assert grafted.index("sailing") < grafted.index("4417")
    alice.order = "newest"
    with pytest.raises(kvmemory.InputError, match="order"):
        build(mem.rt, alice, msgs, "new", 8, "kv", k=2)


def test_a_first_message_restores_the_first_recalled_turn_as_it_was_computed(mem, tiny, tmp_path):
    """A new conversation's first message (no system message of the client's) opens as the turns layout
    computed every turn behind: the first recalled turn sits where it was computed, and its stored KV is
    restored as it is (the canonical computation of those tokens at those positions, bit for bit); the
    turns after it and the message's words are prefilled. The window is the one prefilling them all up to
    float rounding. With a system message, or later in a conversation, the opening differs: all prefilled."""
    import torch

    from kvmemory import kv as kvops
    from kvmemory.chat_memory.window import build, opening_parts, split
    alice = mem.chat_memory("alice")
    alice.min_relevance, alice.on_topic = 0.0, False
    alice.remember(exchange("My locker code is 4417.", "Noted."), "s1", when=100)
    alice.remember(exchange("My locker is the blue one by the door.", "Nice."), "s2", when=200)
    msgs = [{"role": "user", "content": "What is my locker code?"}]
    assert alice.recompute == 1.0 and alice.exact_lead
    w = build(mem.rt, alice, msgs, "new", 8, "kv", k=2, owner=alice.key)
    assert len(w.hits) == 2 and w.states == []          # the prelude is the user's: no state of the session's
    prefix, tail = split(mem.tokenizer, msgs)
    opening, words = opening_parts(mem.tokenizer, tail)
    P = len(prefix) + len(opening)
    store = mem.require_store()
    first, second = (store.token_ids(h.rows) for h in w.hits)
    assert w.stats["tokens_restored"] == P + len(first) and w.stats["tokens_recomputed"] == len(second)
    assert w.stats["tokens_grafted"] == len(first) + len(second) and w.stats["tokens_rerotated"] == 0
    assert w.cache.get_seq_length() == P + len(first) + len(second) + len(words)
    # the lead: bit for bit the computation that deposited those tokens (the prelude in one pass, the turn in
    # one pass after it: both shorter than a block), computed here with the model alone
    assert P + len(first) <= store.manifest.block_tokens
    with torch.inference_mode():
        out = mem.model(input_ids=torch.tensor([prefix + opening]), use_cache=True)
        out = mem.model(input_ids=torch.tensor([first]), past_key_values=out.past_key_values, use_cache=True)
    ref = kvops.cache_slice(out.past_key_values, 0, P + len(first))
    got = kvops.cache_slice(w.cache, 0, P + len(first))
    assert torch.equal(got, ref)
    # the same window prefilled (the lead off): equal up to float rounding
    alice.exact_lead = False
    all_prefilled = build(mem.rt, alice, msgs, "new", 8, "kv", k=2, owner=alice.key)
    assert all_prefilled.stats["tokens_recomputed"] == len(first) + len(second)
    assert all_prefilled.stats["tokens_restored"] == P and all_prefilled.states
    assert torch.allclose(w.logits, all_prefilled.logits, atol=1e-3)
    alice.exact_lead = True
    # another opening: a system message of the client's, or a later message of a conversation
    for other in ([{"role": "system", "content": "Be brief."}] + msgs,
                  [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}] + msgs):
        build(mem.rt, alice, other, "new", 8, "kv", k=2, owner=alice.key)               # its prefix stored: restored next
        o = build(mem.rt, alice, other, "new", 8, "kv", k=2, owner=alice.key)
        assert o.stats["tokens_recomputed"] == len(first) + len(second)
        assert o.stats["tokens_restored"] == len(split(mem.tokenizer, other)[0]) + len(opening)
