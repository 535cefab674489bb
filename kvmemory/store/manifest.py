"""The manifest: what a store holds, the header plus the replay of its commit log. Pure: no I/O,
no torch, no zarr (reading and writing the log is kvmemory/store/log.py).

A store's commit point is a log of small, write-once files:

    manifest.json              the header, written once when the store is created: format,
                               model fingerprint and geometry, block layout. Never rewritten.
    log/00000001.json ...      one record per commit: the rows it appended (start row and the
                               ids of its blocks), states and documents added or removed, rows
                               reclaimed by gc, the roots of salted chains it began. A commit
                               exists once its record exists.
    log/snapshot-00000064.json every SNAPSHOT_EVERY commits, the whole view at that commit, so
                               opening reads one snapshot and at most SNAPSHOT_EVERY - 1 records.

Every file is written once and never rewritten (kvmemory/store/durable.py), so a commit costs
the same however large the store is.

`Manifest` is the in-memory view: the header plus the result of replaying the log.
"""

from __future__ import annotations

import bisect
import json
import re
from dataclasses import asdict, dataclass, field

from kvmemory.errors import StoreCorruptError
from kvmemory.hashing import ROOT_PARENT

ENCODINGS = ("exact", "bf16", "fp16")   # kvmemory/store/encoding.py (this module stays free of numpy)
CIPHER = "AES-256-GCM"                  # of an encrypted store (kvmemory/store/seal.py)

FORMAT = "kvmemory-store"
FORMAT_VERSION = 2
MANIFEST_NAME = "manifest.json"
LOG_DIR = "log"
SNAPSHOT_EVERY = 64
ID_HEX = 32                        # hex digits of one block id

HEADER_FIELDS = ("fingerprint", "model", "block_tokens", "shard_blocks", "codec", "kv_dtype", "format", "version")


@dataclass
class StateEntry:
    """A committed state: the chain ending at block row `last_row`."""

    last_row: int
    n_tokens: int
    label: str = ""
    created: float = 0.0


@dataclass
class DocEntry:
    """A deposited document: its content blocks in document order (prelude blocks excluded)."""

    rows: list[int]
    n_tokens: int
    segments: int
    source: str = ""
    created: float = 0.0


@dataclass
class CommitRecord:
    """One commit. Blocks [start, start + len(ids) / 32) were appended (ids: their block ids in hex)."""

    commit: int
    start: int = 0
    ids: str = ""
    tokens: int = 0
    states: dict[str, StateEntry] = field(default_factory=dict)
    docs: dict[str, DocEntry] = field(default_factory=dict)
    removed_docs: list[str] = field(default_factory=list)
    removed_states: list[str] = field(default_factory=list)
    freed: list[int] = field(default_factory=list)
    freed_tokens: int = 0
    time: float = 0.0
    roots: dict[str, str] = field(default_factory=dict)   # row -> root id (hex) of a salted chain's first block

    @property
    def n_new(self) -> int:
        return len(self.ids) // ID_HEX

    def to_json(self) -> str:
        raw = asdict(self)
        if not raw["roots"]:               # a store without salted chains keeps the records it always had
            del raw["roots"]
        return json.dumps(raw, sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str, where: str) -> "CommitRecord":
        try:
            raw = json.loads(text)
            raw["states"] = {k: StateEntry(**v) for k, v in raw.get("states", {}).items()}
            raw["docs"] = {k: DocEntry(**v) for k, v in raw.get("docs", {}).items()}
            rec = cls(**raw)
            bytes.fromhex(rec.ids)
            bad_roots = any(not (rec.start <= int(r) < rec.start + rec.n_new) or len(bytes.fromhex(v)) != ID_HEX // 2
                            for r, v in rec.roots.items())
        except (ValueError, TypeError, KeyError, AttributeError) as e:
            raise StoreCorruptError(f"{where} cannot be decoded: {e}") from None
        if len(rec.ids) % ID_HEX or rec.start < 0 or rec.commit < 1 or bad_roots:
            raise StoreCorruptError(f"{where} is inconsistent (start {rec.start}, {len(rec.ids)} id digits)")
        return rec


