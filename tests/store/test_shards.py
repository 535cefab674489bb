"""The direct shard writer (kvmemory/store/shards.py write_shards) against zarr-python: the same rows
written both ways are the same files, byte for byte, and zarr reads the direct ones back."""

import numpy as np
import pytest
import zarr

from kvmemory.store import shards
from kvmemory.store.layout import create_arrays
from kvmemory.store.manifest import Manifest

L, H, C, D, S = 2, 3, 8, 4, 4


def _arrays(root, kv_dtype):
    m = Manifest(fingerprint="kvm1-test", block_tokens=C, shard_blocks=S, codec="none", kv_dtype=kv_dtype,
                 model={"name": "synthetic", "layers": L, "kv_heads": H, "head_dim": D, "max_positions": 64})
    zs = zarr.storage.LocalStore(str(root))
    create_arrays(zs, m)
    return zarr.open_group(store=zs, mode="r+", zarr_format=3)


@pytest.mark.parametrize("kv_dtype, start, k", [("float32", 4, 6), ("float32", 0, 1), ("bfloat16", 8, 4),
                                                 ("float32", 12, 9)])
def test_direct_shards_are_the_files_zarr_writes(tmp_path, rng, kv_dtype, start, k):
    a = _arrays(tmp_path / "a", kv_dtype)
    _arrays(tmp_path / "b", kv_dtype)                 # the same arrays, their kv shards written directly
    dtype = a["kv"].dtype
    gen = np.random.default_rng(rng.randrange(2**31))
    kv = gen.integers(0, 2**16 if dtype.itemsize == 2 else 2**31, size=(k, L, 2, H, C, D)).astype(dtype)
    kv[0] = 0                                           # an all-zero block is still a block
    assert shards.layout_of((tmp_path / "a" / "kv" / "zarr.json").read_text()).raw
    with zarr.config.set({"array.write_empty_chunks": True}):
        a["kv"][start:start + k] = kv
    paths = shards.write_shards(tmp_path / "b" / "kv", start, kv, S)
    assert len(paths) == -(-k // S)
    files_a = sorted(p.relative_to(tmp_path / "a") for p in (tmp_path / "a" / "kv" / "c").rglob("*") if p.is_file())
    files_b = sorted(p.relative_to(tmp_path / "b") for p in (tmp_path / "b" / "kv" / "c").rglob("*") if p.is_file())
    assert files_a == files_b and len(files_a) == len(paths)
    for f in files_a:
        assert (tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes(), f
    back = zarr.open_group(str(tmp_path / "b"), mode="r")["kv"][start:start + k]
    assert np.array_equal(back.view(np.uint8), kv.view(np.uint8))
    with pytest.raises(ValueError, match="shard"):
        shards.write_shards(tmp_path / "b" / "kv", start + 1, kv[:1], S)
