"""The store conformance suite on a local directory."""

import hashlib

import pytest

from kvmemory.store import BlockStore
from tests.store.conformance import StoreTests
from tests.store.test_block_store import make_store


class TestLocalStore(StoreTests):
    @pytest.fixture
    def where(self, tmp_path):
        return tmp_path / "s"

    def make(self, where, **kw):
        return make_store(where, **kw)

    def reopen(self, where):
        return BlockStore.open(where, read_only=False)

    def files(self, where) -> dict:
        return {str(p.relative_to(where)): hashlib.sha256(p.read_bytes()).hexdigest()
                for p in where.rglob("*") if p.is_file() and p.name != ".lock"}
