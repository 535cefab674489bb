"""Windows, fusion and BM25: pure parts, and the embedder's no-truncation rule with real MiniLM."""

import random

import numpy as np
import pytest

from kvmemory.errors import InputError
from kvmemory.index import windows as win
from kvmemory.index.fusion import best_per_block, rrf
from kvmemory.index.lexical import LexicalIndex, terms


@pytest.mark.parametrize("n,lead", [(0, 0), (1, 0), (62, 0), (63, 0), (300, 32), (31, 32), (5000, 0)])
def test_spans_cover_every_piece_and_fit_the_embedder(n, lead):
    spans = win.spans(n, lead)
    assert all(0 <= s < e <= n and e - s <= win.WINDOW_PIECES for s, e in spans)
    covered = set()
    for s, e in spans:
        covered.update(range(s, e))
    assert covered == set(range(n))
    assert len(spans) <= win.WINDOW_SLOTS
    if n > win.WINDOW_PIECES:
        assert all(e - s == win.WINDOW_PIECES for s, e in spans)   # full windows: no scrap pieces alone
    # any run of at most STRIDE pieces lies whole inside one window (sentences are seen whole)
    if 0 < n <= 1000:
        for a in range(0, max(1, n - win.STRIDE)):
            assert any(s <= a and a + min(win.STRIDE, n) <= e for s, e in spans)


def test_window_ids_round_trip():
    for r in (0, 1, 12345):
        for w in (0, 1, win.WINDOW_SLOTS - 1):
            assert win.row_of(win.window_id(r, w)) == r


def test_best_per_block_and_rrf():
    hits = [(win.window_id(3, 1), 0.9), (win.window_id(5, 0), 0.8), (win.window_id(3, 0), 0.95)]
    assert best_per_block(hits, win.row_of) == [(3, 0.95), (5, 0.8)]
    fused = rrf([[1, 2, 3], [3, 1, 4]])
    assert [x for x, _ in fused][:2] == [1, 3]            # 1/61 + 1/62 > 1/63 + 1/61
    assert fused[0][1] == pytest.approx(1 / 61 + 1 / 62)
    assert {x for x, _ in fused} == {1, 2, 3, 4}


def test_equal_scores_break_by_the_tie_key_not_the_row():
    """Rows 7 and 2 hold blocks at document positions 0 and 1: with equal scores the block that
    comes first in the documents wins whatever row it landed in (a Ray deposit fills rows in
    another order than a local one)."""
    where = {7: (0, 0), 2: (0, 1), 4: (1, 0)}
    hits = [(win.window_id(2, 0), 0.5), (win.window_id(7, 0), 0.5), (win.window_id(4, 0), 0.5)]
    assert [r for r, _ in best_per_block(hits, win.row_of)] == [2, 4, 7]
    assert [r for r, _ in best_per_block(hits, win.row_of, where.get)] == [7, 2, 4]
    fused = rrf([[2, 7], [7, 2]], tie=where.get)          # equal sums, equal first ranks
    assert [x for x, _ in fused] == [7, 2]
    assert [x for x, _ in rrf([[2, 7], [7, 2]])] == [2, 7]


def test_bm25_finds_rare_terms_and_persists(tmp_path):
    rng = random.Random(7)
    ids = list(range(0, 400, 4))
    texts = [f"item {rng.randrange(10**6)} sits on shelf {i}" for i in ids]
    texts[17] = "item zx81qv sits on shelf 99"
    lex = LexicalIndex()
    lex.add(ids, texts)
    assert lex.search("where is zx81qv?", 3)[0][0] == ids[17]
    assert lex.search("the of and", 3) == []               # stopwords only: nothing, not noise
    lex.save(tmp_path / "b.json")
    again = LexicalIndex.load(tmp_path / "b.json")
    assert again.search("where is zx81qv?", 3) == lex.search("where is zx81qv?", 3)
    again.remove([ids[17]])
    assert all(i != ids[17] for i, _ in again.search("zx81qv", 3))
    assert terms("The Pass-Key is crimson-482!") == ["pass", "key", "crimson", "482"]


def test_embedder_refuses_to_truncate_and_is_reproducible():
    from kvmemory.index.embedder import MAX_PIECES, TextEmbedder
    e = TextEmbedder()
    text = " ".join(f"word{i}" for i in range(400))
    ids, offsets = e.pieces(text)
    assert len(ids) > MAX_PIECES and len(offsets) == len(ids)
    with pytest.raises(InputError, match="truncated"):
        e.embed_pieces([ids[:MAX_PIECES - 1]])
    windows = [ids[s:e_] for s, e_ in win.spans(len(ids))]
    a, b = e.embed_pieces(windows), e.embed_pieces(windows)
    assert a.shape == (len(windows), 384) and np.array_equal(a, b)
    assert np.allclose(np.linalg.norm(a, axis=1), 1.0, atol=1e-5)
    # a long text is embedded whole (as its windows' mean), so its tail still moves the vector
    v1 = e.embed([text])[0]
    v2 = e.embed([text + " zebra giraffe elephant " * 30])[0]
    assert not np.allclose(v1, v2)
    # a text embedded alone again (a query ranked twice) is the same floats, computed once; a caller's
    # change to what it got back changes nothing kept
    q = "What do I do for a living?"
    first = e.embed([q])
    first[0, 0] += 1.0
    calls = []
    forward = e.model.forward
    e.model.forward = lambda *a, **k: calls.append(1) or forward(*a, **k)
    again = e.embed([q])
    assert calls == [] and np.array_equal(again, TextEmbedder().embed([q]))
    assert np.array_equal(e.embed([q, "another"])[0], again[0]) and len(calls) == 2


def test_a_word_split_by_the_block_boundary_is_whole_in_the_next_blocks_first_window():
    import re
    vocab: dict[str, int] = {}

    def pieces(text):                      # words as pieces: "xkz" + "341" joined is the word "xkz341"
        return [vocab.setdefault(w, len(vocab)) for w in re.findall(r"\w+", text)]
    first = "crate abc123 is on shelf 4. crate xkz"
    second = "341 is on shelf 9. " + " ".join(f"w{i}" for i in range(200))
    (w1,), w2 = win.block_windows(pieces, [first], [None]), win.block_windows(pieces, [second], [first])[0]
    whole = vocab["xkz341"]
    assert whole in w2[0] and "xkz" in vocab and all(whole not in w for w in w1)
    assert vocab["w199"] in w2[-1]                    # nothing dropped at the end
    assert sum(len(w) for w in w2) >= len(pieces(second))
