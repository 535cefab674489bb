import pytest

from kvmemory.window import Candidate, plan


def cand(row, doc_rank, doc_start, score, n=256, deposit=20):
    return Candidate(row=row, doc_id=f"d{doc_rank}", doc_rank=doc_rank, doc_start=doc_start, n_tokens=n,
                     deposit_pos=deposit, score=score)


def test_best_scores_chosen_then_laid_out_in_document_order():
    cs = [cand(5, 1, 512, 0.9), cand(1, 0, 768, 0.8), cand(2, 0, 0, 0.1), cand(9, 0, 256, 0.7)]
    w = plan(cs, prelude_tokens=20, question_tokens=10, max_new_tokens=10, window_tokens=8192, top_k=3)
    assert [s.candidate.row for s in w.slots] == [9, 1, 5]           # doc 0 by position, then doc 1
    assert [s.slot_pos for s in w.slots] == [20, 276, 532]
    assert w.context_tokens == 20 + 3 * 256


def test_shift_is_zero_exactly_when_slot_matches_deposit_position():
    cs = [cand(1, 0, 0, 0.9, deposit=20), cand(2, 0, 256, 0.8, deposit=276), cand(3, 0, 2048, 0.7, deposit=532)]
    w = plan(cs, 20, 5, 5, 8192, 3)
    assert [s.shift for s in w.slots] == [0, 0, 0]
    w = plan(cs[1:], 20, 5, 5, 8192, 2)
    assert [s.shift for s in w.slots] == [20 - 276, 276 - 532] and w.exact_slots == 0


def test_budget_and_duplicates():
    cs = [cand(i, 0, i * 256, 1 - i / 100) for i in range(40)] + [cand(0, 0, 0, 0.99)]
    w = plan(cs, 100, 50, 50, 8192, 100)
    assert w.total_tokens <= 8192 and len({s.candidate.row for s in w.slots}) == len(w.slots)
    assert len(w.slots) == (8192 - 200) // 256
    with pytest.raises(ValueError, match="do not fit"):
        plan(cs, 100, 8000, 200, 8192, 4)


def _segments(n_segments, base_row=0, seg=4, C=256):
    """n_segments segments of `seg` blocks; the last block of each is selected, the others are its context."""
    sel, context = [], {}
    for s in range(n_segments):
        rows = [base_row + s * seg + j for j in range(seg)]
        blocks = [Candidate(r, "d", 0, (s * seg + j) * C, C, 20 + j * C, 0.0, selected=False)
                  for j, r in enumerate(rows)]
        sel.append(Candidate(rows[-1], "d", 0, (s * seg + seg - 1) * C, C, 20 + (seg - 1) * C, 1.0 - s / 100))
        context[rows[-1]] = blocks[:-1]
    return sel, context


def test_context_budget_holds_whatever_the_spread_and_selected_blocks_come_first():
    # a large store: 8 selected blocks in 8 segments, each bringing 3 blocks of context
    sel, ctx = _segments(8)
    full = plan(sel, 20, 10, 10, 8192, 8, ctx)
    assert full.context_tokens - 20 == (8192 - 40) // 256 * 256     # without a budget: the window fills up
    w = plan(sel, 20, 10, 10, 8192, 8, ctx, max_context_tokens=3072)
    assert w.context_tokens - 20 == 3072
    chosen = {s.candidate.row for s in w.slots}
    assert {c.row for c in sel} <= chosen                  # all 8 selected, then context, best block's first
    assert sum(not s.candidate.selected for s in w.slots) == 4
    assert {3 - 1, 3 - 2, 3 - 3} <= chosen                 # the best block's whole segment prefix
    # a small store: the same 8 selections in 2 segments share their context; never above the budget
    few, ctx2 = _segments(2)
    w2 = plan(few, 20, 10, 10, 8192, 8, ctx2, max_context_tokens=3072)
    assert w2.context_tokens - 20 <= 3072
    with pytest.raises(ValueError, match="do not fit"):
        plan(sel, 100, 8000, 200, 8192, 4, ctx, max_context_tokens=10)


