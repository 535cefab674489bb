"""BM25 over the same windows as the dense index, persisted beside it.

What is persisted is the tokenized corpus: window ids and their terms, one JSON file written
atomically (the base), and beside it an append-only log of the changes since (`<base>.log`, one
JSON line a write, fsynced), so a write costs its own terms, not the whole corpus; the base is
written anew (and the log dropped) when the log grows past a quarter of it. A torn last line (a
crash mid-append) is skipped: the rows it held are missing from the index, which the store's check
on load finds and rebuilds (derived data).

In memory it is an inverted index (term -> {window id: term frequency}) that add and remove update
in place, so a remembered chat turn costs its own terms and the next search rebuilds nothing (a
bm25s rebuild after every write cost that search 40 ms at 3,000 windows and 0.54 s at 30,000, the
windows of ~1M tokens of one user's chat history: benchmarks/bench_lexical.py).

The scores are bm25s' (method "lucene", k1 = 1.5, b = 0.75, a query's repeated terms counted
again), computed at query time from the current N, document frequencies and mean length:
tests/index/test_lexical.py holds them to bm25s on random corpora, after adds and removes.
"""

from __future__ import annotations

import base64
import functools
import json
import os
import re
from collections import Counter
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


@functools.cache
def _content_stop() -> frozenset[str]:
    from bm25s.stopwords import STOPWORDS_EN_PLUS
    return frozenset(STOPWORDS_EN_PLUS) | _stopwords()


def content_terms(text: str) -> set[str]:
    """The terms that say what a text is about: terms() minus NLTK's longer English stopword list
    (bm25s' STOPWORDS_EN_PLUS: "what", "my", "which" go too; BM25 keeps them, weighed by rarity)."""
    return set(terms(text, _content_stop()))


def content_words(text: str) -> str:
    """The words of a text outside that longer list, as they were written (a BM25 query of them scores
    what the text is about alone: "What is my job?" -> "job")."""
    stop = _content_stop()
    return " ".join(w for w in _WORD.findall(text.lower()) if w not in stop)


K1, B = 1.5, 0.75                # bm25s' defaults


