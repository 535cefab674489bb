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

import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import xxhash

from kvmemory import hashing, kv as kvops
from kvmemory.errors import InputError, KVMemoryError
from kvmemory.index import SELECTORS, VectorIndex
from kvmemory.index import keys as keysel
from kvmemory.manifest import DocEntry
from kvmemory.store import NewBlock

SEGMENT_BLOCKS = 4     # 1,024-token segments: measured against 1 and 8 in benchmarks/bench_qa.py
INDEX_DIR = "index"


class DocumentNotFoundError(KVMemoryError, KeyError):
    def __str__(self) -> str:
        return str(self.args[0])


@dataclass(frozen=True)
class DocInfo:
    doc_id: str
    n_tokens: int
    blocks: int
    segments: int
    source: str
    created: float


class Prelude:
    """The fixed text before every segment and, at ask time, before the selected blocks, plus
    the text after them that asks the question. Built from the chat template when there is one."""

    MARK = "\u0000KVMEMORY-EXCERPTS\u0000"

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        if getattr(tokenizer, "chat_template", None):
            msgs = [{"role": "system", "content": "Answer the question using the document excerpts. Be brief."},
                    {"role": "user", "content": "Document excerpts:\n" + self.MARK + "\n\nQuestion: {q}"}]
            text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
            self.head, self.tail = text.split(self.MARK)
        else:
            self.head, self.tail = "Document excerpts:\n", "\n\nQuestion: {q}\nAnswer:"
        self.ids = tokenizer(self.head, add_special_tokens=False)["input_ids"]

    def question_ids(self, question: str) -> list[int]:
        return self.tokenizer(self.tail.replace("{q}", question), add_special_tokens=False)["input_ids"]


