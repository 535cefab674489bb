"""BlockStore: a store's blocks as append-only Zarr v3 arrays (kvmemory/store/layout.py) plus its
commit log (kvmemory/store/log.py), over a files object (a local directory or an object-store
prefix, kvmemory/store/files.py). This module opens and creates stores and reads them: every
block read verifies its digest, and metadata a graft relies on re-derives its ids. Writes are
kvmemory/store/commit.py, gc kvmemory/store/gc.py.

Arrays are created once with a fixed capacity of R = 2**32 rows (absent chunks are fill), so no
commit rewrites their metadata. Every commit starts at a shard boundary and every array is chunked
(kv: sharded) by `shard_blocks` rows, so a commit writes only new files. Rows a commit did not
reach (a crash, a full disk) are ignored, and their files are removed by the next writer. Block
metadata is read lazily, chunk by chunk: opening a store reads the header and the log only.
"""

from __future__ import annotations

import shutil
import threading
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import numpy as np
import zarr
from zarr.storage import LocalStore

from kvmemory import hashing
from kvmemory.errors import KeyDestroyedError, StoreCorruptError, StoreError, StoreExistsError, StoreKeyError
from kvmemory.store import shards
from kvmemory.store.cache import ShardCache
from kvmemory.store.commit import CommitMixin
from kvmemory.store.durable import fsync_dir, fsync_tree
from kvmemory.store.files import LocalFiles
from kvmemory.store.gc import GcMixin
from kvmemory.store import encoding as encodings
from kvmemory.store.layout import ROW_CAPACITY, arrays, block_digest, create_arrays, meta_arrays, runs
from kvmemory.store.location import locate
from kvmemory.store.lock import writer_lock
from kvmemory.store.log import read_manifest, read_new_records, write_header
from kvmemory.store.manifest import LOG_DIR, MANIFEST_NAME, CommitRecord, Manifest
from kvmemory.store.seal import Sealer


def _provider(keys):
    """The KeyProvider given, or the one the environment names (kvmemory/keys.py)."""
    if keys is not None:
        return keys
    from kvmemory.keys import LocalKeyProvider
    return LocalKeyProvider.from_env()


class _SealedMeta(dict):
    """block_meta of an encrypted store: its token ids decrypted on first use (so that what reads
    only the chain's shape, like gc, never decrypts, and a forgotten owner's rows cost it nothing)."""

    def __init__(self, store: "BlockStore", rows: list[int]) -> None:
        super().__init__()
        self._store, self._rows = store, rows

    def __getitem__(self, name: str):
        if name == "tokens" and not getattr(self, "_opened", False):
            sealer = self._store.sealer
            raw = dict.__getitem__(self, "tokens")
            out = np.empty_like(raw)
            for i, r in enumerate(self._rows):
                bid = dict.__getitem__(self, "block_id")[i].tobytes()
                out[i] = sealer.open_tokens(dict.__getitem__(self, "seal")[i], bid, raw[i],
                                            f"block {bid.hex()} (row {r})")
            dict.__setitem__(self, "tokens", out)
            self._opened = True
        return dict.__getitem__(self, name)


def error_summary(encoding: str, err: np.ndarray) -> dict:
    """The worst of per-block errors [k, 3]: how a graft of those blocks is reported."""
    def worst(col: int) -> float | None:          # None: a block's error was not measured
        c = err[:, col]
        return None if np.isnan(c).any() else (float(c.max()) if len(c) else 0.0)
    return {"encoding": encoding, "blocks": int(len(err)), "kl_max": worst(2),
            "key_rel_error_max": worst(0), "value_rel_error_max": worst(1)}


