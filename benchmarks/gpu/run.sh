#!/usr/bin/env bash
# One prepared GPU check (a few minutes): build the kernels, run the gpu-marked tests, and
# benchmark both kernels against ceilings measured in the same run. Results go to $OUT (the
# device tool's output folder) or benchmarks/results/. Usage: bash benchmarks/gpu/run.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-benchmarks/results}"
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu-info.csv"
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
  # on a GPU machine let pip take torch's CUDA build
  .venv/bin/pip install -q -e '.[test]' --no-deps
  .venv/bin/pip install -q torch transformers==5.23.0 zarr==3.1.6 numpy xxhash platformdirs tqdm safetensors \
    faiss-cpu==1.15.1 pytest
fi
make -s cuda-check CUDA_BUILD=build/cuda 2>&1 | tee "$OUT/cuda-check.txt"
.venv/bin/python -m pytest -q -m gpu tests/ops 2>&1 | tee "$OUT/gpu-tests.txt"
.venv/bin/python benchmarks/gpu/bench_kernels.py --out "$OUT" 2>&1 | tee "$OUT/bench-kernels.txt"
