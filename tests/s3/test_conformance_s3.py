"""The store conformance suite on an S3-compatible object store (moto's server on 127.0.0.1)."""

import itertools

import pytest

from tests.s3.test_s3_store import _etags, make_remote, open_remote
from tests.store.conformance import StoreTests


class TestS3Store(StoreTests):
    @pytest.fixture
    def where(self, s3, tmp_path):
        return s3, tmp_path, itertools.count()

    def make(self, where, **kw):
        s3, tmp, n = where
        return make_remote(s3.url(), tmp / f"w{next(n)}", **kw)

    def reopen(self, where):
        s3, tmp, n = where
        return open_remote(s3.url(), tmp / f"w{next(n)}")     # its own work dir: nothing cached

    def files(self, where) -> dict:
        return _etags(where[0])
