"""Fast reads of uncompressed sharded KV: chunk bytes straight from the shard files.

Zarr-python's read path costs several copies and an event loop per chunk (~0.7 GB/s here
even from the page cache). For the store's own layout (codec "none": Zarr v3
`sharding_indexed`, inner chunks raw little-endian bytes, index of (offset, nbytes) uint64
pairs plus a crc32c at the end of the file) the bytes of block i are one contiguous range of
one file, so we preadv them straight into the destination buffer, from several threads so
cold reads keep the disk's queue full. Nothing here is trusted: every block read this way
is digest-checked by the caller, so a wrong offset can only raise, never return wrong bytes.
"""

from __future__ import annotations

import json
import mmap
import os
import threading
from dataclasses import dataclass
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import google_crc32c
import numpy as np

from kvmemory import hashing
from kvmemory.errors import StoreCorruptError

_MISSING = 2**64 - 1
_READERS = ThreadPoolExecutor(max_workers=8, thread_name_prefix="kvmemory-read")
READERS = _READERS                 # also what decrypts an encrypted store's blocks (AES-GCM lets go of the GIL)


@dataclass(frozen=True)
class Layout:
    per_shard: int        # blocks per shard file
    block_bytes: int      # bytes of one raw block
    raw: bool             # inner chunks are raw little-endian bytes (readable in place)


def layout_of(zarr_json: str) -> Layout | None:
    """The shard layout of an array (the text of its zarr.json) if it is kvmemory's (sharding_indexed,
    one block per inner chunk, index of (offset, nbytes) pairs + crc32c at the end); None otherwise."""
    meta = json.loads(zarr_json)
    codecs = meta.get("codecs", [])
    if len(codecs) != 1 or codecs[0].get("name") != "sharding_indexed":
        return None
    cfg = codecs[0]["configuration"]
    inner = [c["name"] for c in cfg.get("codecs", [])]
    index = [c["name"] for c in cfg.get("index_codecs", [])]
    endian = [c.get("configuration", {}).get("endian", "little") for c in cfg.get("codecs", [])
              if c["name"] == "bytes"]
    if not inner or inner[0] != "bytes" or index != ["bytes", "crc32c"] or cfg.get("index_location", "end") != "end" \
            or endian != ["little"] or meta.get("chunk_key_encoding", {}).get("name") != "default":
        return None
    chunk = cfg["chunk_shape"]
    shard = meta["chunk_grid"]["configuration"]["chunk_shape"]
    if chunk[0] != 1 or list(chunk[1:]) != list(shard[1:]):
        return None
    itemsize = np.dtype(meta["data_type"]).itemsize
    return Layout(shard[0], int(np.prod(chunk)) * itemsize, inner == ["bytes"])


