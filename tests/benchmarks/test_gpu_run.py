"""The prepared GPU run (benchmarks/gpu/): its dry run on the CPU, so the script cannot rot between GPU
slots, and the wheels it carries: every distribution the engine needs is on the GPU machine already or
among the wheels, at the versions tested here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]
GPU = ROOT / "benchmarks" / "gpu"
sys.path.insert(0, str(GPU))
from prepare import norm, pins  # noqa: E402
# the GPU machine's Python
DEVICE_ENV = {"python_version": "3.12", "python_full_version": "3.12.3", "platform_python_implementation": "CPython",
              "implementation_name": "cpython", "sys_platform": "linux", "platform_system": "Linux",
              "platform_machine": "x86_64", "os_name": "posix", "extra": ""}


def test_the_dry_run_measures_every_section(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path / "out")}
    env.pop("KVMEMORY_TEST_TOKENIZER", None)
    p = subprocess.run(["bash", str(GPU / "run.sh"), "--dry-run"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=600)
    log = (tmp_path / "out" / "run.log").read_text()
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "== import: ok" in log and "== engine: ok" in log and "failed: none" in log
    res = json.loads((tmp_path / "out" / "engine.json").read_text())
    assert res["dry"] and res["errors"] == {}, res["errors"]
    assert (tmp_path / "out" / "engine.png").stat().st_size > 10_000
    fams = {g["family"]: g for g in res["geometry"]}
    assert set(fams) == {"llama-3.1-8b", "gemma-3-12b"}
    for g in fams.values():
        assert g["sizes"], g
        for r in g["sizes"]:
            assert r["prefill_tok_s"] > 0 and r["restore_GBps"] > 0 and r["raw_read_GBps"] > 0 and r["h2d_GBps"] > 0
            assert r["disk_bytes"] >= r["kv_bytes"] > 0
        assert g["e3_states"] >= 3 and g["e3_exact"] == g["e3_states"]          # E3 held on every state
    ops = {r["op"] for r in res["kernels"]}
    assert {"index_select (no rotation)", "gather, half shifted", "window_attention (paged)"} <= ops
    assert res["pager"]["rows"] and all(r["ask_ms_cold_median"] > 0 and r["ask_ms_warm_median"] > 0
                                        for r in res["pager"]["rows"])
    # the warm pass found its blocks in the tiers
    assert sum(r["tiers_warm_pass"]["host"]["hits"] for r in res["pager"]["rows"]) > 0
    settings = res["serve"]["settings"]
    assert [s["setting"] for s in settings] == ["batch 1", "batch 2"]
    for s in settings:
        assert [r["clients"] for r in s["rows"]] == [1, 2]
        assert all(r["requests_per_s"] > 0 and r["errors"] == 0 for r in s["rows"])


def test_the_wheels_are_the_versions_tested_here():
    wheels = pins()
    constraints = pins(ROOT / "constraints.txt")
    for name, version in wheels.items():
        if name in constraints:
            assert constraints[name] == version, name
        try:
            have = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
        assert have == version, f"{name}: wheels.txt pins {version}, the tests here ran on {have}"


def test_every_distribution_the_engine_needs_is_on_the_gpu_machine_or_carried():
    """The requirement closure of kvmemory's base install (markers of the GPU machine's Python), walked
    through the carried wheels; a distribution the machine has already ends the walk."""
    device = {norm(line.strip()) for line in (GPU / "device-packages.txt").read_text().splitlines()
              if line.strip() and not line.startswith("#")}
    wheels = pins()
    missing, seen, todo = set(), set(), ["kvmemory"]
    while todo:
        dist = todo.pop()
        for spec in metadata.requires(dist) or []:
            req = Requirement(spec)
            if req.marker is not None and not req.marker.evaluate(DEVICE_ENV):
                continue
            name = norm(req.name)
            if name in seen:
                continue
            seen.add(name)
            if name in device:
                continue
            if name not in wheels:
                missing.add(f"{name} (needed by {dist})")
                continue
            todo.append(name)
    assert not missing, sorted(missing)
    unused = set(wheels) - seen
    assert not unused, f"wheels nothing needs: {sorted(unused)}"


def test_the_engine_imports_on_this_machine():
    p = subprocess.run([sys.executable, str(GPU / "imports.py")], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.startswith("python ") and "kvmemory" in p.stdout


def test_the_minilm_stand_in_is_a_package_the_embedder_loads(tmp_path):
    """What run.sh puts on PYTHONPATH for the tests on the GPU machine (no MiniLM weights there)."""
    from kvmemory.index.embedder import model_dir
    p = subprocess.run([sys.executable, str(GPU / "bench_engine.py"), "--make-minilm", str(tmp_path),
                        "--minilm", str(model_dir())], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    site = Path(p.stdout.strip().splitlines()[-1])
    code = ("import kvmemory.index.embedder as e; v = e.TextEmbedder().embed(['the vault code']); "
            "print(e.model_dir(), v.shape)")
    q = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(ROOT)])})
    assert q.returncode == 0, q.stderr[-2000:]
    assert str(site) in q.stdout and "(1, 384)" in q.stdout
