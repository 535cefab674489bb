"""The relevance cut: pure logic over ranked blocks."""

from kvmemory.retrieve import COVER, Ranked, relevant


def r(row, bm25=None):
    return Ranked(row, 1.0 / (row + 1), {}, {} if bm25 is None else {"bm25": bm25})


def test_relevance_cut_keeps_the_best_and_close_ones_only():
    ranked = [r(0, 10.0), r(1, 9.0), r(2, 5.0), r(3, 8.0)]
    assert [h.row for h in relevant(ranked, 4, 0.75)] == [0, 1, 3]
    assert [h.row for h in relevant(ranked, 2, 0.75)] == [0, 1]       # never more than top_k
    assert [h.row for h in relevant(ranked, 4, 0.0)] == [0, 1, 2, 3]  # 0 disables the cut
    assert [h.row for h in relevant(ranked, 4, 0.95)] == [0]


def test_no_cut_where_bm25_did_not_find_the_best_block():
    ranked = [r(0), r(1, 9.0), r(2)]
    assert [h.row for h in relevant(ranked, 3, 0.75)] == [0, 1, 2]
    assert relevant([], 3, 0.75) == []


def test_a_block_below_the_cut_with_a_term_no_kept_block_holds_is_kept_at_cover():
    # what each block holds of the question "locker code, and sister's name?"
    holds = {0: {"locker", "code"}, 1: {"sister"}, 2: {"code"}, 3: {"name"}, 4: {"sister"}}
    ranked = [r(0, 10.0), r(1, 5.5), r(2, 5.2), r(3, 4.0), r(4, 5.0)]
    held = lambda h: holds[h.row]                                     # noqa: E731
    assert [h.row for h in relevant(ranked, 5, 0.75)] == [0]           # without held: the cut alone
    # 1 brings "sister" (>= COVER of the best); 2 brings nothing new; 3 brings "name" but is under COVER;
    # 4 brings "sister", which 1 already holds
    assert COVER == 0.5
    assert [h.row for h in relevant(ranked, 5, 0.75, held)] == [0, 1]
    assert [h.row for h in relevant(ranked, 2, 0.75, held)] == [0, 1]  # still never more than top_k
    assert [h.row for h in relevant(ranked, 5, 0.0, held)] == [0, 1, 2, 3, 4]   # no cut: held changes nothing
    # under a cut lower than COVER the cut's own bar holds for a new term too
    assert [h.row for h in relevant(ranked, 5, 0.45, held)] == [0, 1, 2, 4]
    assert [h.row for h in relevant(ranked, 5, 0.3, held)] == [0, 1, 2, 3, 4]
