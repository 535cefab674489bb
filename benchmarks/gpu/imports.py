"""Import the whole engine (what benchmarks/gpu/run.sh checks first on the GPU machine) and print the
versions."""

from __future__ import annotations

import importlib
import sys

MODULES = ["kvmemory", "kvmemory.cli", "kvmemory.server.app", "kvmemory.chat_memory", "kvmemory.library",
           "kvmemory.index", "kvmemory.store", "kvmemory.keys", "kvmemory.grammar", "kvmemory.model.loader",
           "faiss", "zarr", "bm25s", "Stemmer", "gguf", "cryptography", "llguidance", "fastapi", "uvicorn"]


def main() -> None:
    for m in MODULES:
        importlib.import_module(m)
    import torch
    import transformers

    import kvmemory
    print("python", sys.version.split()[0], "torch", torch.__version__, "transformers", transformers.__version__,
          "kvmemory", kvmemory.__version__, "cuda", torch.cuda.is_available())


if __name__ == "__main__":
    main()
