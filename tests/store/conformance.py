"""One conformance suite for every store backend (as zarr-python's StoreTests): a backend's test
module subclasses StoreTests and says how to make, reopen and list a store; the suite checks the
contract every backend keeps. Local disk: tests/store/test_conformance_local.py; S3:
tests/s3/test_conformance_s3.py. What only one backend does (locks, gc, the disk tier) stays in
that backend's own tests."""

from __future__ import annotations

import pytest
import torch

from kvmemory.store import commit as commit_mod
from tests.store.test_block_store import commit_state, random_state, read_state


def _bytes(t):
    return t.contiguous().view(-1).view(torch.uint8)


class StoreTests:
    """Subclasses provide: make(where, **manifest_kw) -> a new writable store; reopen(where) -> a
    fresh reader (its own caches); files(where) -> {name: a value that changes if the file does}."""

    def make(self, where, **kw):
        raise NotImplementedError

    def reopen(self, where):
        raise NotImplementedError

    def files(self, where) -> dict:
        raise NotImplementedError

    @pytest.mark.parametrize("dtype,codec", [(torch.float32, "none"), (torch.float16, "zstd"),
                                             (torch.bfloat16, "none"), (torch.bfloat16, "zstd"),
                                             (torch.float32, "lz4")])
    def test_round_trip_is_byte_exact(self, where, dtype, codec):
        """E1: a fresh reader reads the bytes written, NaN patterns and partial blocks included."""
        gen = torch.Generator().manual_seed(0)
        store = self.make(where, kv_dtype=str(dtype).removeprefix("torch."), codec=codec)
        states = {}
        for n in (1, 3, 4, 5, 9, 16):           # partial, exact and multi-block lengths
            tokens, kv = random_state(gen, n, dtype)
            kv[0, 0, 0, 0, 0] = float("nan")     # odd bit patterns must survive too
            states[commit_state(store, tokens, kv)] = kv
        again = self.reopen(where)
        for sid, kv in states.items():
            got = read_state(again, sid, dtype)
            assert got.dtype == dtype and torch.equal(_bytes(got), _bytes(kv))
        assert again.verify_all() == []

    def test_equal_prefixes_share_blocks(self, where):
        gen = torch.Generator().manual_seed(1)
        store = self.make(where)
        tokens, kv = random_state(gen, 10)
        commit_state(store, tokens[:9], kv[:, :, :, :9])
        assert store.n_blocks == 3                      # 4 + 4 + 1
        commit_state(store, tokens, kv)
        assert store.n_blocks == 4                      # shares the two full blocks, adds [8, 9]
        assert len(self.reopen(where).manifest.states) == 2

    def test_a_commit_that_dies_before_its_record_leaves_the_last_commit(self, where, monkeypatch):
        gen = torch.Generator().manual_seed(2)
        store = self.make(where)
        t1, kv1 = random_state(gen, 6)
        sid1 = commit_state(store, t1, kv1)

        def crash(*a, **k):
            raise KeyboardInterrupt("killed after the data, before the commit record")
        with monkeypatch.context() as mp, pytest.raises(KeyboardInterrupt):
            mp.setattr(commit_mod, "write_record", crash)
            commit_state(store, *random_state(gen, 9))
        fresh = self.reopen(where)
        assert fresh.manifest.commit == 1 and list(fresh.manifest.states) == [sid1]
        assert torch.equal(read_state(fresh, sid1), kv1)
        t3, kv3 = random_state(gen, 5)                  # the next commit lands over what was left
        sid3 = commit_state(fresh, t3, kv3)
        again = self.reopen(where)
        assert torch.equal(read_state(again, sid3), kv3) and again.verify_all() == []

    def test_a_reader_sees_another_writers_commits_after_refresh(self, where):
        gen = torch.Generator().manual_seed(3)
        writer = self.make(where)
        reader = self.reopen(where)
        t, kv = random_state(gen, 9)
        sid = commit_state(writer, t, kv)
        assert sid not in reader.manifest.states
        reader.refresh()
        assert torch.equal(read_state(reader, sid), kv)

    def test_a_commit_never_rewrites_a_file(self, where):
        """Every commit only adds files: none that it or another commit wrote changes."""
        gen = torch.Generator().manual_seed(4)
        store = self.make(where, shard_blocks=2)
        commit_state(store, *random_state(gen, 5))
        for n in (3, 1, 9, 4, 13):
            before = self.files(where)
            commit_state(store, *random_state(gen, n))
            after = self.files(where)
            assert [k for k, v in before.items() if after.get(k) != v] == []
            assert len(after) > len(before)
