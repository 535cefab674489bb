"""tests/bounds.py: the bounded default, the full size under KVMEMORY_FULL_TESTS=1, an override of its own."""

import importlib

import pytest

import tests.bounds as bounds


@pytest.fixture
def fresh(monkeypatch):
    def load(**env):
        for k in ("KVMEMORY_FULL_TESTS", "KVMEMORY_X"):
            monkeypatch.delenv(k, raising=False)
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        return importlib.reload(bounds)
    yield load
    monkeypatch.delenv("KVMEMORY_FULL_TESTS", raising=False)
    importlib.reload(bounds)


def test_bounded_full_and_overridden(fresh):
    assert fresh().bound("KVMEMORY_X", 3, 30) == 3
    assert fresh(KVMEMORY_FULL_TESTS="1").bound("KVMEMORY_X", 3, 30) == 30
    assert fresh(KVMEMORY_FULL_TESTS="1", KVMEMORY_X="7").bound("KVMEMORY_X", 3, 30) == 7
    with pytest.raises(ValueError, match="KVMEMORY_X"):
        fresh(KVMEMORY_X="0").bound("KVMEMORY_X", 3, 30)
