import json

import pytest

from kvmemory.errors import StoreCorruptError
from kvmemory.manifest import Manifest, StateEntry, read_manifest, write_manifest


def _m(**kw):
    base = dict(fingerprint="kvm1-x", model={"name": "m", "layers": 2}, block_tokens=4, shard_blocks=2,
                codec="none", kv_dtype="float32")
    base.update(kw)
    return Manifest(**base)


def test_roundtrip(tmp_path):
    m = _m(n_blocks=3, commit=2, states={"ab": StateEntry(last_row=2, n_tokens=9, label="x", created=1.5)})
    write_manifest(tmp_path, m)
    assert read_manifest(tmp_path) == m


def test_failed_write_leaves_previous_commit(tmp_path, monkeypatch):
    write_manifest(tmp_path, _m(n_blocks=1, commit=1, states={"a": StateEntry(0, 3)}))
    import kvmemory.manifest as mod

    def boom(*a):
        raise OSError("disk full")
    monkeypatch.setattr(mod.os, "replace", boom)
    with pytest.raises(OSError):
        write_manifest(tmp_path, _m(n_blocks=5, commit=2))
    assert read_manifest(tmp_path).commit == 1


@pytest.mark.parametrize("text", ["{", "[]", json.dumps({"format": "other"}), json.dumps({"format": "kvmemory-store",
                                                                                          "version": 99})])
def test_bad_manifest_is_corrupt(tmp_path, text):
    (tmp_path / "manifest.json").write_text(text)
    with pytest.raises(StoreCorruptError):
        read_manifest(tmp_path)


def test_state_pointing_past_blocks_is_corrupt(tmp_path):
    write_manifest(tmp_path, _m(n_blocks=1, states={"a": StateEntry(last_row=4, n_tokens=3)}))
    with pytest.raises(StoreCorruptError, match="past n_blocks"):
        read_manifest(tmp_path)
