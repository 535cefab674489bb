"""The re-rank over stored KV (kvmemory/rerank.py), with a tiny random-weight Llama: each
candidate's score is the question's likelihood behind a fresh prefill of its segment prefix
(grafted at its deposit positions, so byte for byte; the candidates' questions in one pass, bit for
bit in invariant mode); ask uses the new order."""

import pytest
import torch

import kvmemory
from kvmemory import kv as kvops
from kvmemory.errors import InputError
from kvmemory.rerank import question_loglik, rerank, within_margin
from kvmemory.retrieve import rank_blocks
from tests.test_documents import words


@pytest.fixture
def mem(store_path, tiny):
    with kvmemory.Memory(store_path, model=tiny, segment_blocks=2) as m:
        yield m


@pytest.fixture
def inv_mem(store_path, tiny):
    import copy
    model, tok = tiny
    with kvmemory.Memory(store_path, model=copy.deepcopy(model), tokenizer=tok, segment_blocks=2, invariant=True) as m:
        yield m


@pytest.mark.parametrize("mode", ["default", "invariant"])
def test_rerank_scores_equal_a_fresh_prefill_of_each_segment_prefix(request, rng, mode):
    """The candidates' questions run in one pass (batching.forward_many): in invariant mode each
    score is its own fresh prefill's, bit for bit; with the default kernels, to the last bits of
    a GEMM over more rows, and the same every time for the same question and store."""
    mem = request.getfixturevalue("inv_mem" if mode == "invariant" else "mem")
    mem.add(words(rng, 1400) + " The vault code is 4417. " + words(rng, 1400), doc_id="a")
    mem.add(words(rng, 900), doc_id="b")
    docs, C = mem.documents, mem.block_tokens
    q = "What is the vault code?"
    q_ids = docs.prelude.question_ids(q)
    pool = rank_blocks(mem.rt, docs, q, "text", n=16)
    out, cost = rerank(mem.rt, docs, q_ids, pool, 5)
    assert len(out) == 5 and {h.row for h in out} == {h.row for h in pool[:5]}
    assert [h.score for h in out] == sorted((h.score for h in out), reverse=True)
    span = docs.prelude.question_span(q_ids)
    assert mem.tokenizer.decode(q_ids[span[0]:span[1]]).strip() == q and span[1] < len(q_ids)   # the words only
    assert cost["blocks"] == 5 and cost["tokens_prefilled"] == 5 * span[1] and cost["tokens_restored"] >= 5 * C
    live = docs.live_map()
    for h in out:
        doc_id, _, i = live[h.row]
        rows = mem.store.manifest.docs[doc_id].rows
        first = i - i % docs.segment_blocks                          # the segment's first block
        meta = mem.store.block_meta(rows[first:i + 1])
        ids = [int(t) for j in range(i + 1 - first) for t in meta["tokens"][j][: int(meta["n_tokens"][j])]]
        cache = kvops.make_cache(None, mem.model.config)
        with torch.inference_mode():
            for s in range(0, len(docs.prelude.ids), C):             # as deposited: prelude, then the segment
                mem.model(input_ids=torch.tensor([docs.prelude.ids[s:s + C]]), past_key_values=cache)
            for s in range(0, len(ids), C):
                mem.model(input_ids=torch.tensor([ids[s:s + C]]), past_key_values=cache)
        fresh = question_loglik(mem.model, cache, q_ids, docs.prelude.question_span(q_ids))
        if mode == "invariant":
            assert fresh == h.score                                 # bit for bit
        else:
            assert abs(fresh - h.score) < 1e-4
        assert h.scores["rerank"] == h.score and h.ranks["fused"] >= 1
    again, _ = rerank(mem.rt, docs, q_ids, pool, 5)
    assert [(h.row, h.score) for h in again] == [(h.row, h.score) for h in out]    # deterministic


def test_ask_with_rerank_grafts_the_reranked_best_and_the_margin_decides_the_second(mem, rng):
    mem.add(words(rng, 2600), doc_id="a")
    q = "river lantern copper meadow?"
    a = mem.ask(q, top_k=2, rerank=6, rerank_margin=0.0, min_relevance=0.0, max_new_tokens=3, rerank_keep=False)
    st = a.stats
    assert st["reranked"]["blocks"] == 6 and st["timings_s"]["rerank"] > 0
    assert st["blocks_selected"] == 1                                 # margin 0: only the best (no ties here)
    docs = mem.documents
    best, _ = rerank(mem.rt, docs, docs.prelude.question_ids(q), rank_blocks(mem.rt, docs, q, "text", n=16), 6)
    assert [s.candidate.row for s in a.window.slots if s.candidate.selected] == [best[0].row]
    wide = mem.ask(q, top_k=2, rerank=6, rerank_margin=100.0, min_relevance=0.0, max_new_tokens=3, rerank_keep=False)
    alone = mem.ask(q, top_k=2, rerank=6, min_relevance=1.0, max_new_tokens=3)   # only exact BM25 ties contend
    assert alone.stats["reranked"]["blocks"] < 6
    assert wide.stats["blocks_selected"] == 2
    assert within_margin(best, 3, 100.0) == best[:3] and within_margin([], 2, 1.0) == []
    for bad in ({"rerank": -1}, {"rerank": True}, {"rerank_margin": -0.5}, {"max_context_tokens": 0}):
        with pytest.raises(InputError):
            mem.ask(q, **bad)


