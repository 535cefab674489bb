"""benchmarks/common.py: the seed, date, machine, command and result writing every benchmark shares."""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import common  # noqa: E402


def test_every_benchmark_takes_its_seed_and_writes_its_results_through_common():
    for p in sorted((ROOT / "benchmarks").glob("bench_*.py")):
        s = p.read_text()
        assert re.search(r"^from common import", s, re.M), p.name
        assert "json.dumps(" not in s.replace("json.dumps(modes", ""), f"{p.name} writes JSON by hand"
        assert "else random." not in s, f"{p.name} draws its seed by hand"


def test_a_result_is_stamped_with_seed_date_machine_and_command(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["benchmarks/bench_x.py", "--tokens", "7"])
    ap = argparse.ArgumentParser()
    common.add_common_args(ap)
    args = ap.parse_args(["--out", str(tmp_path)])
    seed = common.seed_of(args)
    assert 0 <= seed < 2**31 and f"seed {seed}" in capsys.readouterr().err
    assert common.seed_of(ap.parse_args(["--seed", "5"])) == 5
    path = common.finish({"rows": [1, 2]}, seed, args, "x")
    doc = json.loads(path.read_text())
    assert path == tmp_path / f"x-{common.today()}.json"
    assert doc["seed"] == seed and doc["rows"] == [1, 2] and doc["benchmark"] == "x"
    assert doc["command"] == "python benchmarks/bench_x.py --tokens 7" and doc["machine"]["cores"] >= 1
    other = common.write_json(tmp_path / "y.json", {"seed": 3, "a": 1})
    doc = json.loads(other.read_text())
    assert doc["seed"] == 3 and doc["a"] == 1 and doc["command"].startswith("python") and doc["date"] == common.today()
    png = common.plot(path, lambda fig: fig.subplots().plot([1, 2], [3, 4]))
    assert png is not None and png.stat().st_size > 1000 and png.suffix == ".png"
