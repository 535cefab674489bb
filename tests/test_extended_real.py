"""Extended memory with the real default model: E4 (other-offset graft) and selection."""

import random

import pytest
import torch

import kvmemory
from kvmemory import kv as kvops
from kvmemory.exactness import kl_divergence, max_abs_diff
from kvmemory.ops import gather_blocks_ref
from kvmemory.rope import inv_freq

pytestmark = pytest.mark.real_model


@torch.inference_mode()
def _block_kv(model, ids, start):
    """KV of ids computed alone at positions start.. -> ([L, 2, H, n, D], cache)."""
    cache = kvops.make_cache(None, model.config)
    pos = torch.arange(start, start + len(ids)).unsqueeze(0)
    model(input_ids=torch.tensor([ids]), position_ids=pos, past_key_values=cache, use_cache=True)
    return kvops.cache_slice(cache, 0, len(ids)), cache


@pytest.mark.parametrize("offset", [64, 1000, 7000])
def test_e4_rerotated_block_is_close_to_computing_it_there(real_model, rng, offset):
    """Isolates the RoPE error: a block computed at 0 and re-rotated to `offset` vs the same
    block computed at `offset` (self-attention depends only on relative positions)."""
    model, tok = real_model
    ids = [rng.randrange(tok.vocab_size) for _ in range(256)]
    at0, _ = _block_kv(model, ids, 0)
    ref, _ = _block_kv(model, ids, offset)
    out = torch.empty_like(at0)
    gather_blocks_ref(at0.unsqueeze(0), torch.tensor([0]), torch.tensor([256]), torch.tensor([0]),
                      torch.tensor([offset]), out, inv_freq(model))
    key_err = float((out[:, 0] - ref[:, 0]).norm() / ref[:, 0].norm())
    val_err = float((out[:, 1] - ref[:, 1]).norm() / ref[:, 1].norm())
    suffix = [rng.randrange(tok.vocab_size) for _ in range(8)]
    pos = torch.arange(offset + 256, offset + 264).unsqueeze(0)
    with torch.inference_mode():
        a = model(input_ids=torch.tensor([suffix]), position_ids=pos,
                  past_key_values=kvops.make_cache(out, model.config)).logits[0]
        b = model(input_ids=torch.tensor([suffix]), position_ids=pos,
                  past_key_values=kvops.make_cache(ref, model.config)).logits[0]
    kl = kl_divergence(b, a) / len(suffix)
    print(f"\nE4 offset {offset}: relative key error {key_err:.2g}, value error {val_err:.2g}, "
          f"mean KL {kl:.2g}, max |dlogit| {max_abs_diff(a, b):.2g}")
    assert key_err < 1e-4
    assert kl <= 1e-6


def test_e3_native_slot_graft_is_the_stored_state_exactly(tmp_path, real_model):
    """A document's first block grafted at its deposit position continues exactly like the
    stored chain prelude + block (KL 0): the window adds no error where positions match."""
    text = " ".join(["The harbour master logs every ship that enters the bay."] * 60)
    with kvmemory.Memory(tmp_path / "w.kvm", model=real_model) as mem:
        mem.add(text, doc_id="log")
        docs = mem.documents
        row = mem.store.manifest.docs["log"].rows[0]
        from kvmemory.graft import window_kv
        from kvmemory.window import Candidate, plan
        meta = mem.store.block_meta([row])
        c = Candidate(row, "log", 0, 0, int(meta["n_tokens"][0]), int(meta["positions"][0][0]), 1.0)
        q = docs.prelude.question_ids("Who logs the ships?")
        w = plan([c], len(docs.prelude.ids), len(q), 8, 8192, 1)
        assert w.slots[0].shift == 0
        kv, _ = window_kv(mem.rt, w, docs.prelude_kv())
        cache = kvops.make_cache(kv, mem.model.config)
        chain = mem.store.chain(row)
        stored = kvops.make_cache(mem.states_room.read_chain(chain), mem.model.config)
        with torch.inference_mode():
            a = mem.model(input_ids=torch.tensor([q]), past_key_values=cache).logits
            b = mem.model(input_ids=torch.tensor([q]), past_key_values=stored).logits
        assert torch.equal(a, b)


def test_text_selector_finds_the_needle_block(tmp_path, real_model, rng):
    r = rng
    filler = ["The committee reviewed the budget for the new library wing.",
              "Rain fell steadily over the northern hills during the harvest.",
              "Engineers inspected the bridge cables after the storm passed.",
              "The museum extended its opening hours for the summer exhibition."]
    code = str(r.randrange(1000000, 9999999))
    parts = [r.choice(filler) for _ in range(350)]
    parts.insert(r.randrange(len(parts)), f"The special magic number for Lisbon is {code}.")
    with kvmemory.Memory(tmp_path / "n.kvm", model=real_model) as mem:
        info = mem.add(" ".join(parts), doc_id="hay")
        assert info.blocks >= 10
        ans = mem.ask("What is the special magic number for Lisbon?", top_k=2, max_new_tokens=16)
        ids = mem.tokenizer(" ".join(parts), add_special_tokens=False)["input_ids"]
        picked = "".join(mem.tokenizer.decode(ids[s:e]) for _, s, e, _ in ans.sources)
        print(f"\nneedle answer {code!r}: reply {ans.text!r}; stats {ans.stats['timings_s']}")
        assert code in picked
        assert ans.stats["tokens_prefilled"] < 40 and ans.stats["store_tokens"] == info.n_tokens


