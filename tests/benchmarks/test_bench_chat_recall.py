"""benchmarks/bench_chat_recall.py: its judge (right answers, continued prose) on known answers, and a
tiny end-to-end run with the real default model (the model's own replies, a reopened memory)."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_chat_recall as b  # noqa: E402


def test_the_judge():
    p = {"value": "52917", "old": None}
    assert b.right(p, "Your combination is 52917.") and not b.right(p, "I don't know.")
    fixed = {"value": "Oslo", "old": "Bergen"}
    assert b.right(fixed, "You live in Oslo now.") and not b.right(fixed, "Bergen, then Oslo.")
    replies = ["I'm sorry for any confusion, but as a chatbot I cannot"]
    assert b.continues_prose("You replied: I'm sorry", replies)
    assert b.continues_prose("On 2026-12-04, the user said: my code", replies)
    assert b.continues_prose("I'm sorry for any confusion, but as a chatbot I cannot", replies)
    assert not b.continues_prose("Your locker combination is 52917.", replies)


def test_probes_are_distinct_kinds_with_corrections_after_first_tellings():
    probes = b.make_probes(random.Random(3), 20)
    assert len({p["kind"] for p in probes}) == 20 == len(probes)
    for p in probes:
        assert p["value"] in (p.get("fix") or p["tell"]) and "?" in p["ask"]
        if p["old"] is not None:
            assert p["old"] in p["tell"] and p["value"] != p["old"]


@pytest.mark.real_model
def test_a_tiny_run_end_to_end(tmp_path):
    r = subprocess.run([sys.executable, "benchmarks/bench_chat_recall.py", "--users", "1", "--facts", "2",
                        "--distractors", "0", "--answer-tokens", "8", "--reply-tokens", "8", "--seed", "5",
                        "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(next(tmp_path.glob("chat-recall-2-*.json")).read_text())
    assert res["seed"] == 5 and res["probes"] == 2 and set(res["summary"]) >= set(b.CONDITIONS)
    assert res["summary"]["none"]["evidence_recalled"] == 0 and res["summary"]["kv-user"]["evidence_recalled"] > 0
    assert (tmp_path / next(tmp_path.glob("chat-recall-2-*.json")).with_suffix(".png").name).is_file()
