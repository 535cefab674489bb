"""VectorIndex's three forms: exact fp32 scan, exact fp16 scan past fp16_threshold, IVF past
ivf_threshold (thresholds lowered here so a few thousand vectors cross them)."""

import numpy as np
import pytest

from kvmemory.index import VectorIndex

DIM = 32


def unit(rng, n):
    v = rng.standard_normal((n, DIM)).astype(np.float32)
    return v / np.linalg.norm(v, axis=1, keepdims=True)


def exact_top(vecs, rows, q, k):
    scores = vecs @ q
    order = np.argsort(-scores, kind="stable")[:k]
    return [rows[i] for i in order], scores[order]


def test_past_the_fp16_threshold_the_scan_stays_exact_and_removal_and_files_keep_working(tmp_path):
    rng = np.random.default_rng(7)
    vecs = unit(rng, 1500)
    rows = [int(r) for r in rng.permutation(10**6)[:1500]]          # rows are ids, not positions
    idx = VectorIndex(DIM, fp16_threshold=1000, ivf_threshold=10**9)
    idx.add(rows[:900], vecs[:900])
    assert idx.kind == "flat"
    idx.add(rows[900:], vecs[900:])
    assert idx.kind == "flat16" and len(idx) == 1500 and idx.ids() == set(rows)
    for q in unit(rng, 20):
        want, scores = exact_top(vecs, rows, q, 10)
        got = idx.search(q, 10)
        # fp16 codes round each component by <= 2^-11 relative: the order is the exact one wherever
        # neighbouring scores differ by more than that, and every score is within it
        margin = np.min(np.diff(-scores))
        if margin > 1e-3:
            assert [r for r, _ in got] == want
        assert np.allclose([s for _, s in got], np.sort(vecs @ q)[::-1][:10], atol=2e-3)
    gone = set(rows[:50])
    idx.remove(list(gone))
    assert len(idx) == 1450 and not gone & idx.ids()
    q = vecs[0]                                                  # its own best match, now removed
    assert rows[0] not in [r for r, _ in idx.search(q, 5)]
    idx.save(tmp_path / "v.faiss")
    back = VectorIndex.load(tmp_path / "v.faiss", DIM)
    assert back.kind == "flat16" and back.ids() == idx.ids()
    assert back.search(vecs[77], 5) == idx.search(vecs[77], 5)


def test_past_the_ivf_threshold_probing_every_list_is_the_exact_search(tmp_path):
    rng = np.random.default_rng(8)
    vecs = unit(rng, 3000)
    rows = list(range(5, 3005))
    idx = VectorIndex(DIM, fp16_threshold=1000, ivf_threshold=2000)
    idx.add(rows[:1500], vecs[:1500])
    assert idx.kind == "flat16"
    idx.add(rows[1500:], vecs[1500:])
    assert idx.kind == "ivf" and len(idx) == 3000
    import faiss
    inner = faiss.downcast_index(idx.index.index)
    inner.nprobe = inner.nlist
    for q in unit(rng, 10):
        want, _ = exact_top(vecs, rows, q, 8)
        got = [r for r, _ in idx.search(q, 8)]
        assert len(set(got) & set(want)) >= 7                 # fp16 rounding before IVF may swap a near-tie
    idx.save(tmp_path / "v.faiss")
    assert VectorIndex.load(tmp_path / "v.faiss", DIM).kind == "ivf"


def test_bad_vectors_are_refused_and_change_nothing():
    idx = VectorIndex(DIM)
    idx.add([1, 2], unit(np.random.default_rng(1), 2))
    with pytest.raises(ValueError):
        idx.add([3, 4], np.zeros((2, DIM + 1), np.float32))
    assert idx.ids() == {1, 2}
