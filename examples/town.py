"""The documents and questions both example apps use: three short documents about a fictional
town (so the model cannot know the answers beforehand), and questions with their expected answers."""

import os
from pathlib import Path

DATA = Path(__file__).parent / "data"
FILES = sorted(DATA.glob("*.txt"))

# (question, strings of which the answer must contain one, case-insensitive)
QUESTIONS = [
    ("How much does a bicycle ticket on the Vellmark ferry cost?", ["3 euros", "3 euro", "€3"]),
    ("In which year was the observatory's main telescope installed?", ["1911"]),
    ("Who discovered Comet Berg?", ["Jonas Berg"]),
    ("How much will the new Mill Street bridge cost?", ["1.2 million"]),
    ("How many passengers can the Kestrel carry?", ["240"]),
    ("Who is the current director of the observatory?", ["Saarinen"]),
    ("What is the new mooring fee for visiting yachts?", ["30 euros", "30 euro", "€30"]),
    ("On which days does the Vellmark summer festival take place?", ["July"]),
]

# KVMEMORY_EXAMPLE_QUESTIONS=N asks only the first N (the test suite's bounded run of the examples)
if os.environ.get("KVMEMORY_EXAMPLE_QUESTIONS"):
    QUESTIONS = QUESTIONS[:max(1, int(os.environ["KVMEMORY_EXAMPLE_QUESTIONS"]))]


def correct(answer: str, expected: list[str]) -> bool:
    return any(e.lower() in answer.lower() for e in expected)


def report(name: str, rows: list[tuple[str, str, bool, float, float]]) -> None:
    """Print one line per question and the totals: rows of (question, answer, ok, ttft_s, total_s)."""
    print(f"\n{name}")
    for q, a, ok, ttft, total in rows:
        print(f"  [{'ok' if ok else 'miss'}] TTFT {ttft:6.2f} s  total {total:6.2f} s  {q}\n         -> {a!r}")
    n = len(rows)
    ttfts = sorted(r[3] for r in rows)
    print(f"  {sum(r[2] for r in rows)}/{n} correct; median TTFT {ttfts[n // 2]:.2f} s; "
          f"mean total {sum(r[4] for r in rows) / n:.2f} s")
