"""The verified-solution library (Memory.learn / Memory.solve): nothing unverified is grafted, a
rejected solution never enters, a repeated problem restores its exact state, a verified solve is
learned, the library survives reopen. Plumbing with the tiny model; answers with the real one."""

import json

import pytest
import torch

import kvmemory
from kvmemory import kv as kvops
from kvmemory.cli import main
from kvmemory.errors import InputError, VerificationError
from kvmemory.library import answer_is, extract_answer, normalize_answer, resolve_verifier


def test_answers_and_verifiers():
    assert extract_answer("3 + 4 = 7.\nAnswer: 7") == "7"
    assert extract_answer("so it is 12 then 15") == "15"
    assert extract_answer("Answer: April 6.\nmore") == "April 6"
    assert extract_answer("no number") is None
    assert normalize_answer("1,000.50") == "1000.5" and normalize_answer(" 7. ") == "7"
    assert normalize_answer("Tuesday") == normalize_answer("tuesday")
    assert answer_is(7)("x\nAnswer: 7") and not answer_is(7)("Answer: 8")
    assert answer_is(84)("Answer: 84 jars.") and not answer_is(84)("Answer: 184 jars") and not answer_is(8)("Answer: 84")
    assert answer_is("April 6")("Answer: April 6, 2025") and not answer_is("April 6")("Answer: April 60")
    assert answer_is("tenalp")("Answer: 'tenalp'") and answer_is("Thursday")("Answer: thursday.")
    fn, name = resolve_verifier("answer:42")
    assert fn("Answer: 42") and name == "answer:42"
    for bad in ("nope:1", "answer", 3):
        with pytest.raises(InputError):
            resolve_verifier(bad)


@pytest.fixture
def tmem(store_path, tiny):
    with kvmemory.Memory(store_path, model=tiny) as m:
        yield m


def test_rejected_never_enters_unverified_never_grafted(tmem):
    before = len(tmem.states())
    with pytest.raises(VerificationError):
        tmem.learn("What is 2 + 2?", "2 + 2 = 5.\nAnswer: 5", verify="answer:4")
    with pytest.raises(VerificationError):
        tmem.learn("What is 2 + 2?", "Answer: 5", verify=lambda s: False)
    assert len(tmem.states()) == before and tmem.library.entries() == []
    assert not (tmem.path / "library").exists() or not list((tmem.path / "library").glob("*.json"))
    with pytest.raises(InputError):
        tmem.learn("What is 2 + 2?", "Answer: 4", verify=lambda s: "yes")       # a verifier must say True/False
    u = tmem.learn("What is 3 + 3?", "Answer: 6", verify=None)
    assert not u.verified and u.answer == "6"
    sol = tmem.solve("What is 3 + 3?", max_new_tokens=4, learn=False)
    assert u.entry_id not in sol.sources and not sol.stats["repeated"] and sol.stats["examples"] == 0
    w = tmem.learn("What is 3 + 4?", "three plus four is 7", verify="answer:7")       # answer line added
    assert w.solution == "three plus four is 7\nAnswer: 7" and w.answer == "7"
    assert tmem.solve("What is 3 + 4?", max_new_tokens=4, learn=False).stats["repeated"]
    v = tmem.learn("What is 2 + 2?", "2 + 2 = 4.\nAnswer: 4", verify="answer:4")
    assert v.verified and v.entry_id in {s.id for s in tmem.states()}
    assert tmem.learn("What is 2 + 2?", "2 + 2 = 4.\nAnswer: 4", verify="answer:4") == v     # learned once
    # unverified, later verified: both files are write-once, the verified one counts
    u2 = tmem.learn("What is 5 + 5?", "Answer: 10", verify=None)
    up = tmem.learn("What is 5 + 5?", "Answer: 10", verify="answer:10")
    assert up.entry_id == u2.entry_id and up.verified
    assert sorted(p.name.split(".", 1)[1] for p in (tmem.path / "library").glob(f"{up.entry_id}.*")) == \
        ["unverified.json", "verified.json"]
    assert [e.verified for e in tmem.library.entries() if e.entry_id == up.entry_id] == [True]
    tmem.library._entries.clear()                  # as a fresh reader sees it
    assert {e.entry_id: e.verified for e in tmem.library.entries()}[up.entry_id] is True
    assert set(tmem.solve("What is 3 + 3?", max_new_tokens=4, learn=False).sources) == {v.entry_id, up.entry_id,
                                                                                        w.entry_id}
    with pytest.raises(InputError):
        tmem.learn("  ", "Answer: 1", verify=None)
    with pytest.raises(InputError):
        tmem.solve("x", k=-1)