def _log_doc(r: random.Random, n: int, needle: str, at: int, tok=None, before: str = "", block: int = 256) -> str:
    """n filler sentences with needle inserted at sentence `at`; given the tokenizer (and the text that
    comes before this one in the document), the needle moves on until it lies wholly inside one block,
    so that a question's best blocks are the needles' own (a needle cut in two scores as two halves)."""
    filler = ["The harbour master logs every ship that enters the bay.", "Gulls circle the fish market at dawn.",
              "A ferry leaves for the islands twice a day.", "The lighthouse keeper paints the rail each spring.",
              "Fog rolls in from the sea on autumn evenings.", "Traders weigh the catch on brass scales."]
    parts = [r.choice(filler) for _ in range(n)]
    if tok is not None:
        def start(i: int) -> int:
            return len(tok(before + " ".join(parts[:i]) + " ", add_special_tokens=False)["input_ids"]) % block
        while not 8 <= start(at) <= block - 32:
            at += 1
    parts.insert(at, needle)
    return " ".join(parts)


def test_segment_expansion_grafts_the_selected_block_behind_its_own_context_exactly(tmp_path, real_model, rng):
    """A selected block deep in its segment comes with the blocks before it; grafted at their deposit
    positions, the window is byte for byte the stored chain: logits equal (KL 0)."""
    r = rng
    with kvmemory.Memory(tmp_path / "x.kvm", model=real_model) as mem:
        text = _log_doc(r, 150, "The quartermaster's zyxquor token is 5581.", 60)  # block 1 or 2 of segment 0
        mem.add(text, doc_id="log")
        ans = mem.ask("What is the zyxquor token?", top_k=1, selector="bm25", max_new_tokens=8)
        st = ans.stats
        rows = mem.store.manifest.docs["log"].rows
        assert st["blocks_selected"] == 1 and st["blocks"] >= 2          # it brought its segment prefix
        assert st["tokens_exact"] == st["tokens_restored"] - len(mem.documents.prelude.ids)
        assert st["tokens_rerotated"] == 0 and st["tokens_recomputed"] == 0
        last = ans.window.slots[-1].candidate.row
        assert last in rows and ans.sources[0][1] == 0
        stored = kvops.make_cache(mem.states_room.read_chain(mem.store.chain(last)), mem.model.config)
        q = mem.documents.prelude.question_ids("What is the zyxquor token?")
        with torch.inference_mode():
            ref = kvops.last_logits(mem.model, torch.tensor([q]), stored)
        assert torch.equal(ans.first_logits, ref.float())
        print(f"\nexpansion: {st['blocks']} blocks grafted exactly; reply {ans.text!r}")


def test_reread_prefills_what_follows_the_exact_prefix_the_canonical_way(tmp_path, real_model, rng):
    """reread (the default): a window of two runs grafts its exact prefix (the prelude and the first
    run, from its segment's start) and prefills the second run's tokens over it with the question,
    block by block: the first answer token's logits are bit-identical to restoring the first run's
    stored chain and prefilling the rest of the window's text and the question the canonical way.
    The second run's blocks are not read. Grafted instead (reread=False), the logits differ."""
    r = rng
    with kvmemory.Memory(tmp_path / "w.kvm", model=real_model) as mem:
        first = _log_doc(r, 420, "The quartermaster's zyxquor token is 5581.", 60, tok=real_model[1]) + " "
        text = first + _log_doc(r, 200, "The zyxquor token of the pier is 7730.", 150, tok=real_model[1],
                                before=first)                                        # segments apart
        mem.add(text, doc_id="log")
        q = "What is the zyxquor token?"
        kw = dict(top_k=2, selector="bm25", rerank=0, min_relevance=0.0, max_new_tokens=8)
        ans = mem.ask(q, **kw)
        w, st = ans.window, ans.stats
        head = w.exact_head()
        assert len(w.runs()) == 2 and 0 < len(head.slots) < len(w.slots)
        assert st["reread"] is True and st["tokens_reread"] == w.context_tokens - w.exact_prefix_tokens() > 0
        assert st["tokens_restored"] == head.context_tokens == w.exact_prefix_tokens()
        assert st["tokens_rerotated"] == st["tokens_recomputed"] == 0 and st["reread_slots"] == len(w.slots) - len(head.slots)
        assert st["blocks_from"]["disk"] + st["blocks_from"]["host"] == len(head.slots)   # the rest is not read
        from kvmemory.graft import window_tokens
        rest = (mem.documents.prelude.ids + window_tokens(mem.store, w))[head.context_tokens:]
        q_ids = mem.documents.prelude.question_ids(q)
        cache = kvops.make_cache(mem.states_room.read_chain(mem.store.chain(head.slots[-1].candidate.row)),
                                 mem.model.config)
        with torch.inference_mode():
            for _, _, ref in kvops.prefill_blocks(mem.model, rest + q_ids, mem.block_tokens, cache,
                                                  head.context_tokens, mem.rt.prefill_tokens):
                pass
        assert torch.equal(ans.first_logits, ref.float())
        grafted = mem.ask(q, reread=False, **kw)
        assert [s.candidate.row for s in grafted.window.slots] == [s.candidate.row for s in w.slots]
        assert grafted.stats["tokens_rerotated"] > 0 and grafted.stats["tokens_reread"] == 0
        assert kl_divergence(ref.float(), grafted.first_logits) > 0