def test_the_re_rank_keeps_the_first_rankings_best_and_adds_its_own(mem, rng):
    """rerank_keep (the default): the block the lexical and dense ranks put first stays in the window;
    where the re-rank puts another first, that one joins it; top_k 1 keeps the first ranking's alone."""
    from kvmemory.retrieve import Ranked, relevant
    rs = [Ranked(i, 1.0, {}, {}) for i in range(4)]
    re = [Ranked(2, -1.0, {}, {}), Ranked(1, -1.2, {}, {}), Ranked(0, -3.0, {}, {}), Ranked(3, -9.0, {}, {})]  # best first
    assert [h.row for h in within_margin(re, 2, 0.5)] == [2, 1]                     # without keep: 0 is dropped
    assert [h.row for h in within_margin(re, 2, 0.5, keep=rs[0])] == [2, 0]         # with it: 0 stays, 2 joins
    assert within_margin(re, 2, 0.5, keep=rs[0])[1].score == -3.0                   # with its re-rank score
    assert [h.row for h in within_margin(re, 3, 0.5, keep=rs[0])] == [2, 0, 1]
    assert [h.row for h in within_margin(re, 1, 0.5, keep=rs[0])] == [0]
    assert [h.row for h in within_margin(re, 2, 0.5, keep=rs[2])] == [2, 1]         # the same block: nothing added
    mem.add(words(rng, 2600), doc_id="a")
    q = "river lantern copper meadow?"
    docs = mem.documents
    pool = rank_blocks(mem.rt, docs, q, "text", n=16)
    first = relevant(pool, 6, 0.0)[0]
    a = mem.ask(q, top_k=2, rerank=6, rerank_margin=0.0, min_relevance=0.0, max_new_tokens=3)
    assert first.row in [s.candidate.row for s in a.window.slots if s.candidate.selected]


def test_ask_holds_the_grafted_tokens_to_the_budget(mem, rng):
    for d in range(6):
        mem.add(words(rng, 1100), doc_id=f"d{d}")
    q = "river lantern copper meadow falcon?"
    C = mem.block_tokens
    p = len(mem.documents.prelude.ids)
    for rr in (0, 8):                   # the budget holds whatever the re-rank keeps
        wide = mem.ask(q, top_k=8, min_relevance=0.0, max_new_tokens=2, max_context_tokens=1 << 20, rerank=rr)
        tight = mem.ask(q, top_k=8, min_relevance=0.0, max_new_tokens=2, max_context_tokens=4 * C, rerank=rr)
        # the window's context (grafted, or re-read after its exact prefix: tokens_restored + tokens_reread)
        held = lambda a: a.stats["tokens_restored"] + a.stats["tokens_reread"] - p         # noqa: E731
        assert held(wide) == wide.window.context_tokens - p > 4 * C >= held(tight) == tight.window.context_tokens - p
        assert sum(s.candidate.n_tokens for s in tight.window.slots) == held(tight)
        assert tight.stats["max_context_tokens"] == 4 * C
        if rr == 0:
            # the 8 contenders are the fused ranking's first 8 and every block holds <= C tokens, so
            # at least 4 fit; more only where short blocks (a document's last) leave room for them
            sel = [s.candidate for s in tight.window.slots if s.candidate.selected]
            assert all(c.n_tokens <= C for c in sel)
            assert len(sel) >= 4 and (len(sel) == 4 or any(c.n_tokens < C for c in sel))
            assert len(sel) < wide.stats["blocks_selected"]


def test_contenders_are_the_blocks_that_pass_the_relevance_cut():
    from kvmemory.retrieve import relevant as contenders     # the relevance cut, with n for top_k
    from kvmemory.retrieve import Ranked
    rs = [Ranked(i, 1.0 / (i + 1), {}, {"bm25": b}) for i, b in enumerate([10.0, 9.0, 4.0, 8.0, 7.9])]
    assert [h.row for h in contenders(rs, 4, 0.8)] == [0, 1, 3]      # 4 is past n, 2 below 0.8 x 10
    assert [h.row for h in contenders(rs, 3, 0.0)] == [0, 1, 2]
    dense_only = [Ranked(0, 1.0, {}, {})] + rs[1:]
    assert len(contenders(dense_only, 4, 0.8)) == 4 and contenders([], 4, 0.8) == []