def test_verified_solve_is_learned_and_survives_reopen(store_path, tiny):
    with kvmemory.Memory(store_path, model=tiny) as mem:
        ex = mem.learn("Add 1 and 2.", "1 + 2 = 3.\nAnswer: 3", verify="answer:3")
        sol = mem.solve("Add 5 and 6.", verify=lambda s: True, attempts=4, max_new_tokens=6)
        assert sol.verified is True and sol.learned is not None and sol.learned.verified
        assert sol.sources == [ex.entry_id] and sol.stats["tokens_restored"] > 0
        assert sol.stats["tokens_exact"] == ex.n_tokens          # the one example sits at its own positions
        sampled = mem.solve("Add 7 and 8.", verify=lambda s: False, attempts=3, max_new_tokens=5, seed=1)
        assert sampled.verified is False and sampled.learned is None and sampled.stats["attempts"] == 3
        ids = {e.entry_id for e in mem.library.entries()}
    with kvmemory.Memory(store_path, model=tiny) as mem:
        assert {e.entry_id for e in mem.library.entries()} == ids and len(ids) == 2
        again = mem.solve("Add 5 and 6.", max_new_tokens=6)
        assert again.stats["repeated"] or again.sources        # its own entry or, if no "Answer:", the examples
        assert mem.verify() == []
    with kvmemory.Memory(store_path, model=tiny, read_only=True) as ro:     # a reader answers, cannot learn
        sol = ro.solve("Add 9 and 9.", verify=lambda s: True, attempts=4, max_new_tokens=6)
        assert sol.verified and sol.learned is None and sol.stats["learn_skipped"] == "the store is read-only"


def test_a_solve_lists_the_library_once(tmem, monkeypatch):
    """On an object store a listing is a request: solve reads the library's names once."""
    tmem.learn("What is 5 + 1?", "5 + 1 = 6.\nAnswer: 6", verify="answer:6")
    files = tmem.store.files
    calls = []
    real = files.list
    monkeypatch.setattr(files, "list", lambda *a, **k: calls.append(a) or real(*a, **k))
    tmem.solve("What is 5 + 2?", max_new_tokens=4, learn=False)            # new: examples path
    assert len(calls) == 1
    tmem.solve("What is 5 + 1?", max_new_tokens=4, learn=False)            # repeated path
    assert len(calls) == 2


def test_window_first_example_exact_others_rerotated(tmem):
    a = tmem.learn("Add 1 and 2.", "1 + 2 = 3.\nAnswer: 3", verify="answer:3")
    b = tmem.learn("Add 4 and 4.", "4 + 4 = 8.\nAnswer: 8", verify="answer:8")
    lib = tmem.library
    kv, ids, exact, _ = lib.window_kv([a, b])
    sa, sb = tmem.load(a.entry_id), tmem.load(b.entry_id)
    P = len(lib.prelude_ids)
    assert ids == sa.token_ids + sb.token_ids[P:] and exact == len(sa.token_ids)
    assert torch.equal(kv[:, :, :, :exact], sa.kv)                              # bytes of the stored state
    assert torch.equal(kv[:, 1, :, exact:], sb.kv[:, 1, :, P:])                  # values never move
    # keys moved by the offset: close to computing the two examples in one pass (RoPE is relative)
    with torch.inference_mode():
        cache = kvops.make_cache(None, tmem.model.config)
        tmem.model(input_ids=torch.tensor([ids]), past_key_values=cache, use_cache=True)
        ref = kvops.cache_slice(cache, 0, len(ids))
    assert not torch.equal(kv[:, 0, :, exact:], sb.kv[:, 0, :, P:])
    # layer 0's keys depend on the token and its position only: the re-rotated ones match
    assert torch.allclose(kv[0, 0, :, exact:], ref[0, 0, :, exact:], atol=1e-4)
    assert torch.allclose(kv[0, 1, :, exact:], ref[0, 1, :, exact:], atol=1e-5)


