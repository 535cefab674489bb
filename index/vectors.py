"""A FAISS inner-product index of block vectors keyed by block row, persisted beside the store.

Exact search (IndexFlatIP): a million-token store is ~4,000 blocks and ~40,000 windows,
which a flat index searches in a few milliseconds (see benchmarks/bench_flat_access.py), so
an approximate index would only cost recall. Past `fp16_threshold` vectors (200,000 windows,
~5M tokens) the index is rebuilt as a flat scan of fp16 codes (IndexScalarQuantizer QT_fp16):
still every vector scored, at half the memory and a fifth of the time (7 vs 34 ms at 197,376
real windows, 38 vs 154 ms at 1M of them tiled, on the 2-core machine of benchmarks/results),
and at 5.2M tokens of real prose its top 64 windows were the exact index's for every question
(benchmarks/bench_select.py, `flat16`). IVF was measured there too and is used only past
`ivf_threshold` (2M windows, ~50M tokens, where even the fp16 scan would take ~75 ms):
questions do not lie near the windows' clusters, so probing half of IVF's lists still missed
6% of the exact top 64 (a quarter of them: 15%). IVF-Flat (nlist = 4 sqrt(n), a quarter of the
lists probed) still supports removal. The file is derived data: written atomically, and rebuilt
from the store when missing or stale.
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
    def __init__(self, dim: int, fp16_threshold: int = 200_000, ivf_threshold: int = 2_000_000) -> None:
        faiss = _faiss()
        self.dim = dim
        self.fp16_threshold = fp16_threshold
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
        if self.kind != "ivf" and self.index.ntotal > self.ivf_threshold:
            self._to_ivf()
        elif self.kind == "flat" and self.index.ntotal > self.fp16_threshold:
            self._to_fp16()

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

    def _stored(self) -> tuple[np.ndarray, np.ndarray]:
        """(ids, vectors) of a flat (fp32 or fp16) index, in the index's order: the forms that are
        ever rebuilt (an IVF index stays IVF)."""
        faiss = _faiss()
        ids = faiss.vector_to_array(self.index.id_map).astype(np.int64)
        inner = faiss.downcast_index(self.index.index)
        return ids, inner.reconstruct_n(0, inner.ntotal)

    def _to_fp16(self) -> None:
        faiss = _faiss()
        ids, vecs = self._stored()
        sq = faiss.IndexScalarQuantizer(self.dim, faiss.ScalarQuantizer.QT_fp16, faiss.METRIC_INNER_PRODUCT)
        self.index = faiss.IndexIDMap2(sq)
        self.index.add_with_ids(vecs, ids)
        self.kind = "flat16"

    def _to_ivf(self) -> None:
        faiss = _faiss()
        ids, vecs = self._stored()
        n = len(ids)
        nlist = int(4 * np.sqrt(n))
        ivf = faiss.IndexIVFFlat(faiss.IndexFlatIP(self.dim), self.dim, nlist, faiss.METRIC_INNER_PRODUCT)
        ivf.train(vecs)
        # a quarter of the lists: recall@k, not recall@1, decides what ask grafts, and with few
        # probes IVF loses most of the top 8 (benchmarks/bench_select.py measures it)
        ivf.nprobe = max(32, nlist // 4)
        self.index = faiss.IndexIDMap2(ivf)
        self.index.add_with_ids(vecs, ids)
        self.kind = "ivf"

    def save(self, path: Path, seal=None) -> None:
        """Written atomically; seal (kvmemory/store/seal.py FileSeal): its bytes sealed by its owner's key."""
        faiss = _faiss()
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        if seal is None:
            faiss.write_index(self.index, str(tmp))
        else:
            data = seal.dump(faiss.serialize_index(self.index).tobytes(), path.name)
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: Path, dim: int, seal=None) -> "VectorIndex":
        faiss = _faiss()
        v = cls(dim)
        if seal is None:
            v.index = faiss.read_index(str(path))
        else:
            raw = seal.load(path.read_bytes(), path.name, str(path))
            v.index = faiss.deserialize_index(np.frombuffer(raw, np.uint8).copy())
        if v.index.d != dim:
            raise ValueError(f"{path} holds vectors of dim {v.index.d}, expected {dim}")
        inner = faiss.downcast_index(v.index.index)
        v.kind = ("ivf" if isinstance(inner, faiss.IndexIVF) else
                  "flat16" if isinstance(inner, faiss.IndexScalarQuantizer) else "flat")
        return v