def test_best_last_moves_the_run_of_the_best_block_next_to_the_question():
    # runs in document order: [d0 0..512) (rows 1, 2), [d0 2048) (row 3), [d1 0) (row 4)
    cs = [cand(1, 0, 0, 0.5), cand(2, 0, 256, 0.6), cand(3, 0, 2048, 0.9), cand(4, 1, 0, 0.7)]
    doc = plan(cs, 20, 5, 5, 8192, 4)
    last = plan(cs, 20, 5, 5, 8192, 4, order="best_last")
    assert [s.candidate.row for s in doc.slots] == [1, 2, 3, 4]
    assert [s.candidate.row for s in last.slots] == [1, 2, 4, 3]       # the best's run last, the rest in order
    assert [s.slot_pos for s in last.slots] == [20, 276, 532, 788]     # packed back to back
    cs[1] = cand(2, 0, 256, 0.95)                                       # the best inside a run of two: it moves whole
    assert [s.candidate.row for s in plan(cs, 20, 5, 5, 8192, 4, order="best_last").slots] == [3, 4, 1, 2]
    # context blocks never decide (only selected ones' scores count), and a run moves with its context
    sel = [cand(10, 0, 256, 0.9), cand(20, 1, 256, 0.4)]
    ctx = {10: [cand(11, 0, 0, 0.0)], 20: [cand(21, 1, 0, 5.0)]}
    w = plan(sel, 20, 10, 10, 8192, 2, ctx, order="best_last")
    assert [s.candidate.row for s in w.slots] == [21, 20, 11, 10]
    with pytest.raises(ValueError, match="order"):
        plan(cs, 20, 5, 5, 8192, 4, order="nearest")


def test_seam_positions_are_the_first_tokens_of_each_run_that_meets_new_context():
    C, p = 256, 20
    seg = lambda row, i, deposit_block: Candidate(row, "d", 0, i * C, C, p + deposit_block * C, 1.0)  # noqa: E731
    # one run from its segment's start, grafted exactly: no seam
    w = plan([seg(0, 0, 0), seg(1, 1, 1)], p, 5, 5, 8192, 2)
    assert w.exact_prefix_tokens() == p + 2 * C and w.seam_positions(16) == []
    # + a run of another segment (blocks 8, 9 of the document, computed from its segment's start)
    w = plan([seg(0, 0, 0), seg(1, 1, 1), seg(8, 8, 0), seg(9, 9, 1)], p, 5, 5, 8192, 4)
    assert w.seam_positions(16) == list(range(p + 2 * C, p + 2 * C + 16))
    assert w.seam_positions(0) == []
    # consecutive in the document but deposited in two segments: the second segment starts a run
    w = plan([seg(0, 0, 0), seg(1, 1, 0)], p, 5, 5, 8192, 2)
    assert w.seam_positions(4) == list(range(p + C, p + C + 4))
    # a leading run cut from the front (not its segment's start) meets the prelude: a seam too
    w = plan([seg(5, 5, 2), seg(6, 6, 3)], p, 5, 5, 8192, 2)
    assert w.exact_prefix_tokens() == p and w.seam_positions(8) == list(range(p, p + 8))
    # n past a short run's end stops at the run's end
    short = Candidate(7, "e", 1, 0, 10, p + 5 * C, 1.0)
    w = plan([seg(0, 0, 0), short], p, 5, 5, 8192, 2)
    assert w.seam_positions(64) == list(range(p + C, p + C + 10))


def test_runs_and_the_exact_head():
    """runs() cuts the slots where blocks were not computed together; exact_head() is the plan of the
    exact prefix alone (what ask grafts with reread; the rest it prefills)."""
    C, p = 256, 20
    seg = lambda row, i, deposit_block: Candidate(row, "d", 0, i * C, C, p + deposit_block * C, 1.0)  # noqa: E731
    w = plan([seg(0, 0, 0), seg(1, 1, 1), seg(8, 8, 0), seg(9, 9, 1)], p, 5, 5, 8192, 4)
    assert [[s.candidate.row for s in r] for r in w.runs()] == [[0, 1], [8, 9]]
    head = w.exact_head()
    assert [s.candidate.row for s in head.slots] == [0, 1] and head.context_tokens == w.exact_prefix_tokens() == p + 2 * C
    assert head.exact_head() == head and head.runs() == w.runs()[:1]
    # one exact run: the head is the window; a leading run cut from the front: the head is the prelude
    one = plan([seg(0, 0, 0), seg(1, 1, 1)], p, 5, 5, 8192, 2)
    assert one.exact_head() == one
    cut = plan([seg(5, 5, 2), seg(6, 6, 3)], p, 5, 5, 8192, 2)
    assert cut.exact_head().slots == () and cut.exact_head().context_tokens == p and len(cut.runs()) == 1