def test_library_examples_are_grafted_through_the_pager(tmem):
    """A hot library is grafted from the pager's host tier (kvmemory.graft, as ask is): each
    example's blocks are read from the store (digest-checked) once; later solves take the same bytes
    from RAM, with the same first logits as cold reads. A repeated problem's state is kept in RAM
    after its first verified read. A state forgotten from the store is grafted from nowhere."""
    a = tmem.learn("Add 1 and 2.", "1 + 2 = 3.\nAnswer: 3", verify="answer:3")
    b = tmem.learn("Add 4 and 4.", "4 + 4 = 8.\nAnswer: 8", verify="answer:8")
    lib = tmem.library
    s1 = tmem.solve("Add 2 and 5.", k=2, max_new_tokens=2, learn=False)
    n = s1.stats["blocks_from"]["disk"]
    assert n >= 2 and s1.stats["blocks_from"]["host"] == 0
    s2 = tmem.solve("Add 3 and 5.", k=2, max_new_tokens=2, learn=False)
    assert s2.stats["blocks_from"] == {"gpu": 0, "host": n, "disk": 0} and s2.stats["tokens_restored"] > 0
    tmem.rt.handle.drop_pager()                                  # cold again: read from the store
    s3 = tmem.solve("Add 3 and 5.", k=2, max_new_tokens=2, learn=False)
    assert s3.stats["blocks_from"]["disk"] == n
    assert torch.equal(s3.first_logits, s2.first_logits) and s3.text == s2.text
    r1 = tmem.solve("Add 1 and 2.", max_new_tokens=2, learn=False)
    r2 = tmem.solve("Add 1 and 2.", max_new_tokens=2, learn=False)
    assert r1.stats["repeated"] and r1.stats["states_from_ram"] == 0 and r2.stats["states_from_ram"] == 1
    assert torch.equal(lib.state(a.entry_id).kv, tmem.load(a.entry_id).kv)
    tmem.forget_states([a.entry_id])
    with pytest.raises(kvmemory.StateNotFoundError):
        lib.state(a.entry_id)
    with pytest.raises(kvmemory.StateNotFoundError):
        lib.window_kv([a, b])


def test_solve_recompute_lets_the_examples_see_each_other(tmem):
    """recompute=1.0 recomputes every grafted token: the same first logits as the examples
    re-prefilled as text (up to kernel order); 0 < r < 1 recomputes a share of the examples after
    the first (the first, exact at its own positions, is never recomputed below 1.0)."""
    for x, y in ((1, 2), (4, 4), (3, 5)):
        tmem.learn(f"Add {x} and {y}.", f"{x} + {y} = {x + y}.\nAnswer: {x + y}", verify=f"answer:{x + y}")
    q = "Add 2 and 6."
    graft = tmem.solve(q, k=3, max_new_tokens=4, learn=False)
    text = tmem.solve(q, k=3, max_new_tokens=4, learn=False, examples_as="text")
    full = tmem.solve(q, k=3, max_new_tokens=4, learn=False, recompute=1.0)
    part = tmem.solve(q, k=3, max_new_tokens=4, learn=False, recompute=0.2)
    assert graft.sources == text.sources == full.sources == part.sources and len(graft.sources) == 3
    st = full.stats
    assert st["tokens_recomputed"] == st["tokens_restored"] and graft.stats["tokens_recomputed"] == 0
    assert st["tokens_prefilled"] == graft.stats["tokens_prefilled"]
    torch.testing.assert_close(full.first_logits, text.first_logits, atol=2e-3, rtol=1e-4)
    d_graft = (graft.first_logits - text.first_logits).abs().max()
    d_full = (full.first_logits - text.first_logits).abs().max()
    assert d_full < d_graft                          # the graft alone is further from the text
    ps = part.stats
    assert 0 < ps["tokens_recomputed"] <= ps["tokens_restored"] - ps["tokens_exact"]
    assert ps["tokens_recomputed"] == round(0.2 * ps["tokens_restored"]) or \
        ps["tokens_recomputed"] == ps["tokens_restored"] - ps["tokens_exact"]
    for bad in (-0.1, 1.5, "half", True):
        with pytest.raises(InputError):
            tmem.solve(q, recompute=bad)