class LexicalIndex:
    def __init__(self) -> None:
        self._docs: dict[int, list[str]] = {}            # window id -> its terms (what is persisted)
        self._post: dict[str, dict[int, int]] = {}       # term -> {window id: term frequency}
        self._arrays: dict[str, tuple[np.ndarray, ...]] = {}   # term -> (ids, tf, length): built on demand
        self._total = 0                                   # sum of window lengths (an empty window counts 1)
        self._stop = _stopwords()

    def __len__(self) -> int:
        return len(self._docs)

    def ids(self) -> set[int]:
        return set(self._docs)

    def add(self, ids: list[int], texts: list[str]) -> None:
        if len(ids) != len(texts):
            raise ValueError(f"{len(ids)} ids for {len(texts)} texts")
        for i, t in zip(ids, texts):
            self._put(int(i), terms(t, self._stop))

    def remove(self, ids) -> None:
        for i in ids:
            self._drop(int(i))

    def _put(self, i: int, toks: list[str]) -> None:
        if i in self._docs:
            self._drop(i)
        self._docs[i] = toks
        self._total += len(toks) or 1                     # bm25s indexes an empty window as one empty token
        for term, tf in Counter(toks).items():
            self._post.setdefault(term, {})[i] = tf
            self._arrays.pop(term, None)

    def _drop(self, i: int) -> None:
        toks = self._docs.pop(i, None)
        if toks is None:
            return
        self._total -= len(toks) or 1
        for term in set(toks):
            post = self._post[term]
            del post[i]
            if not post:
                del self._post[term]
            self._arrays.pop(term, None)

    def _postings(self, term: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(window ids, term frequencies, window lengths) of a term, sorted by id."""
        got = self._arrays.get(term)
        if got is None:
            post = self._post[term]
            ids = np.fromiter(post, dtype=np.int64, count=len(post))
            order = np.argsort(ids)
            ids = ids[order]
            tf = np.fromiter(post.values(), dtype=np.float64, count=len(post))[order]
            ln = np.array([len(self._docs[int(i)]) or 1 for i in ids], dtype=np.float64)
            got = self._arrays[term] = (ids, tf, ln)
        return got

    def scores(self, query: str, need=None) -> tuple[np.ndarray, np.ndarray]:
        """(window ids, BM25 scores) of the windows holding a term of the query, ids ascending; need (terms,
        as terms() gives them): only the windows holding one of them."""
        q = [t for t in terms(query, self._stop) if t in self._post]
        if not q or not self._docs:
            return np.zeros(0, np.int64), np.zeros(0, np.float64)
        n, avg = len(self._docs), self._total / len(self._docs)
        posts = [self._postings(t) for t in q]
        cand = np.unique(np.concatenate([p[0] for p in posts]))
        acc = np.zeros(len(cand), np.float64)
        for ids, tf, ln in posts:                        # query order, a repeated term again (as bm25s)
            df = len(ids)
            idf = np.log(1.0 + (n - df + 0.5) / (df + 0.5))
            acc[np.searchsorted(cand, ids)] += idf * tf / (K1 * ((1.0 - B) + B * ln / avg) + tf)
        if need is not None:
            held = [self._postings(t)[0] for t in need if t in self._post]
            keep = np.isin(cand, np.concatenate(held)) if held else np.zeros(len(cand), bool)
            cand, acc = cand[keep], acc[keep]
        return cand, acc

    def search(self, query: str, k: int, need=None) -> list[tuple[int, float]]:
        """Top k (window id, BM25 score) with a positive score, best first (equal scores: lower id first);
        need: of the windows holding one of those terms (scores())."""
        if k <= 0:
            return []
        ids, sc = self.scores(query, need)
        keep = sc > 0
        ids, sc = ids[keep], sc[keep]
        if not len(ids):
            return []
        k = min(k, len(ids))
        top = np.argpartition(-sc, k - 1)[:k]
        top = top[np.lexsort((ids[top], -sc[top]))]       # by score, then id: deterministic
        return [(int(ids[i]), float(sc[i])) for i in top]

    def save(self, path: Path, seal=None) -> None:
        """The whole corpus as the base, written atomically; then the log is dropped (the base holds it).
        seal (kvmemory/store/seal.py FileSeal): the file's bytes sealed by its owner's key."""
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        data = json.dumps({"version": VERSION, "docs": {str(i): t for i, t in self._docs.items()}}).encode()
        if seal is not None:
            data = seal.dump(data, path.name)
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        log_path(path).unlink(missing_ok=True)

    def append(self, path: Path, added, removed, seal=None) -> None:
        """Record a change (window ids removed, then added with their terms as held now) in the log
        beside the base at `path`: one JSON line (sealed: one base64 line), fsynced. The caller holds
        the writer lock."""
        rec = {"rm": [int(i) for i in removed], "add": {str(int(i)): self._docs[int(i)] for i in added
                                                         if int(i) in self._docs}}
        log = log_path(path)
        line = json.dumps(rec, separators=(",", ":")).encode()
        if seal is not None:
            line = base64.b64encode(seal.dump(line, log.name))
        with open(log, "a+b") as f:
            f.seek(0, os.SEEK_END)
            if f.tell():
                f.seek(-1, os.SEEK_END)
                torn = f.read(1) != b"\n"                 # a crash mid-append: end that line first
            else:
                torn = False
            f.write((b"\n" if torn else b"") + line + b"\n")
            f.flush()
            os.fsync(f.fileno())

    @classmethod
    def load(cls, path: Path, seal=None) -> "LexicalIndex":
        from kvmemory.errors import StoreCorruptError
        raw = path.read_bytes()
        if seal is not None:
            raw = seal.load(raw, path.name, str(path))
        data = json.loads(raw)
        if data.get("version") != VERSION:
            raise ValueError(f"{path}: unknown lexical index version {data.get('version')!r}")
        out = cls()
        for i, t in data["docs"].items():
            out._put(int(i), list(t))
        try:
            with open(log_path(path), "rb") as f:
                lines = f.read().split(b"\n")
        except FileNotFoundError:
            lines = []
        for line in lines[:-1]:                        # the last piece has no newline: torn or empty
            try:
                if seal is not None:
                    line = seal.load(base64.b64decode(line, validate=True), log_path(path).name, str(path))
                rec = json.loads(line)
                gone, new = [int(i) for i in rec["rm"]], {int(i): list(t) for i, t in rec["add"].items()}
            except (ValueError, KeyError, TypeError, AttributeError, StoreCorruptError):
                continue                               # a torn record: its rows are found missing and rebuilt
            for i in gone:
                out._drop(i)
            for i, t in new.items():
                out._put(i, t)
        return out


def log_path(path: Path) -> Path:
    """The append-only log of changes beside a lexical index's base file."""
    return path.with_name(path.name + ".log")
