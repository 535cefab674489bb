"""examples/ run as written (as python examples/X.py from the repository root would, here in this process:
tests/clirun.py), offline, with the real default model, and print an answer and a time to first token for
every question."""

import os
import re
import sys
from pathlib import Path

import pytest

pytest.importorskip("langchain_community")
pytest.importorskip("llama_index.core")

import kvmemory  # noqa: E402

from tests.bounds import bound  # noqa: E402
from tests.clirun import run_script  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
from town import QUESTIONS as ALL_QUESTIONS  # noqa: E402

N_QUESTIONS = min(len(ALL_QUESTIONS), bound("KVMEMORY_EXAMPLE_QUESTIONS", 3, len(ALL_QUESTIONS)))   # the first N

pytestmark = pytest.mark.real_model
LINE = re.compile(r"\[(ok|miss)\] TTFT +([\d.]+) s +total +([\d.]+) s")


def run(script: str, *args) -> str:
    env = {**os.environ, "KVMEMORY_EXAMPLE_QUESTIONS": str(N_QUESTIONS)}
    p = run_script([sys.executable, f"examples/{script}", *map(str, args)], cwd=ROOT, text=True, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    return p.stdout


def check_report(out: str, n_reports: int = 1) -> None:
    rows = LINE.findall(out)
    assert len(rows) == n_reports * N_QUESTIONS, out
    assert all(0 < float(ttft) <= float(total) for _, ttft, total in rows)
    assert len(re.findall(r"\d+/%d correct; median TTFT" % N_QUESTIONS, out)) == n_reports


def test_langchain_examples_side_by_side(tmp_path):
    check_report(run("langchain_faiss_rag.py"))
    store = tmp_path / "town.kvm"
    out = run("langchain_kvmemory.py", store)
    check_report(out)
    assert re.search(r"retriever: .* -> ferry\.txt tokens \d+-\d+", out)
    with kvmemory.Memory(store) as mem:                  # the documents stayed, for the next run
        assert sorted(d.doc_id for d in mem.docs()) == sorted(f.name for f in (ROOT / "examples/data").glob("*.txt"))


def test_llamaindex_example(tmp_path):
    check_report(run("llamaindex_kvmemory.py", tmp_path / "town.kvm"), n_reports=2)