def test_cli_learn_and_solve(tmp_path, tiny_dir, capsys):
    f = tmp_path / "sol.jsonl"
    f.write_text("\n".join(json.dumps(d) for d in [
        {"problem": "Add 1 and 2.", "solution": "1 + 2 = 3.\nAnswer: 3", "answer": 3},
        {"problem": "Add 2 and 2.", "solution": "2 + 2 = 5.\nAnswer: 5", "answer": 4}]) + "\n")
    store = tmp_path / "lib.kvm"
    assert main(["learn", str(store), str(f), "--model", str(tiny_dir)]) == 1       # one rejected
    out = capsys.readouterr()
    assert "1 stored, 1 rejected" in out.out and "rejected" in out.err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"problem": "p", "solution": "s"}\n')
    assert main(["learn", str(store), str(bad), "--model", str(tiny_dir)]) == 1
    assert "--unverified" in capsys.readouterr().err
    assert main(["solve", str(store), "Add 1 and 2.", "--json", "--model", str(tiny_dir)]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["stats"]["repeated"] and res["stats"]["tokens_prefilled"] == 1
    assert main(["solve", str(store), "Add 5 and 2.", "--recompute", "1.5", "--model", str(tiny_dir)]) == 1
    assert "recompute is the fraction" in capsys.readouterr().err
    assert main(["solve", str(store), "Add 5 and 2.", "--recompute", "0.5", "--no-learn", "--json",
                 "--max-new-tokens", "2", "--model", str(tiny_dir)]) == 0
    res = json.loads(capsys.readouterr().out)       # one example, at its own positions: nothing to recompute
    assert res["stats"]["examples"] == 1 and res["stats"]["tokens_recomputed"] == 0
    assert main(["solve", str(tmp_path / "missing.kvm"), "x", "--model", str(tiny_dir)]) == 1


@pytest.mark.real_model
def test_repeated_problem_restores_its_exact_state_and_answers(tmp_path, real_model):
    with kvmemory.Memory(tmp_path / "r.kvm", model=real_model) as mem:
        p = "A crate holds 14 jars. How many jars are in 6 crates?"
        e = mem.learn(p, "Each crate holds 14 jars, so 6 crates hold 14 * 6 = 84 jars.\nAnswer: 84",
                      verify="answer:84")
        sol = mem.solve(p, verify="answer:84")
        assert sol.stats["repeated"] and sol.answer == "84" and sol.verified and sol.stats["answer_from"] == "library"
        assert sol.stats["tokens_decoded"] == 1 and sol.stats["tokens_prefilled"] == 1
        # the model, restored at the end of its verified solution, ends the turn there
        assert sol.stats["model_ends_turn"] is True
        # the restored prefix is the stored state's bytes, and the answer's first logits equal a clean
        # computation in the same order (the state prefilled block by block, cut before its last
        # token, that token fed alone): zero difference
        st = mem.load(e.entry_id)
        cut = sol.stats["tokens_restored"]
        # restored: everything before the answer's last token; the token after it ends the turn
        assert st.token_ids[cut + 1] in mem.eos_ids
        assert mem.tokenizer.decode(st.token_ids[:cut + 1]).endswith("Answer: 84")
        with torch.inference_mode():
            cache = kvops.make_cache(None, mem.model.config)
            for _ in kvops.prefill_blocks(mem.model, st.token_ids, mem.block_tokens, cache):
                pass
            assert torch.equal(kvops.cache_slice(cache, 0, st.n_tokens), st.kv)
            kvops.truncate(cache, cut)
            clean = kvops.last_logits(mem.model, torch.tensor([st.token_ids[cut:cut + 1]]), cache)
        assert torch.equal(sol.first_logits, clean)
        # a new problem of the family: the example is grafted, only the problem is prefilled
        new = mem.solve("A crate holds 12 jars. How many jars are in 5 crates?", max_new_tokens=48, learn=False)
        assert new.sources == [e.entry_id] and new.stats["tokens_restored"] == e.n_tokens
        assert new.stats["tokens_prefilled"] < 40
        text = mem.solve("A crate holds 12 jars. How many jars are in 5 crates?", max_new_tokens=48, learn=False,
                         examples_as="text")
        assert text.stats["tokens_restored"] == 0 and text.stats["tokens_prefilled"] > e.n_tokens
        # the same example: same tokens and positions, so the first token agrees
        assert int(new.first_logits.argmax()) == int(text.first_logits.argmax())
