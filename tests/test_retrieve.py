"""The relevance cut: pure logic over ranked blocks."""

from kvmemory.retrieve import Ranked, relevant


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
