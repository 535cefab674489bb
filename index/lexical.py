"""BM25 over the same windows as the dense index, with bm25s, persisted beside it.

What is persisted is the tokenized corpus (window ids and their terms, one JSON file,
written atomically); the bm25s index is built from it when loaded. Building is a sparse
matrix over the corpus (~0.1 s for the 20,000 windows of a million-token store), so
add and remove simply rebuild it: the scorer is bm25s', never a hand-written one.
"""

from __future__ import annotations

import functools
import json
import os
import re
from pathlib import Path

import numpy as np

_WORD = re.compile(r"[0-9a-z]+")
VERSION = 2                      # 2: stemmed terms


def _stopwords() -> frozenset[str]:
    from bm25s.stopwords import STOPWORDS_EN
    return frozenset(STOPWORDS_EN)


@functools.cache
def _stemmer():
    import Stemmer                       # PyStemmer: Snowball's English stemmer, as bm25s recommends
    return Stemmer.Stemmer("english")


def terms(text: str, stop: frozenset[str] | None = None) -> list[str]:
    """Lower-cased alphanumeric runs minus English stopwords (numbers are kept: they are often the
    point), stemmed ("moved" and "move" are one term)."""
    stop = _stopwords() if stop is None else stop
    return _stemmer().stemWords([w for w in _WORD.findall(text.lower()) if w not in stop])


class LexicalIndex:
    def __init__(self) -> None:
        self._docs: dict[int, list[str]] = {}
        self._bm25 = None
        self._ids: np.ndarray | None = None
        self._stop = _stopwords()

    def __len__(self) -> int:
        return len(self._docs)

    def ids(self) -> set[int]:
        return set(self._docs)

    def add(self, ids: list[int], texts: list[str]) -> None:
        if len(ids) != len(texts):
            raise ValueError(f"{len(ids)} ids for {len(texts)} texts")
        for i, t in zip(ids, texts):
            self._docs[int(i)] = terms(t, self._stop)
        self._bm25 = None

    def remove(self, ids) -> None:
        for i in ids:
            self._docs.pop(int(i), None)
        self._bm25 = None

    def _built(self):
        if self._bm25 is None and self._docs:
            import bm25s
            self._ids = np.fromiter(self._docs, dtype=np.int64, count=len(self._docs))
            # bm25s needs at least one term a document; an empty window gets the empty token
            corpus = [self._docs[int(i)] or [""] for i in self._ids]
            self._bm25 = bm25s.BM25()
            self._bm25.index(corpus, show_progress=False)
        return self._bm25

    def search(self, query: str, k: int) -> list[tuple[int, float]]:
        """Top k (window id, BM25 score) with a positive score, best first."""
        q = [t for t in terms(query, self._stop)]
        bm = self._built()
        if bm is None or k <= 0:
            return []
        q = [t for t in q if t in bm.vocab_dict]
        if not q:
            return []
        scores = bm.get_scores(q)                                    # [n_docs]
        k = min(k, len(scores))
        top = np.argpartition(-scores, k - 1)[:k]
        top = top[np.lexsort((self._ids[top], -scores[top]))]        # by score, then id: deterministic
        return [(int(self._ids[i]), float(scores[i])) for i in top if scores[i] > 0]

    def save(self, path: Path) -> None:
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump({"version": VERSION, "docs": {str(i): t for i, t in self._docs.items()}}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: Path) -> "LexicalIndex":
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        if data.get("version") != VERSION:
            raise ValueError(f"{path}: unknown lexical index version {data.get('version')!r}")
        out = cls()
        out._docs = {int(i): list(t) for i, t in data["docs"].items()}
        return out