def rewrite_shard(path: Path, keep: set[int], per_shard: int) -> int:
    """Rewrite a shard file with only the inner chunks `keep` (indices within the shard), their bytes
    copied unchanged: temp file, fsync, rename, fsync of the directory. Returns bytes freed (0 if
    nothing was to drop). Readers that opened the old file keep reading it whole."""
    fd, size, index = _open_shard(path, per_shard, "")
    try:
        drop = [i for i in range(per_shard) if i not in keep and int(index[i, 0]) != _MISSING]
        if not drop:
            return 0
        new_index = np.full((per_shard, 2), _MISSING, dtype="<u8")
        body = bytearray()
        for i in sorted(keep):
            off, n = (int(x) for x in index[i])
            if off == _MISSING:
                continue
            data = os.pread(fd, n, off)
            if len(data) != n:
                raise StoreCorruptError(f"shard file {path}: short read of inner chunk {i}")
            new_index[i] = (len(body), n)
            body += data
    finally:
        os.close(fd)
    body += _index_tail(new_index)
    tmp = path.with_name(f".{path.name}.gc.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        _write_all(fd, body)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return size - len(body)


def write_shards(array_dir: Path, start: int, blocks: np.ndarray, per_shard: int) -> list[Path]:
    """Write rows [start, start + k) of a raw sharded array (blocks: [k, ...block shape]) as new shard
    files, byte for byte what zarr-python writes for them (tests/store/test_shards.py): each
    file holds its rows' raw chunks in row order, then the index of (offset, nbytes) pairs (rows it
    does not hold: missing) and the index's crc32c. start is a shard boundary (a commit's first
    row). One write per file instead of zarr's codec pipeline (~47 ms of a 256-token block's
    commit here, against a few for the bytes). The caller fsyncs the files. Returns their paths."""
    if start % per_shard:
        raise ValueError(f"row {start} does not start a shard of {per_shard}")
    ndim = blocks.ndim - 1
    paths = []
    for s0 in range(0, len(blocks), per_shard):
        part = blocks[s0:s0 + per_shard]
        index = np.full((per_shard, 2), _MISSING, dtype="<u8")
        n = part[0].nbytes
        for i in range(len(part)):
            index[i] = (i * n, n)
        path = array_dir / "c" / str((start + s0) // per_shard) / "/".join(["0"] * ndim)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            _write_all(fd, np.ascontiguousarray(part, dtype=part.dtype.newbyteorder("<")))
            _write_all(fd, _index_tail(index))
        finally:
            os.close(fd)
        paths.append(path)
    return paths


def _index_tail(index: np.ndarray) -> bytes:
    """The end of a shard file: its index of (offset, nbytes) pairs, little-endian, and their crc32c."""
    raw = index.astype("<u8").tobytes()
    return raw + np.uint32(google_crc32c.value(raw)).tobytes()


def _write_all(fd: int, data) -> None:
    """Write every byte of `data` (bytes or a C-contiguous array) at fd's position."""
    view = memoryview(data).cast("B")
    while view:
        view = view[os.write(fd, view):]


HUGE_MIN_BYTES = 32 << 20


def host_buffer(shape, dtype) -> np.ndarray:
    """An uninitialised C-contiguous array. Large ones are anonymous memory advised for transparent
    huge pages: a fresh buffer is written once by the reads, and 2 MiB pages fault 512x less often
    than 4 KiB ones (a cold restore of a few hundred MB spends a good part of its time in faults)."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape)) * dtype.itemsize
    if nbytes < HUGE_MIN_BYTES or not hasattr(mmap, "MADV_HUGEPAGE"):
        return np.empty(shape, dtype)
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        buf.madvise(mmap.MADV_HUGEPAGE)
    except OSError:
        pass
    return np.frombuffer(buf, dtype=dtype).reshape(shape)


def read_blocks(array_dir: Path, rows: list[int], out: np.ndarray, blocks_per_shard: int) -> None:
    """Fill out[i] with the raw chunk of block rows[i]. out: [k, ...block shape], C-contiguous."""
    by_shard: dict[int, list[int]] = {}
    for i, r in enumerate(rows):
        by_shard.setdefault(r // blocks_per_shard, []).append(i)
    ndim = out.ndim - 1
    jobs = [_READERS.submit(_read_shard, array_dir / "c" / str(s) / "/".join(["0"] * ndim), s, idx, rows, out,
                            blocks_per_shard) for s, idx in by_shard.items()]
    for j in jobs:
        j.result()


_LOCAL = threading.local()


def _block_buffer(shape: tuple[int, ...], dtype) -> np.ndarray:
    """This thread's buffer of one block (reused: a fresh 6 MB array a block costs its page faults)."""
    need = int(np.prod(shape)) * np.dtype(dtype).itemsize
    buf = getattr(_LOCAL, "block", None)
    if buf is None or buf.nbytes < need:
        buf = _LOCAL.block = np.empty(need, np.uint8)
    return buf[:need].view(dtype).reshape(shape)


def read_state_sealed(array_dir: Path, rows: list[int], n_tokens: list[int], out: np.ndarray,
                      blocks_per_shard: int, block_shape: tuple[int, ...], open_block) -> None:
    """read_state for an encrypted store: each block is read whole (its ciphertext: the GCM tag covers
    the padding too), then open_block(i, block) checks its digest, decrypts it and returns its
    plaintext [L, 2, H, C, D], whose first n tokens are copied to their place in out. One job per
    shard file, as read_state: reading one block overlaps decrypting another."""
    starts = np.concatenate([[0], np.cumsum(n_tokens)]).astype(int)
    by_shard: dict[int, list[int]] = {}
    for i, r in enumerate(rows):
        by_shard.setdefault(r // blocks_per_shard, []).append(i)

    def shard_job(shard: int, idx: list[int]) -> None:
        path = array_dir / "c" / str(shard) / "/".join(["0"] * len(block_shape))
        for i in sorted(idx, key=lambda i: rows[i]):
            buf = _block_buffer((1, *block_shape), out.dtype)
            _read_shard(path, shard, [0], [rows[i]], buf, blocks_per_shard)
            t0, n = int(starts[i]), int(n_tokens[i])
            out[:, :, :, t0:t0 + n] = open_block(i, buf[0])[:, :, :, :n]
    jobs = [_READERS.submit(shard_job, s, idx) for s, idx in by_shard.items()]
    for j in jobs:
        j.result()


def _open_shard(path: Path, per_shard: int, what: str) -> tuple[int, int, np.ndarray]:
    """Open a shard file: (fd, size, index [per_shard, 2] of (offset, nbytes)). The caller closes fd."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        raise StoreCorruptError(f"{what}shard file {path} is missing") from None
    try:
        size = os.fstat(fd).st_size
        index_bytes = per_shard * 16 + 4                   # (offset, nbytes) uint64 pairs + crc32c
        if size < index_bytes:
            raise StoreCorruptError(f"{what}shard file {path} is truncated ({size} bytes)")
        raw = os.pread(fd, index_bytes, size - index_bytes)[:-4]
        return fd, size, np.frombuffer(raw, dtype="<u8").reshape(per_shard, 2)
    except BaseException:
        os.close(fd)
        raise


def _read_shard(path: Path, shard: int, idx: list[int], rows: list[int], out: np.ndarray, per_shard: int) -> None:
    want = out[0].nbytes
    fd, size, index = _open_shard(path, per_shard, "")
    try:
        for i in idx:
            off, n = (int(x) for x in index[rows[i] - shard * per_shard])
            if off == _MISSING or n != want or off + n > size:
                raise StoreCorruptError(f"shard file {path}: block row {rows[i]} is missing or has a bad index entry")
            got = os.preadv(fd, [memoryview(out[i]).cast("B")], off)
            if got != n:
                raise StoreCorruptError(f"shard file {path}: short read of block row {rows[i]}")
    finally:
        os.close(fd)


def read_state(array_dir: Path, rows: list[int], n_tokens: list[int], digests: list[bytes], names: list[str],
               out: np.ndarray, blocks_per_shard: int) -> None:
    """Scatter whole blocks straight into a state's token-major layout, verifying each digest.

    A block's chunk is [L, 2, H, C, D] in C order: L*2*H runs of C*D words, and run (l, kv, h)
    belongs at out[l, kv, h, t0:t0+n, :], which is contiguous. One preadv per block with an
    iovec per run (the padding of a partial block goes to a scratch buffer) moves the bytes
    once, from the page cache to their final place. out: [L, 2, H, T, D] C-contiguous.
    """
    starts = np.concatenate([[0], np.cumsum(n_tokens)]).astype(int)
    # one job per shard file, its blocks in file order: each file is then read sequentially
    # (the kernel's readahead follows it), the files in parallel. One job per block interleaves
    # several threads inside one file, which reads a cold store ~30% slower.
    by_shard: dict[int, list[int]] = {}
    for i, r in enumerate(rows):
        by_shard.setdefault(r // blocks_per_shard, []).append(i)

    def shard_job(idx: list[int]) -> None:
        for i in sorted(idx, key=lambda i: rows[i]):
            _scatter_block(array_dir, rows[i], int(starts[i]), int(n_tokens[i]), digests[i], names[i], out,
                           blocks_per_shard)
    jobs = [_READERS.submit(shard_job, idx) for idx in by_shard.values()]
    for j in jobs:
        j.result()


def _scatter_block(array_dir: Path, row: int, t0: int, n: int, want_digest: bytes, name: str, out: np.ndarray,
                   per_shard: int) -> None:
    L, two, H, _, D = out.shape
    shard = row // per_shard
    path = array_dir / "c" / str(shard) / "/".join(["0"] * 5)
    fd, size, index = _open_shard(path, per_shard, f"block {name} (row {row}): ")
    try:
        off, nbytes = (int(x) for x in index[row - shard * per_shard])
        run = nbytes // (L * two * H)                      # bytes of one (l, kv, h) run: C * D words
        valid = n * D * out.itemsize
        if off == _MISSING or nbytes % (L * two * H) or valid > run or off + nbytes > size:
            raise StoreCorruptError(f"block {name} (row {row}): missing or bad entry in the index of {path}")
        dst = out.reshape(L * two * H, out.shape[3] * D)   # a view: out is C-contiguous
        pad = bytearray(run - valid) if run > valid else None
        iov = []
        for j in range(L * two * H):
            iov.append(memoryview(dst[j, t0 * D:(t0 + n) * D]).cast("B"))
            if pad is not None:
                iov.append(pad)
        got = 0
        for k in range(0, len(iov), 1024):                 # IOV_MAX
            part = iov[k:k + 1024]
            got += os.preadv(fd, part, off + got)
        if got != nbytes:
            raise StoreCorruptError(f"block {name} (row {row}): short read from {path}")
    finally:
        os.close(fd)
    # the runs in order are the block's [L, 2, H, n, D] bytes: the same digest as the writer's
    got = hashing.digest(*(dst[j, t0 * D:(t0 + n) * D] for j in range(L * two * H)))
    if got != want_digest:
        raise StoreCorruptError(f"block {name} (row {row}) failed its digest check: stored {want_digest.hex()}, "
                                f"read {got.hex()}")