@dataclass
class Manifest:
    """The header of a store plus its committed contents at commit `commit`.

    ranges: [(start, ids hex, time)] of every commit that appended blocks, in row order; freed: rows
    reclaimed by gc. n_blocks counts committed blocks that are not freed; next_row is where the
    next commit starts (the next shard boundary, so a commit never writes into a file an
    earlier commit wrote).
    """

    fingerprint: str
    model: dict                    # name, layers, kv_heads, head_dim, dtype, max_positions, rope
    block_tokens: int
    shard_blocks: int
    codec: str
    kv_dtype: str                  # torch dtype name of the KV ("float32", "bfloat16", ...)
    encoding: str = "exact"        # how the KV words are held (kvmemory/store/encoding.py)
    prefill_tokens: int = 0        # the canonical prefill's chunk (kvmemory/kv.py); 0: block_tokens
    encryption: dict | None = None  # an encrypted store's {"cipher", "store": its id} (kvmemory/store/seal.py)
    commit: int = 0
    states: dict[str, StateEntry] = field(default_factory=dict)
    docs: dict[str, DocEntry] = field(default_factory=dict)
    ranges: list[tuple[int, str, float]] = field(default_factory=list)
    freed: set[int] = field(default_factory=set)
    stored_tokens: int = 0
    roots: dict[int, bytes] = field(default_factory=dict)   # first row of a salted chain -> its root id
    format: str = FORMAT
    version: int = FORMAT_VERSION
    _n_blocks: int | None = field(default=None, repr=False, compare=False)

    # ------------------------------------------------------------------ rows
    @staticmethod
    def _rows(start: int, ids: str) -> range:
        """The rows of one range: start .. start + its number of block ids."""
        return range(start, start + len(ids) // ID_HEX)

    @property
    def rows_end(self) -> int:
        return self._rows(*self.ranges[-1][:2]).stop if self.ranges else 0

    @property
    def next_row(self) -> int:
        s = self.shard_blocks
        return -(-self.rows_end // s) * s

    @property
    def n_blocks(self) -> int:
        if self._n_blocks is None:
            self._n_blocks = sum(len(self._rows(s, ids)) for s, ids, _ in self.ranges) - len(self.freed)
        return self._n_blocks

    def is_committed(self, row: int) -> bool:
        i = bisect.bisect_right(self.ranges, row, key=lambda r: r[0]) - 1
        if i < 0:
            return False
        return row in self._rows(*self.ranges[i][:2]) and row not in self.freed

    def committed_rows(self) -> list[int]:
        return [r for start, ids, _ in self.ranges for r in self._rows(start, ids) if r not in self.freed]

    def id_of(self, row: int) -> bytes:
        i = bisect.bisect_right(self.ranges, row, key=lambda r: r[0]) - 1
        start, ids, _ = self.ranges[i]
        return bytes.fromhex(ids[(row - start) * ID_HEX:(row - start + 1) * ID_HEX])

    def root_of(self, row: int) -> bytes:
        """The parent id of the block at `row` if it begins a chain: its salted root, else ROOT_PARENT."""
        return self.roots.get(int(row), ROOT_PARENT)

    def committed_since(self, t: float) -> set[int]:
        """Rows appended by commits at or after time t."""
        return {r for start, ids, when in self.ranges if when >= t for r in self._rows(start, ids)}

    def ids(self):
        """(block id, row) of every committed block, in row order."""
        for start, ids, _ in self.ranges:
            raw = bytes.fromhex(ids)
            for i, row in enumerate(self._rows(start, ids)):
                if row not in self.freed:
                    yield raw[i * 16:(i + 1) * 16], row

    # ------------------------------------------------------------------ header
    def header(self) -> dict:
        # an exact store's header is what it always was; another encoding is named
        return {k: getattr(self, k) for k in HEADER_FIELDS} | \
            ({"encoding": self.encoding} if self.encoding != "exact" else {}) | \
            ({"prefill_tokens": self.prefill_tokens} if self.prefill_tokens not in (0, self.block_tokens) else {}) | \
            ({"encryption": self.encryption} if self.encryption else {})

    @property
    def chunk_tokens(self) -> int:
        """Tokens per forward of the canonical prefill: block_tokens unless the store was made with a
        smaller prefill_tokens (a divisor of it)."""
        return self.prefill_tokens or self.block_tokens

    def header_json(self) -> str:
        return json.dumps(self.header(), indent=1, sort_keys=True)

    # ------------------------------------------------------------------ log
    def apply(self, rec: CommitRecord, where: str = "") -> None:
        """Replay one commit record onto this view (in place); StoreCorruptError if it does not fit."""
        where = where or f"commit record {rec.commit}"
        if rec.commit != self.commit + 1:
            raise StoreCorruptError(f"{where}: expected commit {self.commit + 1}, found {rec.commit}")
        n_before = self.n_blocks
        if rec.n_new:
            # a commit's rows start on a shard boundary and overlap no other commit's. On a local
            # store they follow the last commit; on an object store two committers claim shards
            # first and may land their records in either order (ranges stay sorted by start).
            i = bisect.bisect_right(self.ranges, rec.start, key=lambda r: r[0])
            end = rec.start + rec.n_new
            prev_end = self._rows(*self.ranges[i - 1][:2]).stop if i else 0
            next_start = self.ranges[i][0] if i < len(self.ranges) else None
            if rec.start % self.shard_blocks or rec.start < prev_end or (next_start is not None and end > next_start):
                raise StoreCorruptError(f"{where}: blocks at rows {rec.start}..{end - 1} overlap an earlier "
                                        f"commit's rows or start off a shard boundary")
            self.ranges.insert(i, (rec.start, rec.ids, rec.time))
        self.stored_tokens += rec.tokens - rec.freed_tokens
        self._n_blocks = n_before + rec.n_new - len(set(rec.freed) - self.freed)
        self.freed.update(rec.freed)
        self.roots.update((int(r), bytes.fromhex(v)) for r, v in rec.roots.items())
        for r in rec.freed:
            self.roots.pop(r, None)
        self.states.update(rec.states)
        self.docs.update(rec.docs)
        for d in rec.removed_docs:
            self.docs.pop(d, None)
        for s in rec.removed_states:
            self.states.pop(s, None)
        self.commit = rec.commit
        # what this record names (not the whole view: a commit costs the same in a big store);
        # a gc record frees only rows nothing names, checked by the writer
        self.check(where, rec.states.values(), rec.docs.values())

    def check(self, where: str, states=None, docs=None) -> None:
        states = self.states.values() if states is None else states
        docs = self.docs.values() if docs is None else docs
        bad = [s for s in states if not self.is_committed(s.last_row)]
        bad += [d for d in docs if any(not self.is_committed(r) for r in d.rows)]
        if bad:
            raise StoreCorruptError(f"{where} is inconsistent: a state or document points at a row that is not "
                                    "committed")

    def snapshot_json(self) -> str:
        return json.dumps({"commit": self.commit, "states": {k: asdict(v) for k, v in self.states.items()},
                           "docs": {k: asdict(v) for k, v in self.docs.items()},
                           "ranges": [list(r) for r in self.ranges], "freed": sorted(self.freed),
                           "stored_tokens": self.stored_tokens,
                           **({"roots": {str(r): v.hex() for r, v in sorted(self.roots.items())}} if self.roots else {})},
                          sort_keys=True, separators=(",", ":"))

    def load_snapshot(self, text: str, where: str) -> None:
        try:
            raw = json.loads(text)
            self.commit = int(raw["commit"])
            self.states = {k: StateEntry(**v) for k, v in raw["states"].items()}
            self.docs = {k: DocEntry(**v) for k, v in raw["docs"].items()}
            self.ranges = [(int(s), str(ids), float(t)) for s, ids, t in raw["ranges"]]
            self.freed = {int(r) for r in raw["freed"]}
            self.stored_tokens = int(raw["stored_tokens"])
            self.roots = {int(r): bytes.fromhex(v) for r, v in raw.get("roots", {}).items()}
            self._n_blocks = None
        except (ValueError, TypeError, KeyError, AttributeError) as e:
            raise StoreCorruptError(f"{where} cannot be decoded: {e}") from None
        self.check(where)

    @classmethod
    def from_header(cls, text: str, where: str = "manifest") -> "Manifest":
        try:
            raw = json.loads(text)
            if not isinstance(raw, dict) or raw.get("format") != FORMAT:
                fmt = raw.get("format") if isinstance(raw, dict) else None
                raise StoreCorruptError(f"{where} is not a kvmemory manifest (format={fmt!r})")
            if raw.get("version") != FORMAT_VERSION:
                raise StoreCorruptError(
                    f"{where} has format version {raw.get('version')}, this kvmemory reads {FORMAT_VERSION}")
            encoding = raw.get("encoding", "exact")
            if encoding not in ENCODINGS:
                raise StoreCorruptError(f"{where} names KV encoding {encoding!r}; this kvmemory reads {ENCODINGS}")
            q = raw.get("prefill_tokens", 0)
            if not isinstance(q, int) or q < 0 or (q and raw["block_tokens"] % q):
                raise StoreCorruptError(f"{where} has prefill_tokens {q!r}, not a divisor of block_tokens "
                                        f"{raw['block_tokens']}")
            enc = raw.get("encryption")
            if enc is not None and (not isinstance(enc, dict) or enc.get("cipher") != CIPHER or
                                    not isinstance(enc.get("store"), str) or not re.fullmatch(r"[0-9a-f]{32}", enc["store"])):
                raise StoreCorruptError(f"{where} names an encryption this kvmemory does not read: {enc!r}")
            return cls(**{k: raw[k] for k in HEADER_FIELDS}, encoding=encoding, prefill_tokens=q, encryption=enc)
        except StoreCorruptError:
            raise
        except (ValueError, TypeError, KeyError, AttributeError) as e:
            raise StoreCorruptError(f"{where} cannot be decoded: {e}") from None
