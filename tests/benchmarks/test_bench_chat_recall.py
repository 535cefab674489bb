"""benchmarks/bench_chat_recall.py: its judge (right answers, continued prose) on known answers, and a
tiny end-to-end run with the real default model (the model's own replies, a reopened memory)."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest

from tests.clirun import run_script

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_chat_recall as b  # noqa: E402


def test_the_judge():
    p = {"value": "52917", "old": None}
    assert b.right(p, "Your combination is 52917.") and not b.right(p, "I don't know.")
    fixed = {"value": "Oslo", "old": "Bergen"}
    assert b.right(fixed, "You live in Oslo now.") and not b.right(fixed, "Bergen, then Oslo.")
    added = {"value": "French", "old": None, "also": "German"}          # "I speak French." then "I also speak German."
    assert b.right(added, "You speak French and German.") and not b.right(added, "You speak German.")
    assert b.shape(added) == "added" and b.shape(fixed) == "corrected" and b.shape(p) == "told"
    habit = "I'm sorry for any confusion, but as a chatbot I cannot"
    assert b.continues_prose("You replied: I'm sorry", [], False)
    assert b.continues_prose("On 2026-12-04, the user said: my code", [], True)      # the form, right or not
    assert b.opens_as_memory("The user said: my code is 52917") and not b.opens_as_memory("Your code is 52917.")
    assert b.continues_prose(habit + " help", [habit], False)             # a recalled reply repeated, not answering
    assert not b.continues_prose(habit + " help", [], False)              # the model's habit: nothing recalled said it
    assert not b.continues_prose("The door code at work is 8013.", ["The door code at work is 8013."], True)
    assert b.continues_prose("The door code at work is 8013.", ["The door code at work is 8013."], False)
    assert not b.continues_prose("Your locker combination is 52917.", [habit], True)
    code = {"value": "3621", "old": "6472"}                 # told 6472, then "They reset the door code to 3621"
    stale = "The door code at work is 6472."
    assert b.is_stale(code, stale, b.right(code, stale)) and not b.is_stale(code, "It is 3621.", True)
    assert not b.is_stale(code, "The door code at work is 1234.", False)
    assert not b.continues_prose(stale, [stale], False, stale=True)       # an answer, stale: not a continuation
    assert b.continues_prose("The user said: " + stale, [stale], False, stale=True)    # the form still counts
    res = {"summary": {"kv": {}}, "rows": [{**code, "kind": "code", "kv": {"answer": a, "right": False, "continues": True,
                                                           "opens_as_memory": a.startswith("The user"),
                                                           "ttft_s": 0.1, "found": True}}
                                           for a in (stale, "The user said: " + stale, "The door code at work is")]}
    again = b.rejudge(res)["summary"]["kv"]                 # judged again from the stored fields
    assert again["continues"] == 2 / 3 and again["continues_v2"] == 1 and again["stale"] == 2 / 3
    assert b.continues_v1(habit, [habit])                                 # the first judge counted habits too
    assert b._messages("On 2026-12-04, the user said: hi there\nYou replied: hello\n") == [
        {"role": "user", "content": "hi there"}, {"role": "assistant", "content": "hello"}]
    assert b._messages("On 2026-12-04, the user said: hi there\n") == [{"role": "user", "content": "hi there"}]


def test_right_answers_by_kind_of_fact():
    """The summary and the second table count each kind of fact apart: right / probes (every value recalled)."""
    def row(kind, kv_right, found, oracle_right):
        return {"kind": kind, "value": "x", "old": None,
                "kv": {"answer": "", "right": kv_right, "continues": False, "ttft_s": 0.1, "found": found},
                "oracle": {"answer": "", "right": oracle_right, "continues": False, "ttft_s": 0.1, "found": False}}
    rows = [row("job", True, True, True), row("job", False, False, True), row("job", False, True, False),
            row("city", True, True, True)]
    s = b.summarize(rows, ["kv", "oracle"])
    assert s["kv"]["kinds"] == {"city": [1, 1, 1], "job": [1, 3, 2]}
    assert s["oracle"]["kinds"] == {"city": [1, 1, 0], "job": [2, 3, 0]}
    lines = b.kinds_table({"summary": s, "rows": rows}).splitlines()
    assert lines[0] == "| kind of fact | kv | oracle |"
    assert lines[2:] == ["| city | 1/1 (1) | 1/1 |", "| job | 1/3 (2) | 2/3 |"]      # the oracle recalls nothing
    assert b.kinds_table({"summary": s, "rows": rows}) in b.table({"summary": s, "rows": rows})


def test_probes_are_distinct_kinds_with_corrections_after_first_tellings():
    probes = b.make_probes(random.Random(3), 20)
    assert len({p["kind"] for p in probes}) == 20 == len(probes)
    for p in probes:
        assert all(v in b.told_text(p) for v in b.values(p)) and "?" in p["ask"]
        if p["old"] is not None:
            assert p["old"] in p["tell"] and p["value"] != p["old"] and not p.get("also")


def test_probes_added_to_every_value_asked_for():
    """--kinds draws only those kinds; --change 1 corrects every kind with corrections and adds to every kind
    in ADDS (the question then asks for all: "Which languages do I speak?"); --change 0 neither."""
    kinds = ["language", "allergy", "locker", "colour"]
    probes = b.make_probes(random.Random(4), 10, kinds, 1.0)
    assert sorted(p["kind"] for p in probes) == sorted(kinds)
    by = {p["kind"]: p for p in probes}
    assert b.shape(by["locker"]) == "corrected" and b.shape(by["colour"]) == "told"
    for kind in ("language", "allergy"):
        p = by[kind]
        assert b.shape(p) == "added" and p["also"] != p["value"] and p["also"] in p["add"]
        assert p["ask"] in b.ADDS[kind][1] and b.told_text(p) == f"{p['tell']} {p['add']}"
    assert all(b.shape(p) == "told" for p in b.make_probes(random.Random(4), 10, kinds, 0.0))


def test_no_additions_draws_an_earlier_results_probes_again():
    """--no-additions is the generator before additions: draw 11's histories seed gives its 200 probes again
    (the result file's users, in order), and the generator of today draws others from it."""
    res = json.loads((ROOT / "benchmarks/results/chat-recall-200-2026-12-07-d11.json").read_text())
    rng = random.Random(res["histories_seed"])
    users = {f"user-{i}-{rng.randrange(1 << 20):05x}": b.make_probes(rng, 20, additions=False) for i in range(10)}
    keys = ("user", "kind", "value", "tell", "ask", "old")
    drawn = [{"user": u, **p} for u, ps in users.items() for p in ps]
    assert [{k: r[k] for k in keys} for r in drawn] == [{k: r[k] for k in keys} for r in res["rows"]]
    rng = random.Random(res["histories_seed"])
    today = [p for i in range(10) for p in (rng.randrange(1 << 20), b.make_probes(rng, 20))[1]]
    assert [p["tell"] for p in today] != [r["tell"] for r in res["rows"]]


def test_condition_names():
    assert b.condition("plain-user")["base"] == "plain" and b.condition("plain-user")["memory"] == "user"
    for moved in ("plain-user-system", "plain-user-inline", "plain-user-after"):
        with pytest.raises(SystemExit, match="a plain condition quotes the turns opening the new message"):
            b.condition(moved)
    assert b.condition("kv-user-system-r0.6") == {"base": "kv", "memory": "user-system", "head": False,
                                                   "end": False, "recompute": 0.6, "guard": None, "inline": False,
                                                   "nl": False, "k": None, "cut": None, "cover": None,
                                                   "order": None, "topic": None, "first": None, "place": None,
                                                   "lexical": None, "newer": None, "supersede": None,
                                                   "dense": None, "additive": None, "lead": None}
    assert b.condition("kv-user-head-guard") == {"base": "kv", "memory": "user", "head": True, "end": False,
                                                 "recompute": None, "guard": True, "inline": False, "nl": False,
                                                 "k": None, "cut": None, "cover": None, "order": None,
                                                 "topic": None, "first": None, "place": None, "lexical": None,
                                                 "newer": None, "supersede": None, "dense": None, "additive": None, "lead": None}
    assert b.condition("kv-user-r0.0-cut0.75") == {**b.condition("kv-user-r0.0"), "cut": 0.75}
    assert b.condition("text-user-k1")["k"] == 1 and b.condition("kv-user-cut0")["cut"] == 0.0
    assert b.condition("kv-user-cut0.75-cover")["cover"] is True and b.condition("kv-user-cut0.75-nocover")["cover"] is False
    assert b.condition("kv-user-cut0.75")["cover"] is None          # the default's
    assert b.condition("kv-user-topic")["topic"] is True and b.condition("text-user-rel-notopic")["topic"] is False
    assert b.condition("kv-user-open")["place"] == "message" and b.condition("text-user-after")["place"] == "after"
    assert b.condition("kv-user-inline")["place"] is None and b.condition("kv-user-inline")["inline"]
    assert b.condition("kv-user-topic-first")["first"] is True and b.condition("kv-user-nofirst")["first"] is False
    assert b.condition("kv-user-rel")["order"] == "relevance" and b.condition("text-user-cover-time")["order"] == "time"
    assert b.condition("kv-user-open-content")["lexical"] == "content" and b.condition("text-user-allwords")["lexical"] == "all"
    assert b.condition("kv-user-content-newer")["newer"] is True and b.condition("kv-user-nonewer")["newer"] is False
    assert b.condition("kv-user-newer-supersede")["supersede"] is True
    assert b.condition("text-user-nosupersede")["supersede"] is False
    assert b.condition("kv-user-supersede-dense")["dense"] is True and b.condition("text-user-nodense")["dense"] is False
    assert b.condition("kv-user-dense-additive")["additive"] is True
    assert b.condition("text-user-supersede-noadditive")["additive"] is False
    assert b.condition("kv-user-additive-lead")["lead"] is True and b.condition("kv-user-nolead")["lead"] is False
    assert b.condition("kv-user-noguard")["guard"] is False and b.condition("kv-user-r0-guard")["guard"] is True
    assert b.condition("kv-user-system-r1.0-inline")["inline"] and b.condition("text-user-nl")["nl"]
    assert b.condition("kv-user-end")["end"] and not b.condition("kv-user-end")["head"]
    assert b.condition("text-exchange")["memory"] == "exchange" and b.condition("oracle")["base"] == "oracle"
    assert b.condition("kv-user-messages-r0.3")["memory"] == "user-messages"
    for bad in ("kv-user-sideways", "kv-exchange-messages", "kv-user-cut1.5", "kv-user-k0", "kv-user-cover-cut0.5", "kv-user-rel-cover", "kv-user-topic-rel",
                "kv-user-first-topic", "kv-user-newer-content", "kv-user-supersede-newer", "kv-user-dense-supersede",
                "kv-user-additive-dense", "kv-user-nolead-additive"):
        with pytest.raises(SystemExit):
            b.condition(bad)


@pytest.mark.real_model
def test_a_tiny_run_end_to_end(tmp_path):
    store = tmp_path / "histories"
    cmd = [sys.executable, "benchmarks/bench_chat_recall.py", "--users", "1", "--facts", "2", "--distractors", "0",
           "--answer-tokens", "8", "--reply-tokens", "8", "--store", str(store)]
    r = run_script(cmd + ["--seed", "5", "--out", str(tmp_path / "a")], cwd=ROOT, capture_output=True, text=True,
                   timeout=900)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(next((tmp_path / "a").glob("chat-recall-2-*.json")).read_text())
    assert res["seed"] == 5 and res["probes"] == 2 and set(res["summary"]) >= set(b.CONDITIONS)
    assert res["summary"]["none"]["evidence_recalled"] == 0 and res["summary"]["kv-user"]["evidence_recalled"] > 0
    kinds = res["summary"]["kv-user"]["kinds"]                # right answers by kind of fact, printed and kept
    assert set(kinds) == {x["kind"] for x in res["rows"]} and sum(n for _, n, _ in kinds.values()) == res["probes"]
    assert "| kind of fact | " in r.stdout
    # the states its replies saved are gone: the next run starts from the histories alone
    assert res["question_states_removed"] >= res["probes"] * len(b.CONDITIONS)
    assert next((tmp_path / "a").glob("chat-recall-2-*.json")).with_suffix(".png").is_file()
    # the same histories again, other conditions: paired on the same conversations
    r = run_script(cmd + ["--seed", "6", "--conditions", "text-user,text-user-guard,kv-user-system-r1.0,kv-user-guard,"
                          "kv-user-messages,text-user-messages,kv-user-inline,plain-user", "--out",
                          str(tmp_path / "b")], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-2000:]
    again = json.loads(next((tmp_path / "b").glob("chat-recall-2-*.json")).read_text())
    assert "reusing the histories" in r.stderr and again["histories_seed"] == 5
    assert [x["tell"] for x in again["rows"]] == [x["tell"] for x in res["rows"]]
    assert again["summary"]["kv-user-system-r1.0"]["evidence_recalled"] > 0
    assert again["summary"]["paired_kv-user-system-r1.0"]["against"] == "text-user"
    assert again["summary"]["kv-user-messages"]["evidence_recalled"] > 0
    assert again["summary"]["paired_kv-user-messages/same-form"]["against"] == "text-user-messages"
    assert again["summary"]["kv-user-inline"]["evidence_recalled"] > 0
    # plain-user: text-user's turns, computed from nothing by the model alone (nothing restored, the same recall)
    for x in again["rows"]:
        assert x["plain-user"]["restored"] == 0 and x["plain-user"]["ttft_s"] > 0
        assert (x["plain-user"]["recalled"], x["plain-user"]["found"]) == (x["text-user"]["recalled"], x["text-user"]["found"])
    # text-user-guard quotes text-user's very window, and finds it saved: "restored" says so (its TTFT is a hit)
    assert all(x["text-user-guard"]["restored"] > x["text-user"]["restored"] for x in again["rows"])


@pytest.mark.real_model
def test_long_histories_kept_in_one_memory(tmp_path):
    """--history-tokens pads each history with pasted prose; --memories user keeps it in one memory (the
    first, which replies); a condition needing another memory is refused before any question."""
    cmd = [sys.executable, "benchmarks/bench_chat_recall.py", "--users", "1", "--facts", "1", "--distractors", "0",
           "--answer-tokens", "4", "--reply-tokens", "4", "--history-tokens", "1500", "--memories", "user",
           "--store", str(tmp_path / "h"), "--seed", "7"]
    r = run_script(cmd + ["--conditions", "kv-user,text-user", "--out", str(tmp_path / "a")], cwd=ROOT,
                   capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(next((tmp_path / "a").glob("chat-recall-1-*.json")).read_text())
    assert res["history_tokens_per_user"] >= 1500 and res["summary"]["kv-user"]["n"] == 1
    kept = json.loads((tmp_path / "h" / "histories.json").read_text())
    assert kept["memories"] == "user"
    r = run_script(cmd + ["--conditions", "kv-exchange", "--out", str(tmp_path / "b")], cwd=ROOT,
                   capture_output=True, text=True, timeout=900)
    assert r.returncode != 0 and "needs the memory 'exchange'" in r.stderr and not (tmp_path / "b").exists()
    r = run_script(cmd[:-4] + ["--store", str(tmp_path / "new"), "--memories", "user,nope"], cwd=ROOT,
                   capture_output=True, text=True, timeout=900)
    assert r.returncode != 0 and "--memories" in r.stderr and not (tmp_path / "new").exists()
    for bad, said in ((["--kinds", "locker,nope"], "--kinds: nope"), (["--change", "1.5"], "--change")):
        r = run_script(cmd[:-4] + ["--store", str(tmp_path / "new")] + bad, cwd=ROOT, capture_output=True,
                       text=True, timeout=900)
        assert r.returncode != 0 and said in r.stderr and not (tmp_path / "new").exists()
