"""Documents: deposit long text as segments behind a fixed prelude, index every block, remove.

A document is cut into segments of `segment_blocks` blocks. Each segment is computed behind
the same prelude (so every segment is conditioned the same way), block by block, exactly as
a state is: it is the chain prelude + segment, content-addressed. Segments stream: only one
segment's KV is in memory at a time. Each segment's blocks are committed as they are done;
the document itself (its entry in the manifest, which makes it visible) is committed last,
after its vectors are in the index. An interrupted `add` therefore leaves no half-document
visible, and running it again resumes: the blocks already stored are found by id and not
recomputed.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import xxhash

from kvmemory import hashing, kv as kvops
from kvmemory.errors import DocumentNotFoundError, InputError, StoreCorruptError, StoreError
from kvmemory.index import INDEXES, VectorIndex
from kvmemory.index import windows as win
from kvmemory.index.lexical import LexicalIndex, log_path
from kvmemory.index import keys as keysel
from kvmemory.store import Change
from kvmemory.store.manifest import DocEntry
from kvmemory.store.seal import FileSeal
from kvmemory.prelude import USER_DOCS, Prelude, PromptLayout, Scope
from kvmemory.runtime import Runtime
from kvmemory.states import state_id_of
from kvmemory.text import check_doc_id, decode_text, read_files, text_ids, valid_id

__all__ = ["SEGMENT_BLOCKS", "USER_DOCS", "DocInfo", "Documents", "Prelude", "PromptLayout", "Scope",
           "Scopes", "check_doc_id", "decode_text", "read_files", "text_ids", "valid_id"]

SEGMENT_BLOCKS = 4     # 1,024-token segments: measured against 1 and 8 in benchmarks/bench_qa.py
# derived data; the names carry the layout, so an index of an older layout is rebuilt, not misread
INDEX_FILES = {"dense": "dense-w2.faiss", "bm25": "bm25-w3.json", "keys": "keys-w1.faiss"}
LOG_MIN_BYTES = 1 << 16                  # the lexical index's log may grow to this, or a quarter of its base


@dataclass(frozen=True)
class DocInfo:
    doc_id: str
    n_tokens: int
    blocks: int
    segments: int
    source: str
    created: float


class Documents:
    """Deposit, index, select and remove documents of one Memory."""

    def __init__(self, rt: Runtime, segment_blocks: int = SEGMENT_BLOCKS, key_layer: int | None = None,
                 scope: Scope = Scope(), embedder=None) -> None:
        self.rt = rt
        self.segment_blocks = segment_blocks
        self.scope = scope
        self.prelude = Prelude(rt.tokenizer, scope.layout, scope.head)
        geo = rt.geometry
        self.key_layer = keysel.default_layer(geo.layers) if key_layer is None else key_layer
        self.freqs = rt.freqs
        self.dims = {"dense": 384, "keys": geo.kv_heads * geo.head_dim}
        self._embedder = embedder                   # shared between scopes: one MiniLM per process
        self._indexes: dict = {}                    # kind -> VectorIndex | LexicalIndex
        self._prelude = None
        self._checked: dict[str, int] = {}          # index kind -> manifest commit it was validated at
        self._live: tuple[int, dict] = (-1, {})
        self._file_ident: dict[str, tuple] = {}    # index kind -> (inode, mtime, size) of the file we hold

    # ------------------------------------------------------------------ indexes
    @property
    def embedder(self):
        if self._embedder is None:
            from kvmemory.index.embedder import TextEmbedder
            self._embedder = TextEmbedder()
        return self._embedder

    def index(self, kind: str):
        """An index ("dense", "bm25" or "keys"), loaded from disk, rebuilt from the store if stale.

        dense and bm25 hold one entry per window (index/windows.py), keys one per block."""
        if kind not in INDEXES:
            raise InputError(f"index must be one of {INDEXES}, got {kind!r}")
        commit = self.rt.store().manifest.commit
        idx = self._indexes.get(kind)
        if idx is not None and self._checked.get(kind) == commit:
            return idx                       # validated at this commit: nothing changed since
        live = self.live_rows()
        if idx is None or self._file_ident.get(kind) != self._ident(kind):
            idx = self._load_index(kind)     # another process may have written it since
        rows = {win.row_of(i) for i in idx.ids()} if idx is not None else set()
        if idx is None or not live <= rows:
            self.rebuild("keys" if kind == "keys" else "text")
            idx = self._indexes[kind]
        elif rows - live and not self.rt.store().read_only:
            # entries of removed documents a crash left behind (their text is in the index files)
            idx.remove([i for i in idx.ids() if win.row_of(i) not in live])
            self._save_index(kind, idx)
        self._indexes[kind] = idx
        self._checked[kind] = commit
        return idx

    def _load_index(self, kind: str):
        path = self._index_path(kind)
        ident = self._ident(kind)            # before reading: a change after it is seen next time
        if ident[0] is None:
            return None
        seal = self._seal()
        try:
            idx = LexicalIndex.load(path, seal) if kind == "bm25" else VectorIndex.load(path, self.dims[kind], seal)
        except (RuntimeError, ValueError, OSError, KeyError, StoreCorruptError):
            return None                      # derived data: damaged means rebuild
        self._file_ident[kind] = ident
        return idx

    def _seal(self) -> FileSeal | None:
        """How this scope's index files are sealed: by its owner's key in an encrypted store."""
        sealer = self.rt.store().sealer
        return None if sealer is None else FileSeal(sealer, self.scope.owner)

    def _index_path(self, kind: str) -> Path:
        return self.rt.path / self.scope.index_dir / INDEX_FILES[kind]

    def _ident(self, kind: str) -> tuple:
        """What on disk an index is: its file's (inode, mtime, size), and its log's for bm25."""
        path = self._index_path(kind)
        return _ident(path), (_ident(log_path(path)) if kind == "bm25" else None)

    def live_map(self) -> dict[int, tuple[str, int, int]]:
        """Row -> (doc id, deposit rank, index of the block in the document) of every block of a
        visible document; rebuilt per commit. A block shared by two documents maps to the first."""
        m = self.rt.store().manifest
        if self._live[0] != m.commit:
            live: dict[int, tuple[str, int, int]] = {}
            for rank, (doc_id, d) in enumerate(m.docs.items()):
                if not self.scope.owns(doc_id):
                    continue
                for i, r in enumerate(d.rows):
                    live.setdefault(r, (doc_id, rank, i))
            self._live = (m.commit, live)
        return self._live[1]

    def live_rows(self) -> set[int]:
        return set(self.live_map())

    def windows(self, rows: list[int], leads: list[int | None]) -> tuple[list[int], list[list[int]]]:
        """The embedding windows of content blocks: (window ids, word pieces of each window).

        leads[i] is the block before rows[i] in its document (None for a document's first
        block): its last LEAD_PIECES word pieces open the block's first window."""
        store, tok, emb = self.rt.store(), self.rt.tokenizer, self.embedder
        want = sorted({r for r in rows} | {r for r in leads if r is not None})
        meta = store.block_meta(want)
        text = {r: tok.decode([int(t) for t in meta["tokens"][i][:meta["n_tokens"][i]]]) for i, r in enumerate(want)}
        per_block = win.block_windows(lambda t: emb.pieces(t)[0], [text[r] for r in rows],
                                      [text[lead] if lead is not None else None for lead in leads])
        wids, pieces = [], []
        for r, ws in zip(rows, per_block):
            wids += [win.window_id(r, w) for w in range(len(ws))]
            pieces += ws
        return wids, pieces

    def entries(self, kind: str, rows: list[int], leads: list[int | None] | None = None,
                kv: list[torch.Tensor] | None = None):
        """Index entries of content blocks. "text": (window ids, vectors [n, 384], window texts);
        "keys": (ids, vectors [n, H*D], None) with kv (each [L, 2, H, n, D]) read from the store when None."""
        store = self.rt.store()
        if kind == "text":
            wids, pieces = self.windows(rows, leads if leads is not None else [None] * len(rows))
            tok = self.embedder.tokenizer
            # one block's windows per call: the vectors are then bit-identical on rebuild
            by_row: dict[int, list[int]] = {}
            for i, w in enumerate(wids):
                by_row.setdefault(win.row_of(w), []).append(i)
            vecs = np.zeros((len(wids), self.dims["dense"]), np.float32)
            for idx in by_row.values():
                vecs[idx] = self.embedder.embed_pieces([pieces[i] for i in idx])
            return wids, vecs, [tok.decode(p) for p in pieces]
        meta = store.block_meta(rows)
        if kv is None:
            blocks, _ = store.read_kv(rows)
            kv = [kvops.from_storage(blocks[i], self.rt.kv_dtype)[:, :, :, :int(meta["n_tokens"][i])]
                  for i in range(len(rows))]
        out = [keysel.block_vectors(kv[i], list(meta["positions"][i][:int(meta["n_tokens"][i])]), self.key_layer,
                                    self.freqs) for i in range(len(rows))]
        vecs = np.stack(out) if out else np.zeros((0, self.dims["keys"]), np.float32)
        return [win.window_id(r, 0) for r in rows], vecs, None

    def rebuild(self, what: str, progress=None) -> None:
        """Recompute the entries of every live block from the store and write the index(es) of
        `what`: "text" (dense + bm25, the same windows) or "keys"."""
        m = self.rt.store().manifest
        seen: set[int] = set()
        todo: list[tuple[int, int | None]] = []            # (row, lead row), documents in order
        for d in (d for k, d in m.docs.items() if self.scope.owns(k)):
            for i, r in enumerate(d.rows):
                if r not in seen:
                    seen.add(r)
                    todo.append((r, d.rows[i - 1] if i else None))
        if what == "keys":
            idx = VectorIndex(self.dims["keys"])
            for i in range(0, len(todo), 64):
                part = [r for r, _ in todo[i:i + 64]]
                wids, vecs, _ = self.entries("keys", part)
                idx.add(wids, vecs)
                if progress is not None:
                    progress.update(len(part))
            self._save_index("keys", idx)
            return
        dense, lex = VectorIndex(self.dims["dense"]), LexicalIndex()
        for i in range(0, len(todo), 64):
            pairs = todo[i:i + 64]
            wids, vecs, texts = self.entries("text", [r for r, _ in pairs], [lead for _, lead in pairs])
            dense.add(wids, vecs)
            lex.add(wids, texts)
            if progress is not None:
                progress.update(len(pairs))
        self._save_index("dense", dense)
        self._save_index("bm25", lex)

    def _save_index(self, kind: str, idx) -> None:
        """Keep idx and write it, under the writer lock (a writable store only)."""
        self._indexes[kind] = idx
        self._checked.pop(kind, None)
        store = self.rt.store()
        if store.read_only:
            return                           # rebuilt in memory; a writable open will persist it
        path = self._index_path(kind)
        with store.write_lock():
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                idx.save(path, self._seal())
            except (OSError, RuntimeError) as e:   # faiss reports a full disk as RuntimeError
                for tmp in path.parent.glob(f".{path.name}.*.tmp"):
                    tmp.unlink(missing_ok=True)
                raise StoreError(f"cannot write the index {path}: {e}") from None
            self._file_ident[kind] = self._ident(kind)

    def _append_index(self, kind: str, idx, added, removed) -> bool:
        """Keep idx and record its change in the lexical index's log instead of writing it whole, where
        the file on disk is the one held here and the log is still small. Returns whether it did."""
        path = self._index_path(kind)
        store = self.rt.store()
        held = self._file_ident.get(kind)
        if kind != "bm25" or store.read_only or held is None or held != self._ident(kind) or held[0] is None:
            return False
        log = held[1][2] if held[1] is not None else 0
        if log > max(LOG_MIN_BYTES, held[0][2] // 4):
            return False                     # past a quarter of the base: write it whole, drop the log
        with store.write_lock():
            try:
                idx.append(path, added, removed, self._seal())
            except OSError as e:
                raise StoreError(f"cannot write the index log {log_path(path)}: {e}") from None
            self._file_ident[kind] = self._ident(kind)
        self._indexes[kind] = idx
        self._checked.pop(kind, None)
        return True

    def _update_indexes(self, found: dict | None = None, drop: set[int] | None = None) -> None:
        """Under the writer lock: take each index as it is on disk now (another process may have
        added to it), add `found` / drop rows `drop`, write it back. No rebuild."""
        for kind in INDEXES:
            idx = self._indexes.get(kind)
            if idx is None or self._file_ident.get(kind) != self._ident(kind):
                loaded = self._load_index(kind)
                idx = loaded if loaded is not None else idx
            if idx is None:
                idx = LexicalIndex() if kind == "bm25" else VectorIndex(self.dims[kind])
            gone = [i for i in idx.ids() if win.row_of(i) in drop] if drop else []
            idx.remove(gone)
            added = []
            if found and found["wids"]:
                if kind == "dense":
                    idx.add(found["wids"], np.concatenate(found["vecs"]))
                elif kind == "bm25":
                    idx.add(found["wids"], found["texts"])
                    added = found["wids"]
                else:
                    idx.add(found["kwids"], np.concatenate(found["kvecs"]))
            if not self._append_index(kind, idx, added, gone):
                self._save_index(kind, idx)

    # ------------------------------------------------------------------ deposit
    def _prelude_last(self) -> bytes:
        """The id of the prelude's last block. A scope with an owner has the owner's own prelude (a salted chain)."""
        owner = self.scope.owner
        root = hashing.ROOT_PARENT if owner is None else self.rt.store().owner_root(owner)
        return hashing.chain_ids(self.rt.fingerprint, self.prelude.ids, self.rt.block_tokens, parent=root)[-1]

    def prelude_row(self) -> int | None:
        """The row of the stored prelude's last block; None where it is not stored (nothing is saved here)."""
        return self.rt.store().row_of(self._prelude_last())

    def prelude_state(self):
        """The prelude as a stored state (saved on first use, then read back verified) and the row of
        its last block. A scope with an owner has the owner's own prelude (a salted chain)."""
        rt, owner, last = self.rt, self.scope.owner, self._prelude_last()
        sid = state_id_of(last, owner)
        if self._prelude is None or self._prelude.id != sid:
            rt.store().refresh()
            if sid in rt.store().manifest.states:
                self._prelude = rt.load(sid)
            else:
                self._prelude = rt.save(self.prelude.ids, label=self.scope.label, owner=owner)
        return self._prelude, rt.store().row_of(last)

    def prelude_kv(self) -> torch.Tensor:
        """[L, 2, H, p, D] KV of the prelude."""
        return self.prelude_state()[0].kv

    def add(self, text, doc_id: str | None = None, source: str = "", progress=None, *,
            ids: list[int] | None = None) -> DocInfo:
        """Deposit `text` (str or UTF-8 bytes), or with `ids` those token ids as they are (chat memory's
        turns as chat messages: the template's control tokens around words tokenized as text)."""
        rt = self.rt
        store = rt.store()
        if ids is None:
            ids = text_ids(rt.tokenizer, decode_text(text, source))
        elif not ids or not all(isinstance(t, int) and 0 <= t < len(rt.tokenizer) for t in ids):
            raise InputError("ids must be a non-empty list of the tokenizer's token ids")
        if progress is not None:
            progress.total = len(ids)
            progress.refresh()
        doc_id = doc_id or self.scope.prefix + xxhash.xxh3_64_hexdigest(np.asarray(ids, np.int32).tobytes())
        check_doc_id(doc_id)
        if not self.scope.owns(doc_id):
            raise InputError(f"document id {doc_id!r} belongs to another namespace (ids starting with {USER_DOCS!r} "
                             "are chat memory's)")
        store.refresh()
        if doc_id in store.manifest.docs:
            raise InputError(f"document {doc_id!r} already exists; remove it first (kvmemory rm)")
        p = self.prelude_state()[0].n_tokens
        C = store.manifest.block_tokens
        seg_len = self.segment_blocks * C
        if p + seg_len > rt.geometry.max_positions:
            raise InputError(f"segments of {seg_len} tokens behind a {p}-token prelude exceed the model's window")
        rows: list[int] = []
        indexed = {win.row_of(i) for i in self.index("dense").ids()} & {win.row_of(i) for i in self.index("keys").ids()}
        found: dict[str, list] = {"wids": [], "vecs": [], "texts": [], "kwids": [], "kvecs": []}
        for s0 in range(0, len(ids), seg_len):
            seg = ids[s0:s0 + seg_len]
            seg_rows, kv = self.compute_segment(seg)   # resume (or other workers) may have stored it
            leads = [rows[-1] if rows else None] + seg_rows[:-1]
            new = [i for i, r in enumerate(seg_rows) if r not in indexed]   # a shared block is indexed once
            if new:
                wids, vecs, texts = self.entries("text", [seg_rows[i] for i in new], [leads[i] for i in new])
                found["wids"] += wids
                found["vecs"].append(vecs)
                found["texts"] += texts
                kw, kvecs, _ = self.entries("keys", [seg_rows[i] for i in new],
                                            kv=None if kv is None else [kv[i] for i in new])
                found["kwids"] += kw
                found["kvecs"].append(kvecs)
                indexed.update(seg_rows[i] for i in new)
            rows += seg_rows
            if progress is not None:
                progress.update(len(seg))
            rt.make_way()
        # index entries first (entries of invisible rows are ignored at query time), the manifest
        # entry last: the commit
        entry = DocEntry(rows=rows, n_tokens=len(ids), segments=-(-len(ids) // seg_len), source=source,
                         created=time.time())

        def build(s):
            if doc_id in s.manifest.docs:
                raise InputError(f"document {doc_id!r} was added by another writer meanwhile")
            # under the writer lock: the vectors go into the index as it is on disk now, then the
            # document's entry is committed (a visible document is always indexed)
            self._update_indexes(found=found)
            return Change(docs={doc_id: entry})
        store.commit(build)
        return DocInfo(doc_id, entry.n_tokens, len(rows), entry.segments, source, entry.created)

    def segments(self, ids: list[int]) -> list[list[int]]:
        """A document's token ids cut into deposit segments."""
        seg_len = self.segment_blocks * self.rt.block_tokens
        return [ids[s0:s0 + seg_len] for s0 in range(0, len(ids), seg_len)]

    def compute_segment(self, seg: list[int], before_commit=None) -> tuple[list[int], list | None]:
        """Store one deposit segment's blocks (computed behind the prelude at its positions) unless the
        store has them all; its blocks stay invisible to queries until a document names them.
        Returns (rows, kv blocks computed or None). before_commit() runs between the prefill and
        the commit (a distributed worker's fault hook)."""
        rt, store = self.rt, self.rt.store()
        prelude, prelude_row = self.prelude_state()
        p, C = prelude.n_tokens, store.manifest.block_tokens
        chain = hashing.chain_ids(rt.fingerprint, seg, C, parent=store.manifest.id_of(prelude_row), start=p)
        store.refresh()
        rows = [store.row_of(b) for b in chain]
        if all(r is not None for r in rows):
            return [int(r) for r in rows if r is not None], None
        store.require_exact()                # a compact store takes no new blocks (before any prefill)
        cache = prelude.cache()
        kv = []
        for _, b, _ in kvops.prefill_blocks(rt.model, seg, C, cache, start=p,
                                            chunk_tokens=store.manifest.chunk_tokens):
            kv.append(b)
            rt.make_way()                   # a deposit gives way to questions between blocks (defer_to)
        if before_commit is not None:
            before_commit()
        return self._commit_segment(chain, seg, kv, prelude_row, p, C), kv

    def _commit_segment(self, chain, seg, kv, prelude_row, p, C) -> list[int]:
        rows: list[int] = []

        def build(s):
            new, got = s.plan_chain(chain, seg, p, prelude_row, lambda i: kvops.to_storage(kv[i]),
                                    owner=self.scope.owner)
            rows[:] = got
            return Change(new)
        self.rt.store().commit(build)
        return list(rows)

    # ------------------------------------------------------------------ queries
    def docs(self) -> list[DocInfo]:
        """This scope's documents, oldest first."""
        store = self.rt.store()
        store.refresh()
        return [DocInfo(k, d.n_tokens, len(d.rows), d.segments, d.source, d.created)
                for k, d in sorted(store.manifest.docs.items(), key=lambda kv: kv[1].created) if self.scope.owns(k)]

    def remove(self, doc_id: str) -> None:
        store = self.rt.store()
        store.refresh()
        if doc_id not in store.manifest.docs or not self.scope.owns(doc_id):
            raise DocumentNotFoundError(f"no document {doc_id!r} in store {self.rt.path}")
        self.remove_all([doc_id])

    def remove_all(self, doc_ids, states=()) -> int:
        """Remove documents of this scope (and `states`) in one commit (all unselectable at once, or
        none), then their rows from the indexes. Ids this scope does not own or the store lacks are
        skipped. Returns how many documents were removed."""
        store = self.rt.store()
        store.refresh()
        ids = tuple(d for d in dict.fromkeys(doc_ids) if d in store.manifest.docs and self.scope.owns(d))
        states = tuple(s for s in states if s in store.manifest.states)
        if not ids and not states:
            return 0
        rows = [r for d in ids for r in store.manifest.docs[d].rows]
        gone: list[int] = []

        def build(s):
            return Change(removed_docs=tuple(d for d in ids if d in s.manifest.docs),
                          removed_states=tuple(x for x in states if x in s.manifest.states))

        def after(m):                               # committed (invisible from here on), still locked
            still = self.live_rows()                # blocks shared with another document stay indexed
            gone.extend(r for r in rows if r not in still)
            self._update_indexes(drop=set(gone))
        store.commit(build, after=after)
        self.rt.forget_blocks(gone)
        return len(ids)


def _ident(path: Path) -> tuple | None:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return (st.st_ino, st.st_mtime_ns, st.st_size)




USER_SCOPES = 64                   # users whose selection indexes stay loaded


class Scopes:
    """The Documents of chat users' scopes, kept for the last USER_SCOPES users (an idle user's
    indexes cost nothing: they load on its next request). They share one MiniLM embedder."""

    def __init__(self, rt: Runtime, embedder) -> None:
        self.rt = rt
        self._embedder = embedder           # () -> the shared documents' TextEmbedder
        self._docs: dict[str, Documents] = {}

    def get(self, scope: Scope) -> Documents:
        with self.rt.lock:
            docs = self._docs.pop(scope.prefix, None)
            if docs is None:
                docs = Documents(self.rt, scope=scope, embedder=self._embedder())
            self._docs[scope.prefix] = docs                  # most recent last
            while len(self._docs) > USER_SCOPES:
                self._docs.pop(next(iter(self._docs)))
            return docs

    def drop(self, scope: Scope) -> None:
        with self.rt.lock:
            self._docs.pop(scope.prefix, None)

    def __len__(self) -> int:
        return len(self._docs)
