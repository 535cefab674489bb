"""Encryption at rest on an object store: a scan of every object of an encrypted store and of its
local working directory finds nothing of a user's words (and the same scan of a plain store finds
them all); the store's blocks read back bit-exactly from S3 alone."""

from __future__ import annotations

import pytest
import torch

from tests.store.test_encryption import OTHER, SECRET, files_of, provider, scan, secret_needles, tell


@pytest.mark.parametrize("encrypt", [False, True])
def test_a_scan_of_every_object_finds_the_secret_only_where_it_is_not_encrypted(s3, tmp_path, tiny, encrypt):
    import kvmemory
    ring = tmp_path / "keyring"
    url = s3.url(f"enc-{encrypt}")
    keys = provider(ring) if encrypt else None
    with kvmemory.Memory(url, model=tiny, work_dir=tmp_path / "writer", encrypt=encrypt, keys=keys) as mem:
        alice, bob = mem.chat_memory("alice"), mem.chat_memory("bob")
        tell(alice, SECRET)
        tell(bob, OTHER)
        state = mem.save("Earlier: " + SECRET, owner=alice.key)
        needles = secret_needles(mem, alice)
        local = [p.read_bytes() for p in files_of(mem.path)]
    objects = [s3.client.get_object(Bucket=s3.bucket, Key=k)["Body"].read() for k in s3.keys(f"enc-{encrypt}/")]
    assert len(objects) > 10
    found = scan(objects + local, needles)
    assert found == (set() if encrypt else set(needles))
    keys = provider(ring) if encrypt else None
    with kvmemory.Memory(url, model=tiny, work_dir=tmp_path / "reader", read_only=True, keys=keys) as mem:
        assert torch.equal(mem.load(state.id).kv, state.kv)        # every byte from S3, decrypted
