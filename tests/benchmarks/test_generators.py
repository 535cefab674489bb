"""bench_qa's question generators (benchmarks/haystack.py): every needle and distractor lands in the
haystack once, same-shape records differ in one attribute, a spanning question's facts sit in order a
paragraph apart; and the paired sign test bench_qa reports."""

import random
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from haystack import GENERATORS, generated, haystack  # noqa: E402


@pytest.mark.parametrize("generator", [g for g in GENERATORS if g != "real"])
def test_every_needle_and_distractor_is_in_the_haystack_once(generator, tokenizer):
    rng = random.Random(11)
    qs = generated(rng, generator, 14)
    assert len(qs) == 14 and len({q.question for q in qs}) == 14
    text = haystack(rng, tokenizer, 6000, qs)
    for q in qs:
        for s in q.needles + q.distractors:
            assert text.count(s) == 1, s
        assert all(a for a in q.answers)
    n = len(tokenizer(text, add_special_tokens=False)["input_ids"])
    assert 5000 < n < 6600


def test_records_are_near_twins_that_differ_in_one_attribute():
    qs = generated(random.Random(2), "records", 12)
    shapes = {re.sub(r"\b(\w+) locker holds the number \d+", "X locker holds the number N", q.needles[0]) for q in qs}
    assert shapes == {"The X locker holds the number N."}                       # one shape, twelve colours
    assert len({q.answers for q in qs}) >= 11
    assert sum(len(q.distractors) for q in qs) == 0                              # a whole family asked
    part = generated(random.Random(2), "records", 5)
    assert len(part[0].distractors) == 7 and all(not q.distractors for q in part[1:])   # the rest as distractors


def test_a_spanning_questions_facts_sit_in_order_a_paragraph_apart(tokenizer):
    rng = random.Random(5)
    qs = generated(rng, "span", 6)
    text = haystack(rng, tokenizer, 5000, qs)
    paras = text.split("\n\n")
    for q in qs:
        i, j = paras.index(q.needles[0]), paras.index(q.needles[1])
        assert j == i + 1 + q.gap
        assert all(a in " ".join(q.needles) for a in q.answers)


def test_the_sign_test():
    from bench_qa import sign_test
    assert sign_test(0, 0) == 1.0 and sign_test(3, 3) == 1.0
    assert sign_test(5, 0) == pytest.approx(2 / 32)
    assert sign_test(0, 8) == pytest.approx(2 / 256) and sign_test(1, 9) == pytest.approx(2 * 11 / 1024)
    assert sign_test(4, 1) == sign_test(1, 4) > 0.1
