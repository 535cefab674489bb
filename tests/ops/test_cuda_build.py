"""`make cuda-check`: every cuda/*.cu compiles for sm_80 and sm_90 with warnings as errors.
Needs nvcc (CI has it), not a GPU."""

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
def test_cuda_sources_compile_without_warnings(tmp_path):
    r = subprocess.run(["make", "-s", "cuda-check", f"CUDA_BUILD={tmp_path}"], cwd=ROOT, capture_output=True,
                       text=True, timeout=900)
    assert r.returncode == 0, r.stdout + r.stderr
    objs = sorted(p.name for p in tmp_path.glob("*.o"))
    sources = sorted(p.stem for p in (ROOT / "cuda").glob("*.cu"))
    assert objs == sorted(f"{s}.sm_{a}.o" for s in sources for a in (80, 90))
    assert (tmp_path / "libkvmemory_cuda.sm_90.so").is_file()