class BlockStore(CommitMixin, GcMixin):
    """The on-disk truth. Opening reads the header and the log; every block read verifies its digest."""

    def __init__(self, root: Path, read_only: bool = False, lock_timeout_s: float = 30.0, files=None,
                 cache_bytes: int = 8 << 30, keys=None) -> None:
        """root: the store directory; for a store on an object store (`files` an ObjectFiles) the
        local working directory that holds its disk cache tier and derived indexes. keys: an
        encrypted store's KeyProvider (kvmemory/keys.py; None: the one the environment names)."""
        self.root = Path(root)
        self.files = files if files is not None else LocalFiles(self.root)
        self.remote = bool(self.files.remote)
        self.name = self.files.describe()
        self.read_only = read_only
        self.lock_timeout_s = lock_timeout_s
        if self.remote:                    # the local working directory of a store elsewhere
            self.root.mkdir(parents=True, exist_ok=True)
        # the disk cache tier of a store elsewhere: direct reads go to local copies of its shards
        self.cache = ShardCache(self.files, self.root / "cache", cache_bytes) if self.remote else None
        self.manifest = read_manifest(self.files)
        self.encoding = encodings.get(self.manifest.encoding, self.manifest.kv_dtype)
        self.sealer = self._sealer(keys)
        self._open_arrays()
        self._chunks: dict[int, dict[str, np.ndarray]] = {}   # metadata chunk -> arrays (committed: immutable)
        self._ids: dict[bytes, int] | None = None             # built on first row_of
        self._writable: dict[str, zarr.Array] | None = None
        self._cleaned = False
        self._claimed = 0                                     # object stores: shards below this are taken
        self._mutex = threading.RLock()                        # one thread at a time changes this object
        self._lock_depth = 0

    # ---------------------------------------------------------------- create / open
    def _sealer(self, keys) -> Sealer | None:
        """An encrypted store's Sealer, its own key checked (a wrong keyring or master key is refused
        here, before anything is read or written)."""
        enc = self.manifest.encryption
        if not enc:
            if keys is not None:
                raise StoreKeyError(f"store {self.name} is not encrypted: it takes no keys")
            return None
        keys = _provider(keys)
        if not self.remote and keys.contains(self.root):
            raise StoreKeyError(f"store {self.name}: its keys ({keys.describe()}) must be held apart from it, "
                                "not inside it (a copy of the store would carry them)")
        sealer = Sealer(enc["store"], keys, self.name)
        sealer.check()
        return sealer

    @classmethod
    def open(cls, root, read_only: bool = True, lock_timeout_s: float = 30.0, storage_options: dict | None = None,
             work_dir=None, keys=None) -> "BlockStore":
        """Open an existing store (a directory, or s3://bucket/prefix); StoreError if `root` is not one."""
        loc = locate(root, must_exist=True, storage_options=storage_options, work_dir=work_dir)
        return cls(loc.root, read_only=read_only, lock_timeout_s=lock_timeout_s,
                   files=loc.files if loc.remote else None, keys=keys)

    @staticmethod
    def _make_store_key(manifest: Manifest, keys) -> None:
        """An encrypted store's own data key, made before its header is written."""
        if manifest.encryption:
            Sealer(manifest.encryption["store"], _provider(keys)).create()

    @classmethod
    def create_remote(cls, files, work_dir: Path, manifest: Manifest, lock_timeout_s: float = 30.0,
                      cache_bytes: int = 8 << 30, keys=None) -> "BlockStore":
        """Create a store on an object store. The arrays' metadata first, the header last with a
        create-only write: of two processes creating one store, one header lands and both open it."""
        if not files.exists(MANIFEST_NAME):
            try:
                cls._make_store_key(manifest, keys)
                create_arrays(files.zarr_store("data", read_only=False), manifest)
                write_header(files, manifest)
            except StoreExistsError:
                pass                                   # another process created it meanwhile
        return cls(work_dir, lock_timeout_s=lock_timeout_s, files=files, cache_bytes=cache_bytes, keys=keys)

    @classmethod
    def create(cls, root: Path, manifest: Manifest, lock_timeout_s: float = 30.0, keys=None) -> "BlockStore":
        root = Path(root)
        root.mkdir(parents=True, exist_ok=True)
        with writer_lock(root, lock_timeout_s):
            if (root / MANIFEST_NAME).exists():  # another process created it meanwhile
                return cls(root, lock_timeout_s=lock_timeout_s, keys=keys)
            if manifest.encryption and keys is not None and keys.contains(root):
                raise StoreKeyError(f"store {root}: its keys ({keys.describe()}) must be held apart from it")
            cls._make_store_key(manifest, keys)
            shutil.rmtree(root / "data", ignore_errors=True)   # an earlier create that did not finish
            try:
                create_arrays(LocalStore(root / "data"), manifest)
                fsync_tree(root / "data")
                (root / LOG_DIR).mkdir(exist_ok=True)
                for d in (root / "data", root / LOG_DIR, root):
                    fsync_dir(d)
            except OSError as e:
                raise StoreError(f"cannot create store {root}: {e.strerror or e}") from None
            write_header(LocalFiles(root), manifest)  # last: the store exists once this lands
        return cls(root, lock_timeout_s=lock_timeout_s, keys=keys)

    def _open_arrays(self) -> None:
        try:
            store = self.files.zarr_store("data", read_only=True)
            g = zarr.open_group(store=store, mode="r", zarr_format=3)
            self._arr = {name: g[name] for name in arrays(self.manifest)}
        except Exception as e:  # zarr raises many types for a damaged group; name the store
            raise StoreCorruptError(f"store {self.name}: cannot open its Zarr arrays: {e}") from None
        for name, a in self._arr.items():
            per = a.shards[0] if name == "kv" and a.shards else a.chunks[0]
            if a.shape[0] != ROW_CAPACITY or per != self.manifest.shard_blocks:
                raise StoreCorruptError(f"store {self.name}: array {name} has shape {a.shape} and {per} rows per "
                                        f"file; this layout needs {ROW_CAPACITY} rows, {self.manifest.shard_blocks} "
                                        "per file")
        # our own shard layout is read straight from the files (see shards.py); on an object store
        # from local copies of the shard objects (the disk cache tier)
        self._layout = shards.layout_of(self.files.read("data/kv/zarr.json").decode())
        self._direct = self._layout if self._layout is not None and self._layout.raw else None
        self._kv_dir = (self.cache.root if self.cache is not None else self.root) / "data" / "kv"

    def owner_root(self, owner: str) -> bytes:
        """The root of an owner's chains: salted by the owner, and in an encrypted store by a secret of
        the owner's key too (without it no id of theirs re-derives from a guess of their words)."""
        salt = f"kvmemory-owner:{owner}"
        if self.sealer is None:
            return hashing.salt_root(salt)
        return hashing.salt_root(f"{salt}:{self.sealer.owner_salt(owner, create=not self.read_only)}")

    # ---------------------------------------------------------------- queries
    @property
    def n_blocks(self) -> int:
        """Committed blocks (not reclaimed by gc)."""
        return self.manifest.n_blocks

    @property
    def next_row(self) -> int:
        """Row of the first block the next commit appends."""
        return self.manifest.next_row

    def is_committed(self, row: int) -> bool:
        return self.manifest.is_committed(int(row))

    def row_of(self, block_id: bytes) -> int | None:
        with self._mutex:
            if self._ids is None:
                self._ids = {}
                for bid, row in self.manifest.ids():
                    self._ids.setdefault(bid, row)
            return self._ids.get(block_id)

    @property
    def loaded_metadata_chunks(self) -> int:
        """How many metadata chunks this object has read (opening reads none)."""
        return len(self._chunks)

    def refresh(self) -> None:
        """Pick up commits made by other processes since this store was opened (one stat if none)."""
        with self._mutex:
            self._after_records(read_new_records(self.files, self.manifest))

    def _after_records(self, records: list[CommitRecord]) -> None:
        """Bring the id map (if built) up to date with records just applied: only what they changed."""
        if self._ids is None:
            return
        for rec in records:
            if rec.n_new:
                raw = bytes.fromhex(rec.ids)
                for i in range(rec.n_new):
                    self._ids.setdefault(raw[i * 16:(i + 1) * 16], rec.start + i)
            for r in rec.freed:
                bid = self.manifest.id_of(r)
                if self._ids.get(bid) == r:
                    del self._ids[bid]

    def chain(self, last_row: int) -> list[int]:
        """Rows from position 0 to last_row, following parent pointers."""
        rows = []
        row = int(last_row)
        while row != -1:
            if not self.is_committed(row) or len(rows) > self.manifest.n_blocks:
                raise StoreCorruptError(f"store {self.name}: broken parent chain at row {row}")
            rows.append(row)
            row = int(self.block_meta([row])["parent"][0])
        return rows[::-1]

    def block_meta(self, rows: Sequence[int]) -> dict[str, np.ndarray]:
        """tokens, positions, n_tokens, parent, block_id, digest of the given committed rows.

        Metadata chunks are read on first use (contiguous chunks in one request) and kept."""
        rows = [int(r) for r in rows]
        S = self.manifest.shard_blocks
        with self._mutex:
            need = sorted({r // S for r in rows} - self._chunks.keys())
            for c0, c1 in runs(need):
                parts = {name: self._read(name, c0 * S, c1 * S) for name in meta_arrays(self.manifest)}
                for c in range(c0, c1):
                    self._chunks[c] = {name: a[(c - c0) * S:(c - c0 + 1) * S] for name, a in parts.items()}
            chunks = self._chunks
        out = {} if self.sealer is None else _SealedMeta(self, rows)
        for name in meta_arrays(self.manifest):
            a = self._arr[name]
            buf = np.empty((len(rows), *a.shape[1:]), a.dtype)
            for i, r in enumerate(rows):
                buf[i] = chunks[r // S][name][r % S]
            dict.__setitem__(out, name, buf)
        return out

    def token_ids(self, rows: Sequence[int], verified: bool = False) -> list[int]:
        """The token ids the given committed rows hold, in order (each block's valid tokens); verified: read
        through verified_meta (each block's id re-derives from its tokens: tokens a window is computed from)."""
        meta = self.verified_meta(rows) if verified else self.block_meta(rows)
        return [int(t) for toks, n in zip(meta["tokens"], meta["n_tokens"]) for t in toks[:n]]

    def _read(self, name: str, start: int, stop: int) -> np.ndarray:
        try:
            return self._arr[name][start:stop]
        except Exception as e:
            raise StoreCorruptError(f"store {self.name}: cannot read {name} rows {start}..{stop - 1}: {e}") from None

    def verified_meta(self, rows: Sequence[int]) -> dict[str, np.ndarray]:
        """block_meta of committed rows whose ids re-derive from their parent's id, tokens and positions,
        and whose positions are consecutive: metadata a RoPE shift or a graft may rely on."""
        rows = [int(r) for r in rows]
        self._check_committed(rows)
        meta = self.block_meta(rows)
        parents = [int(p) for p in meta["parent"]]
        pmeta = self.block_meta([p for p in parents if p >= 0])
        pid = iter(pmeta["block_id"])
        fp = self.manifest.fingerprint
        for i, r in enumerate(rows):
            n = int(meta["n_tokens"][i])
            pos = meta["positions"][i][:n]
            parent_id = next(pid).tobytes() if parents[i] >= 0 else self.manifest.root_of(r)
            bid = meta["block_id"][i].tobytes()
            if not (0 < n <= self.manifest.block_tokens) or np.any(np.diff(pos) != 1) or \
                    hashing.block_id(fp, parent_id, meta["tokens"][i][:n], pos) != bid or \
                    self.manifest.id_of(r) != bid:
                raise StoreCorruptError(f"store {self.name}: block {bid.hex()} (row {r}): its id does not match "
                                        "its parent, tokens and positions")
        return meta

    def _check_committed(self, rows: Iterable[int]) -> None:
        for r in rows:
            if not self.is_committed(r):
                why = "was reclaimed by gc" if r in self.manifest.freed else "is not committed"
                raise StoreCorruptError(f"store {self.name}: row {r} {why}")

    def read_kv(self, rows: Sequence[int], verify: bool = True) -> tuple[np.ndarray, np.ndarray]:
        """KV of committed rows, digest-checked. Returns (kv [k, L, 2, H, C, D], n_tokens [k]): the
        model's KV words (a store that is not exact: decoded, after the stored words' digests).

        Raises StoreCorruptError naming the first bad block.
        """
        kv, n = self._read_stored(rows, verify)
        return self.encoding.decode(kv), n

    def _read_stored(self, rows: Sequence[int], verify: bool = True) -> tuple[np.ndarray, np.ndarray]:
        rows = [int(r) for r in rows]
        self._check_committed(rows)
        meta = self.block_meta(rows)
        if self._direct is not None:
            kv = np.empty((len(rows), *self._arr["kv"].shape[1:]), dtype=self._arr["kv"].dtype)

            def read() -> None:
                shards.read_blocks(self._kv_dir, rows, kv, self._direct.per_shard)
                if verify:                       # inside: a damaged disk-tier copy is fetched again
                    self._check_digests(rows, kv, meta)
            self._cached_read(rows, read)
        else:
            parts = [self._read("kv", start, stop) for start, stop in runs(rows)]
            kv = parts[0] if len(parts) == 1 else np.concatenate(parts)
            if verify:
                self._check_digests(rows, kv, meta)
        if self.sealer is not None:       # digests checked on the ciphertext: now the GCM tags
            self._open_blocks(rows, kv, meta)
        return kv, meta["n_tokens"]

    def _open_blocks(self, rows: list[int], kv: np.ndarray, meta: dict) -> None:
        """Decrypt blocks in place, on the reader threads (AES-GCM lets go of the GIL)."""
        sealer = self.sealer
        assert sealer is not None

        def one(i: int) -> None:
            bid = meta["block_id"][i].tobytes()
            sealer.open_kv(meta["seal"][i], bid, kv[i], f"block {bid.hex()} (row {rows[i]})")
        if len(rows) < 2:
            for i in range(len(rows)):
                one(i)
            return
        list(shards.READERS.map(one, range(len(rows))))

    def read_state_kv(self, rows: Sequence[int]) -> np.ndarray:
        """Blocks of a chain concatenated along tokens, digest-checked: [L, 2, H, T, D] storage words
        (of the model's KV: a store that is not exact decodes them)."""
        rows = [int(r) for r in rows]
        self._check_committed(rows)
        meta = self.block_meta(rows)
        n = [int(x) for x in meta["n_tokens"]]
        shape = self._arr["kv"].shape
        want = (shape[1], shape[2], shape[3], sum(n), shape[5])
        if self._direct is not None and self.sealer is not None:
            res = shards.host_buffer(want, self._arr["kv"].dtype)
            sealer = self.sealer

            def open_block(i: int, block: np.ndarray) -> np.ndarray:
                bid = meta["block_id"][i]
                self._check_digest(rows[i], block, n[i], meta["digest"][i], bid)     # the ciphertext's
                return sealer.open_kv_view(meta["seal"][i], bid.tobytes(), block,
                                           f"block {bid.tobytes().hex()} (row {rows[i]})")
            self._cached_read(rows, lambda: shards.read_state_sealed(
                self._kv_dir, rows, n, res, self._direct.per_shard, tuple(shape[1:]), open_block))
            return res
        if self._direct is None:      # compressed chunks: zarr decodes (and a sealed block is decrypted whole),
            # then one concatenation
            res = np.zeros(want, dtype=self._arr["kv"].dtype)
            if rows:
                kv, _ = self._read_stored(rows)
                np.concatenate([kv[i][:, :, :, :n[i]] for i in range(len(rows))], axis=3, out=res)
            return res
        res = shards.host_buffer(want, self._arr["kv"].dtype)
        self._cached_read(rows, lambda: shards.read_state(
            self._kv_dir, rows, n, [d.tobytes() for d in meta["digest"]], [b.tobytes().hex() for b in meta["block_id"]],
            res, self._direct.per_shard))
        return self.encoding.decode(res)

    def errors(self, rows: Sequence[int]) -> np.ndarray | None:
        """The measured error of each row's block ([k, 3]: encoding.ERROR_FIELDS), None in an exact store."""
        return self.block_meta(rows)["error"] if self.encoding.lossy else None

    def error_report(self, rows: Sequence[int] | None) -> dict | None:
        """What grafting these rows (None: every committed block) costs against their exact blocks
        (None in an exact store): the largest per-block error measured when they were encoded
        (kvmemory/compact.py). Every block: the error array alone is read, no other metadata."""
        if not self.encoding.lossy:
            return None
        if rows is None:
            rows = self.manifest.committed_rows()
            err = self._read("error", 0, self.manifest.rows_end)[rows] if rows else np.zeros((0, 3), np.float32)
        else:
            rows = list(dict.fromkeys(int(r) for r in rows))
            err = self.errors(rows) if rows else np.zeros((0, 3), np.float32)
        return error_summary(self.encoding.name, err)

    def _check_digests(self, rows: list[int], kv: np.ndarray, meta: dict) -> None:
        for i, r in enumerate(rows):
            self._check_digest(r, kv[i], int(meta["n_tokens"][i]), meta["digest"][i], meta["block_id"][i])

    def _shard_key(self, shard: int) -> str:
        return "data/kv/c/" + "/".join([str(shard)] + ["0"] * (self._arr["kv"].ndim - 1))

    def _cached_read(self, rows: list[int], read: Callable[[], object]) -> None:
        """Run a direct read of `rows`. On an object store: first bring their shard objects to the
        disk tier; a read that fails (a damaged or evicted copy) drops the copies and fetches them
        once more, and what fails then is reported as it is."""
        if self.cache is None:
            read()
            return
        S = self._direct.per_shard
        want: dict[str, int] = {}
        for r in rows:
            k = self._shard_key(r // S)
            want[k] = want.get(k, 0) + 1
        self.cache.ensure(want)
        try:
            read()
        except StoreCorruptError:
            self.cache.drop(want)
            self.cache.ensure(want)
            read()
        finally:
            self.cache.trim(keep=())

    def _check_digest(self, row: int, kv: np.ndarray, n: int, want: np.ndarray, bid: np.ndarray) -> None:
        got = block_digest(kv, n)
        if got != want.tobytes():
            raise StoreCorruptError(
                f"store {self.name}: block {bid.tobytes().hex()} (row {row}) failed its digest check: "
                f"stored {want.tobytes().hex()}, read {got.hex()}")

    def verify_all(self, progress=None) -> list[tuple[int, str]]:
        """E1 over every committed block: KV digest, the id re-derived from parent, tokens, positions,
        and the id the commit log recorded. Returns [(row, reason)] of bad blocks; empty if all are good."""
        bad = []
        rows = self.manifest.committed_rows()
        for part in range(0, len(rows), 64):
            chunk = rows[part:part + 64]
            for row in chunk:
                try:
                    parent = int(self.verified_meta([row])["parent"][0])
                    if parent >= row or (parent >= 0 and not self.is_committed(parent)):
                        raise StoreCorruptError(f"block (row {row}): its parent row {parent} is not an earlier "
                                                "committed block")
                except KeyDestroyedError:
                    continue              # a forgotten owner's block: unreadable by design until gc
                except StoreCorruptError as e:
                    bad.append((row, str(e)))
                    continue
                try:
                    self.read_kv([row])
                except KeyDestroyedError:
                    continue              # a forgotten owner's block: unreadable by design until gc
                except StoreCorruptError as e:
                    bad.append((row, str(e)))
            if progress is not None:
                progress.update(len(chunk))
        return bad


    # ---------------------------------------------------------------- sizes
    def disk_bytes(self) -> int:
        """Bytes of the store's committed files (temp files of interrupted writes not counted)."""
        return self.files.total_bytes()
