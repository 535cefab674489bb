"""bench_flywheel.py runs end to end at a tiny size (so it does not rot), and its program-written
problems are exact: every worked solution passes its own verifier, no other answer does."""

import json
import random
import re
import sys
from pathlib import Path

import pytest

from tests.clirun import run_script

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
from problems import FAMILIES, draw  # noqa: E402

from kvmemory.library import answer_is  # noqa: E402


def test_problem_families_are_exact(rng):
    ps = draw(random.Random(rng.random()), 200)
    assert {p[0] for p in ps} == set(FAMILIES) and len({p[1] for p in ps}) == 200
    for fam, text, ans, worked in ps:
        assert answer_is(ans)(worked), (text, worked)
        # a number's wrong answer is the next number ("-8x" would still read as -8, by design)
        wrong = "Answer: " + (str(int(ans) + 1) if re.fullmatch(r"-?\d+", ans) else ans + "x")
        assert not answer_is(ans)(wrong)


@pytest.mark.real_model
def test_bench_flywheel_runs(tmp_path):
    p = run_script([sys.executable, "benchmarks/bench_flywheel.py", "--stream", "2", "--eval", "2",
                    "--checkpoints", "1,2", "--n", "2", "--repeat", "2", "--seeded", "3", "--max-new-tokens", "6",
                    "--sweep-k", "1", "--cold", "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                   timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(next(tmp_path.glob("flywheel-*.json")).read_text())
    C = res["conditions"]
    assert {"base_greedy", "base_best_of_2", "flywheel_after_1", "flywheel_after_2", "text_few_shot", "seeded_3",
            "seeded_3_text", "repeated"} <= set(C)
    assert res["seeded_library"] == 3 and C["seeded_3"]["restored_mean"] > 0 and C["seeded_3_text"]["restored_mean"] == 0
    # the k sweep: one example grafted restores fewer tokens than three; as text nothing is restored
    assert C["seeded_3_k1"]["examples_mean"] == 1 and C["seeded_3"]["examples_mean"] == 3
    assert 0 < C["seeded_3_k1"]["restored_mean"] < C["seeded_3"]["restored_mean"]
    assert C["seeded_3_k1_text"]["restored_mean"] == 0 and "TTFT text" in p.stdout
    # with the pager's RAM tier off every example is read from the store, and the answers do not change
    assert all(r["blocks_from_ram"] == 0 for r in C["seeded_3_cold"]["rows"]) and res["cold_same_answers"]
    assert sum(r["blocks_from_ram"] for r in C["seeded_3"]["rows"]) > 0
    # seeded problems asked again come back from their stored states, right, in a few tokens
    rep = C["repeated"]
    assert rep["n"] == 2 and rep["accuracy"] == 1.0 and all(r["repeated"] for r in rep["rows"])
    assert rep["prefilled_mean"] == 1 and rep["decoded_mean"] <= 12
    assert next(tmp_path.glob("flywheel-*.png")).stat().st_size > 0
