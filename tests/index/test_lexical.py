"""index/lexical.py: the in-place BM25 gives bm25s' scores (its reference: method "lucene", built
from scratch over the same terms) on random corpora, after adds, re-adds and removes; an index
grown write by write scores bit for bit like one built at once, and like itself saved and loaded."""

import random

import bm25s
import numpy as np
import pytest

from kvmemory.index.lexical import LexicalIndex, content_terms, content_words, terms

WORDS = [f"w{i}" for i in range(40)] + ["harbour", "lantern", "moved", "moving", "oslo", "bergen", "4417", "code"]


def text(rng: random.Random) -> str:
    n = rng.choice([0, 1, 2, 5, 9, 20, 40])
    return " ".join(rng.choice(WORDS) for _ in range(n))


def reference(docs: dict[int, str], query: str) -> dict[int, float]:
    """bm25s built from scratch over the same terms: window id -> score, for every window."""
    ids = sorted(docs)
    bm = bm25s.BM25()
    bm.index([terms(docs[i]) or [""] for i in ids], show_progress=False)
    q = [t for t in terms(query) if t in bm.vocab_dict]
    if not q:
        return {i: 0.0 for i in ids}
    return dict(zip(ids, bm.get_scores(q).tolist()))


def dense(idx: LexicalIndex, docs, query: str) -> dict[int, float]:
    ids, sc = idx.scores(query)
    out = {i: 0.0 for i in docs}
    out.update(zip(ids.tolist(), sc.tolist()))
    return out


def test_scores_are_bm25s_scores_after_adds_and_removes(rng, tmp_path):
    idx, docs = LexicalIndex(), {}
    queries = ["what is my locker code", "I moved to Oslo", "w3 w3 w7", "w1 harbour lantern w39", "nothing here"]
    for step in range(6):
        new = {rng.randrange(10_000): text(rng) for _ in range(rng.randint(1, 60))}
        idx.add(list(new), list(new.values()))               # a re-added id replaces its text
        docs.update(new)
        gone = rng.sample(sorted(docs), k=min(len(docs) - 1, rng.randint(0, 15)))
        idx.remove(gone + [10_000 + step])                      # an unknown id is no error
        for g in gone:
            del docs[g]
        assert len(idx) == len(docs) and idx.ids() == set(docs)
        for q in queries + [text(rng)]:
            got, want = dense(idx, docs, q), reference(docs, q)
            ids = sorted(docs)
            np.testing.assert_allclose([got[i] for i in ids], [want[i] for i in ids], rtol=2e-6, atol=1e-6)
            top = idx.search(q, 8)
            assert [s for _, s in top] == sorted((s for _, s in top), reverse=True) and all(s > 0 for _, s in top)
            assert len(top) == min(8, sum(1 for v in want.values() if v > 0))
            # what it ranks first bm25s ranks first too (up to float32 ties)
            if top:
                assert want[top[0][0]] >= max(want.values()) * (1 - 1e-5)
    # grown write by write == built at once == saved and loaded: the same bits
    once = LexicalIndex()
    once.add(list(docs), list(docs.values()))
    idx.save(tmp_path / "bm25.json")
    loaded = LexicalIndex.load(tmp_path / "bm25.json")
    for q in queries:
        a, b, c = idx.scores(q), once.scores(q), loaded.scores(q)
        assert all(np.array_equal(x[0], y[0]) and np.array_equal(x[1], y[1]) for x, y in ((a, b), (a, c)))
        assert idx.search(q, 5) == once.search(q, 5) == loaded.search(q, 5)


def test_need_ranks_only_the_windows_holding_a_word_the_question_is_about():
    """search(need=terms): the windows holding one of them, each with its score over the whole query ("my"
    and "what" still count); content_words keeps what a question is about, as written."""
    idx = LexicalIndex()
    idx.add([1, 2, 3, 4], ["What is my haiku? What is my poem?", "My manager is Astrid.",
                           "a context manager manager manager", "I work as a librarian"])
    q = "Who is my manager?"
    assert content_terms(q) == set(terms("manager")) and content_words("What is my job? Which car now?") == "job car"
    full = dict(idx.search(q, 10))
    held = idx.search(q, 10, need=content_terms(q))
    assert {i for i, _ in held} == {2, 3} and all(s == full[i] for i, s in held)
    assert held[0][0] == 2                                  # "my" still counts among them
    assert idx.search("What is my job?", 10, need=content_terms("What is my job?")) == []   # none holds "job"
    assert 1 in full and idx.search(q, 10, need=set()) == []


def test_empty_and_bad_input():
    idx = LexicalIndex()
    assert idx.search("anything", 5) == [] and len(idx) == 0
    idx.add([1, 2], ["", "oslo"])
    assert idx.search("oslo", 0) == [] and [i for i, _ in idx.search("oslo", 5)] == [2]
    with pytest.raises(ValueError, match="2 ids for 1 texts"):
        idx.add([3, 4], ["x"])
    idx.remove([1, 2])
    assert idx.search("oslo", 5) == [] and idx.scores("oslo")[0].size == 0


def test_the_log_holds_each_write_and_a_torn_line_is_skipped(rng, tmp_path):
    from kvmemory.index.lexical import log_path
    path = tmp_path / "bm25.json"
    idx, docs = LexicalIndex(), {i: text(rng) for i in range(50)}
    idx.add(list(docs), list(docs.values()))
    idx.save(path)
    base = path.read_bytes()
    for step in range(5):                                   # writes go to the log; the base is untouched
        new = {100 + 10 * step + j: text(rng) for j in range(3)}
        idx.add(list(new), list(new.values()))
        gone = [step, 100 + 10 * step]
        idx.remove(gone)
        idx.append(path, [i for i in new if i not in gone], gone)
    assert path.read_bytes() == base and len(log_path(path).read_bytes().splitlines()) == 5
    loaded = LexicalIndex.load(path)
    assert loaded.ids() == idx.ids()
    for q in ("w3 w5 harbour", "oslo 4417 code"):
        assert np.array_equal(loaded.scores(q)[1], idx.scores(q)[1])
    # a crash mid-append leaves a torn last line: skipped on load; the next append starts a line of its own
    with open(log_path(path), "ab") as f:
        f.write(b'{"rm":[],"add":{"999":["oslo"')
    assert 999 not in LexicalIndex.load(path).ids()
    idx.add([777], ["bergen lantern"])
    idx.append(path, [777], [])
    again = LexicalIndex.load(path)
    assert 777 in again.ids() and 999 not in again.ids() and again.ids() == idx.ids()
    idx.save(path)                                          # a whole write drops the log
    assert not log_path(path).exists() and LexicalIndex.load(path).ids() == idx.ids()