def test_recompute_one_equals_re_prefilling_the_window_text(tmp_path, real_model, rng):
    """r = 1.0 recomputes every window token: the window's text re-prefilled in one pass. r = 0
    (pure graft, blocks from different segments side by side) deviates measurably."""
    r = rng
    with kvmemory.Memory(tmp_path / "y.kvm", model=real_model) as mem:
        text = _log_doc(r, 420, "The quartermaster's zyxquor token is 5581.", 300)
        mem.add(text, doc_id="log")
        q = "What is the zyxquor token of the harbour?"
        kw = dict(top_k=3, expand=False, max_new_tokens=8, min_relevance=0.0, reread=False)
        full = mem.ask(q, recompute=1.0, **kw)
        graft = mem.ask(q, recompute=0.0, **kw)
        assert [s.candidate.row for s in full.window.slots] == [s.candidate.row for s in graft.window.slots]
        assert full.stats["rerotated_slots"] >= 1
        from kvmemory.graft import window_tokens
        ids = mem.documents.prelude.ids + window_tokens(mem.store, full.window) + \
            mem.documents.prelude.question_ids(q)
        with torch.inference_mode():
            ref = mem.model(input_ids=torch.tensor([ids])).logits[0, -1].float()
        kl_full, kl_graft = kl_divergence(ref, full.first_logits), kl_divergence(ref, graft.first_logits)
        print(f"\nKL vs re-prefill: r=1 {kl_full:.2g} (max |dlogit| {max_abs_diff(ref, full.first_logits):.2g}), "
              f"r=0 {kl_graft:.2g}")
        torch.testing.assert_close(full.first_logits, ref, atol=2e-3, rtol=1e-4)
        assert kl_full < 1e-6 and kl_full < kl_graft
        assert full.stats["tokens_recomputed"] == full.stats["tokens_restored"]


def test_seams_as_long_as_the_runs_equal_re_prefilling_and_best_last_orders_the_window(tmp_path, real_model, rng):
    """seam=n recomputes the first n tokens of each run that meets context it was not computed in;
    with n as long as the runs every grafted token after the exact prefix is recomputed, which is the
    window's text re-prefilled. order="best_last" grafts the same blocks with the best block's run last."""
    r = rng
    with kvmemory.Memory(tmp_path / "z.kvm", model=real_model) as mem:
        text = _log_doc(r, 420, "The quartermaster's zyxquor token is 5581.", 300)
        mem.add(text, doc_id="log")
        q = "What is the zyxquor token of the harbour?"
        kw = dict(top_k=3, expand=False, max_new_tokens=8, min_relevance=0.0, reread=False)
        some = mem.ask(q, seam=16, **kw)
        whole = mem.ask(q, seam=4096, **kw)                # longer than any run: each whole
        st, p = whole.stats, len(mem.documents.prelude.ids)
        inexact = st["tokens_restored"] - p - st["tokens_exact"]
        assert inexact > 0 and st["tokens_seam"] == st["tokens_recomputed"] == inexact
        assert some.stats["tokens_seam"] == some.stats["tokens_recomputed"] == 16 * len(some.window.seam_positions(1))
        from kvmemory.graft import window_tokens
        ids = mem.documents.prelude.ids + window_tokens(mem.store, whole.window) + mem.documents.prelude.question_ids(q)
        with torch.inference_mode():
            ref = mem.model(input_ids=torch.tensor([ids])).logits[0, -1].float()
        assert kl_divergence(ref, whole.first_logits) < 1e-6
        last = mem.ask(q, order="best_last", **kw)
        rows = lambda a: [s.candidate.row for s in a.window.slots]       # noqa: E731
        assert sorted(rows(last)) == sorted(rows(whole))
        slots = last.window.slots
        tail = len(slots) - 1                            # the last run: consecutive blocks of the document
        while tail and slots[tail - 1].candidate.doc_start + slots[tail - 1].candidate.n_tokens == \
                slots[tail].candidate.doc_start:
            tail -= 1
        best = max(s.candidate.score for s in slots)
        assert best in [s.candidate.score for s in slots[tail:]]
