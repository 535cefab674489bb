"""E1-E3 with the real model on a store on the object store (moto's server): restored at the same
position, the logits equal a clean block-chunked computation bit for bit; E2's recompute check
passes, then fails after a byte of an object is flipped."""

from __future__ import annotations

import pytest
import torch

import kvmemory
from tests.test_exactness import _graft_and_fresh, _real_text

pytestmark = pytest.mark.real_model


def test_e3_same_position_graft_from_s3_is_bit_exact(s3, tmp_path, real_model, rng):
    model, tok = real_model
    url = s3.url("e3")
    samples = []
    with kvmemory.Memory(url, model=real_model, work_dir=tmp_path / "writer") as mem:
        C = mem.block_tokens
        for n in (1, C - 1, C, C + 1, rng.randint(2, 3 * C), rng.randint(2, 3 * C)):
            ids = _real_text(rng, tok, n) if n % 2 else [rng.randrange(49152) for _ in range(n)]
            suffix = [rng.randrange(49152) for _ in range(rng.randrange(1, 9))]
            samples.append((ids, suffix, mem.save(ids).id))
    with kvmemory.Memory(url, model=real_model, work_dir=tmp_path / "reader") as mem:   # every byte from S3
        for ids, suffix, sid in samples:
            graft, fresh = _graft_and_fresh(model, mem.load(sid), ids, suffix, C)
            assert torch.equal(graft, fresh), len(ids)
        assert mem.store.cache.stats.shards_fetched > 0


def test_e2_recompute_on_s3_then_a_flipped_byte_in_an_object(s3, tmp_path, real_model, rng):
    url = s3.url("e2")
    with kvmemory.Memory(url, model=real_model, work_dir=tmp_path / "w1") as mem:
        ids = [rng.randrange(49152) for _ in range(600)]
        mem.save(ids)
        assert mem.verify(recompute=True) == []
    key = next(k for k in s3.keys("e2/data/kv/c/"))
    obj = bytearray(s3.client.get_object(Bucket=s3.bucket, Key=key)["Body"].read())
    obj[len(obj) // 3] ^= 0x10
    s3.client.put_object(Bucket=s3.bucket, Key=key, Body=bytes(obj))
    with kvmemory.Memory(url, model=real_model, work_dir=tmp_path / "w2") as mem:
        bad = mem.verify(recompute=True)
        assert bad and all("block" in why for _, why in bad)
        assert mem.verify() != []
        with pytest.raises(kvmemory.StoreCorruptError):
            mem.load(next(iter(mem.store.manifest.states)))
