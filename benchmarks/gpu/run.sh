#!/usr/bin/env bash
# One prepared GPU check (a few minutes): build the kernels, run the gpu-marked tests, and
# benchmark both kernels against ceilings measured in the same run. Results go to $OUT (the
# device tool's output folder) or benchmarks/results/.
#
# Written for a lent device machine that can fetch nothing: it uses that machine's python3
# (with torch, pytest, xxhash, nvcc) and this source tree on PYTHONPATH. The GPU path
# (kvmemory.ops, tests/ops) needs neither zarr nor faiss.  Usage: bash benchmarks/gpu/run.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-benchmarks/results}"
PY="${PYTHON:-python3}"
[ -x .venv/bin/python ] && PY=.venv/bin/python
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export KVMEMORY_CACHE_DIR="${KVMEMORY_CACHE_DIR:-/tmp/kvmemory-cache}"
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu-info.csv"
make -s cuda-check CUDA_BUILD=/tmp/kvmemory-cuda-build 2>&1 | tee "$OUT/cuda-check.txt"
"$PY" - <<'PY' | tee "$OUT/cuda-load.txt"
from kvmemory.ops import cuda_ext
print("kernels loaded:", cuda_ext.load() is not None, cuda_ext.why_not())
PY
"$PY" -m pytest -q -p no:cacheprovider -m gpu tests/ops tests/test_device_gpu.py 2>&1 | tee "$OUT/gpu-tests.txt"
for dt in float32 bfloat16; do
  "$PY" benchmarks/gpu/bench_kernels.py --out "$OUT" --dtype "$dt" 2>&1 | tee "$OUT/bench-kernels-$dt.txt"
done