class Documents:
    """Deposit, index, select and remove documents of one Memory."""

    def __init__(self, mem, segment_blocks: int = SEGMENT_BLOCKS, key_layer: int | None = None) -> None:
        self.mem = mem
        self.segment_blocks = segment_blocks
        self.prelude = Prelude(mem.tokenizer)
        geo = mem.geometry
        self.key_layer = keysel.default_layer(geo.layers) if key_layer is None else key_layer
        from kvmemory.rope import inv_freq
        self.freqs = inv_freq(mem.model)
        self.dims = {"text": 384, "keys": geo.kv_heads * geo.head_dim}
        self._embedder = None
        self._indexes: dict[str, VectorIndex] = {}
        self._prelude = None
        self._checked: dict[str, int] = {}          # selector -> manifest commit it was validated at
        self._live: tuple[int, dict] = (-1, {})

    # ------------------------------------------------------------------ selectors
    @property
    def embedder(self):
        if self._embedder is None:
            from kvmemory.index.embedder import TextEmbedder
            self._embedder = TextEmbedder()
        return self._embedder

    def index(self, selector: str) -> VectorIndex:
        """The FAISS index of a selector, loaded from disk, rebuilt from the store if stale."""
        if selector not in SELECTORS:
            raise InputError(f"selector must be one of {SELECTORS}, got {selector!r}")
        commit = self.mem.store.manifest.commit
        idx = self._indexes.get(selector)
        if idx is not None and self._checked.get(selector) == commit:
            return idx                       # validated at this commit: nothing changed since
        live = self.live_rows()
        if idx is None:
            path = self._index_path(selector)
            if path.is_file():
                try:
                    idx = VectorIndex.load(path, self.dims[selector])
                except (RuntimeError, ValueError):
                    idx = None               # derived data: damaged means rebuild
        if idx is None or not live <= idx.ids():
            idx = self.rebuild(selector)
        self._indexes[selector] = idx
        self._checked[selector] = commit
        return idx

    def _index_path(self, selector: str) -> Path:
        return self.mem.path / INDEX_DIR / f"{selector}.faiss"

    def live_map(self) -> dict[int, tuple[str, int]]:
        """Row -> (doc id, deposit rank) of every block of a visible document; rebuilt per commit."""
        m = self.mem.store.manifest
        if self._live[0] != m.commit:
            self._live = (m.commit, {r: (doc_id, rank) for rank, (doc_id, d) in enumerate(m.docs.items())
                                     for r in d.rows})
        return self._live[1]

    def live_rows(self) -> set[int]:
        return set(self.live_map())

    def vectors(self, selector: str, rows: list[int], kv: list[torch.Tensor] | None = None) -> np.ndarray:
        """Vectors of content blocks (kv: each [L, 2, H, n, D]; read from the store when None)."""
        store = self.mem.store
        meta = store.block_meta(rows)
        if selector == "text":
            texts = [self.mem.tokenizer.decode([int(t) for t in meta["tokens"][i][:meta["n_tokens"][i]]])
                     for i in range(len(rows))]
            return self.embedder.embed(texts)
        if kv is None:
            blocks, _ = store.read_kv(rows)
            kv = [kvops.from_storage(blocks[i], self.mem._dtype)[:, :, :, :int(meta["n_tokens"][i])]
                  for i in range(len(rows))]
        out = [keysel.block_vectors(kv[i], list(meta["positions"][i][:int(meta["n_tokens"][i])]), self.key_layer,
                                    self.freqs) for i in range(len(rows))]
        return np.stack(out) if out else np.zeros((0, self.dims["keys"]), np.float32)

    def rebuild(self, selector: str, progress=None) -> VectorIndex:
        """Recompute every live block's vector from the store and write the index."""
        rows = sorted(self.live_rows())
        idx = VectorIndex(self.dims[selector])
        for i in range(0, len(rows), 64):
            part = rows[i:i + 64]
            idx.add(part, self.vectors(selector, part))
            if progress is not None:
                progress.update(len(part))
        self._save_index(selector, idx)
        return idx

    def _save_index(self, selector: str, idx: VectorIndex) -> None:
        if self.mem.store.read_only:
            return                           # rebuilt in memory; a writable open will persist it
        (self.mem.path / INDEX_DIR).mkdir(exist_ok=True)
        idx.save(self._index_path(selector))
        self._indexes[selector] = idx

    # ------------------------------------------------------------------ deposit
    def _prelude_state(self):
        """The prelude as a stored state (saved on first use, then read back verified)."""
        mem = self.mem
        sid = hashing.chain_ids(mem.fingerprint, self.prelude.ids, mem.block_tokens)[-1].hex()
        if self._prelude is None or self._prelude.id != sid:
            mem.store.refresh()
            if sid in mem.store.manifest.states:
                self._prelude = mem.load(sid)
            else:
                self._prelude = mem.save(self.prelude.ids, label="kvmemory:prelude")
        return self._prelude, mem.store.row_of(bytes.fromhex(sid))

    def prelude_kv(self) -> torch.Tensor:
        """[L, 2, H, p, D] KV of the prelude."""
        return self._prelude_state()[0].kv

    def add(self, text, doc_id: str | None = None, source: str = "", progress=None) -> DocInfo:
        mem = self.mem
        store = mem._store()
        text = decode_text(text, source)
        ids = mem.tokenizer(text, add_special_tokens=False)["input_ids"]
        if progress is not None:
            progress.total = len(ids)
            progress.refresh()
        doc_id = doc_id or xxhash.xxh3_64_hexdigest(np.asarray(ids, np.int32).tobytes())
        _check_doc_id(doc_id)
        store.refresh()
        if doc_id in store.manifest.docs:
            raise InputError(f"document {doc_id!r} already exists; remove it first (kvmemory rm)")
        prelude, prelude_row = self._prelude_state()
        p = prelude.n_tokens
        C = store.manifest.block_tokens
        seg_len = self.segment_blocks * C
        if p + seg_len > mem.geometry.max_positions:
            raise InputError(f"segments of {seg_len} tokens behind a {p}-token prelude exceed the model's window")
        rows: list[int] = []
        vecs: dict[str, list[np.ndarray]] = {s: [] for s in SELECTORS}
        parent = bytes.fromhex(prelude.id)
        for s0 in range(0, len(ids), seg_len):
            seg = ids[s0:s0 + seg_len]
            chain = hashing.chain_ids(mem.fingerprint, seg, C, parent=parent, start=p)
            seg_rows = [store.row_of(b) for b in chain]
            kv = None
            if any(r is None for r in seg_rows):     # compute the segment (resume skips stored ones)
                cache = prelude.cache()
                kv = [b for _, b, _ in kvops.prefill_blocks(mem.model, seg, C, cache, start=p)]
                seg_rows = self._commit_segment(chain, seg, kv, prelude_row, p, C)
            rows += seg_rows
            vecs["keys"].append(self.vectors("keys", seg_rows, kv))
            vecs["text"].append(self.vectors("text", seg_rows))
            if progress is not None:
                progress.update(len(seg))
        # vectors first (extra ids are ignored at query time), the manifest entry last: the commit
        for sel in SELECTORS:
            idx = self.index(sel)
            idx.add(rows, np.concatenate(vecs[sel]))
            self._save_index(sel, idx)
        entry = DocEntry(rows=rows, n_tokens=len(ids), segments=-(-len(ids) // seg_len), source=source,
                         created=time.time())

        def build(s):
            if doc_id in s.manifest.docs:
                raise InputError(f"document {doc_id!r} was added by another writer meanwhile")
            return [], {}, {doc_id: entry}, ()
        store.commit(build)
        return DocInfo(doc_id, entry.n_tokens, len(rows), entry.segments, source, entry.created)

    def _commit_segment(self, chain, seg, kv, prelude_row, p, C) -> list[int]:
        rows: list[int] = []

        def build(s):
            new, parent_row = [], prelude_row
            rows.clear()
            for i, bid in enumerate(chain):
                row = s.row_of(bid)
                if row is None:
                    row = s.manifest.n_blocks + len(new)
                    toks = seg[i * C:(i + 1) * C]
                    new.append(NewBlock(bid, parent_row, toks, range(p + i * C, p + i * C + len(toks)),
                                        kvops.to_storage(kv[i])))
                rows.append(row)
                parent_row = row
            return new, {}
        self.mem.store.commit(build)
        return list(rows)

    # ------------------------------------------------------------------ queries
    def docs(self) -> list[DocInfo]:
        store = self.mem._store()
        store.refresh()
        return [DocInfo(k, d.n_tokens, len(d.rows), d.segments, d.source, d.created)
                for k, d in sorted(store.manifest.docs.items(), key=lambda kv: kv[1].created)]

    def remove(self, doc_id: str) -> None:
        store = self.mem._store()
        store.refresh()
        if doc_id not in store.manifest.docs:
            raise DocumentNotFoundError(f"no document {doc_id!r} in store {self.mem.path}")
        rows = store.manifest.docs[doc_id].rows

        def build(s):
            if doc_id not in s.manifest.docs:
                raise DocumentNotFoundError(f"document {doc_id!r} was removed by another writer meanwhile")
            return [], {}, {}, (doc_id,)
        store.commit(build)                         # the commit point: invisible from here on
        still = self.live_rows()                    # blocks shared with another document stay indexed
        gone = [r for r in rows if r not in still]
        for sel in SELECTORS:
            idx = self.index(sel)
            idx.remove(gone)
            self._save_index(sel, idx)
        self.mem._pager_forget(gone)


def decode_text(text, source: str = "") -> str:
    """A document's text: str, or bytes that must be UTF-8; not empty, not binary."""
    what = source or "document"
    if isinstance(text, (bytes, bytearray)):
        try:
            text = bytes(text).decode("utf-8")
        except UnicodeDecodeError as e:
            raise InputError(f"{what} is not UTF-8 text (byte 0x{text[e.start]:02x} at offset {e.start})") from None
    if not isinstance(text, str) or not text.strip():
        raise InputError(f"{what} is empty")
    if "\x00" in text:
        raise InputError(f"{what} contains NUL bytes: it looks binary, not text")
    return text


def _check_doc_id(doc_id: str) -> None:
    if not isinstance(doc_id, str) or not doc_id or len(doc_id) > 200 or any(c in doc_id for c in "\n\r\x00"):
        raise InputError(f"a document id is a non-empty single-line string of at most 200 characters, got {doc_id!r}")
