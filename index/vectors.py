"""A FAISS inner-product index of block vectors keyed by block row, persisted beside the store.

Exact search (IndexFlatIP): a million-token store is ~4,000 blocks and ~40,000 windows,
which a flat index searches in a few milliseconds (see benchmarks/bench_flat_access.py), so
an approximate index would only cost recall. Past `ivf_threshold` vectors the index is
rebuilt as IVF-Flat (nlist = 4 sqrt(n), a quarter of the lists probed), which still
supports removal. The file is derived
data: written atomically, and rebuilt from the store when missing or stale.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np


def _faiss():
    try:
        import faiss
    except ImportError:  # pragma: no cover - faiss-cpu is a dependency
        from kvmemory.errors import ModelLoadError
        raise ModelLoadError("selection needs FAISS: pip install faiss-cpu") from None
    return faiss


class VectorIndex:
    def __init__(self, dim: int, ivf_threshold: int = 200_000) -> None:
        faiss = _faiss()
        self.dim = dim
        self.ivf_threshold = ivf_threshold
        self.index = faiss.IndexIDMap2(faiss.IndexFlatIP(dim))
        self.kind = "flat"

    def __len__(self) -> int:
        return self.index.ntotal

    def ids(self) -> set[int]:
        faiss = _faiss()
        return set(int(i) for i in faiss.vector_to_array(self.index.id_map)) if self.index.ntotal else set()

    def add(self, rows: list[int], vectors: np.ndarray) -> None:
        if len(rows) == 0:
            return
        vectors = np.ascontiguousarray(vectors, dtype=np.float32)
        if vectors.shape != (len(rows), self.dim):
            raise ValueError(f"vectors {vectors.shape} do not match {len(rows)} rows of dim {self.dim}")
        self.index.add_with_ids(vectors, np.asarray(rows, dtype=np.int64))
        if self.kind == "flat" and self.index.ntotal > self.ivf_threshold:
            self._to_ivf()

    def remove(self, rows) -> None:
        faiss = _faiss()
        if len(rows):
            self.index.remove_ids(faiss.IDSelectorBatch(np.asarray(list(rows), dtype=np.int64)))

    def search(self, query: np.ndarray, k: int) -> list[tuple[int, float]]:
        if self.index.ntotal == 0 or k <= 0:
            return []
        scores, ids = self.index.search(np.ascontiguousarray(query.reshape(1, -1), dtype=np.float32),
                                        min(k, self.index.ntotal))
        return [(int(i), float(s)) for i, s in zip(ids[0], scores[0]) if i >= 0]

    def _to_ivf(self) -> None:
        faiss = _faiss()
        n = self.index.ntotal
        ids = faiss.vector_to_array(self.index.id_map).astype(np.int64)
        vecs = np.stack([self.index.reconstruct(int(i)) for i in ids])
        nlist = int(4 * np.sqrt(n))
        ivf = faiss.IndexIVFFlat(faiss.IndexFlatIP(self.dim), self.dim, nlist, faiss.METRIC_INNER_PRODUCT)
        ivf.train(vecs)
        # a quarter of the lists: recall@k, not recall@1, decides what ask grafts, and with few
        # probes IVF loses most of the top 8 (benchmarks/bench_select.py measures it)
        ivf.nprobe = max(32, nlist // 4)
        self.index = faiss.IndexIDMap2(ivf)
        self.index.add_with_ids(vecs, ids)
        self.kind = "ivf"

    def save(self, path: Path) -> None:
        faiss = _faiss()
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        faiss.write_index(self.index, str(tmp))
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: Path, dim: int) -> "VectorIndex":
        faiss = _faiss()
        v = cls(dim)
        v.index = faiss.read_index(str(path))
        if v.index.d != dim:
            raise ValueError(f"{path} holds vectors of dim {v.index.d}, expected {dim}")
        v.kind = "ivf" if "IVF" in type(faiss.downcast_index(v.index.index)).__name__ else "flat"
        return v
