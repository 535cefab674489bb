import json

import pytest

from kvmemory.errors import StoreCorruptError, StoreError
from kvmemory.store.durable import write_new_file
from kvmemory.store.files import LocalFiles
from kvmemory.store.log import read_manifest, write_header, write_record
from kvmemory.store.manifest import CommitRecord, DocEntry, Manifest, StateEntry


def _m(**kw):
    base = dict(fingerprint="kvm1-x", model={"name": "m", "layers": 2}, block_tokens=4, shard_blocks=2,
                codec="none", kv_dtype="float32")
    base.update(kw)
    return Manifest(**base)


def _ids(n: int, seed: int = 0) -> str:
    return "".join(f"{seed:08x}{i:024x}" for i in range(n))


def test_header_and_records_replay(tmp_path):
    write_header(LocalFiles(tmp_path), _m())
    write_record(LocalFiles(tmp_path), CommitRecord(commit=1, start=0, ids=_ids(3), tokens=10, time=1.0,
                                        states={"ab": StateEntry(last_row=2, n_tokens=10, label="x", created=1.5)}))
    write_record(LocalFiles(tmp_path), CommitRecord(commit=2, start=4, ids=_ids(1, 1), tokens=4, time=2.0,
                                        docs={"d": DocEntry(rows=[4], n_tokens=4, segments=1)}))
    m = read_manifest(LocalFiles(tmp_path))
    assert m.commit == 2 and m.n_blocks == 4 and m.stored_tokens == 14 and m.next_row == 6
    assert m.states["ab"].label == "x" and m.docs["d"].rows == [4]
    assert [m.is_committed(r) for r in range(7)] == [True, True, True, False, True, False, False]
    assert m.id_of(4) == bytes.fromhex(_ids(1, 1))


def test_header_is_never_overwritten(tmp_path):
    write_header(LocalFiles(tmp_path), _m())
    with pytest.raises(StoreError, match="already exists"):
        write_header(LocalFiles(tmp_path), _m(fingerprint="kvm1-other"))
    assert read_manifest(LocalFiles(tmp_path)).fingerprint == "kvm1-x"


def test_failed_write_leaves_nothing(tmp_path, monkeypatch):
    import kvmemory.store.durable as mod

    def boom(*a):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(mod.os, "fsync", boom)
    with pytest.raises(StoreError, match="disk full"):
        write_new_file(tmp_path / "x.json", b"{}")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("text", ["{", "[]", json.dumps({"format": "other"}), json.dumps({"format": "kvmemory-store",
                                                                                          "version": 99})])
def test_bad_header_is_corrupt(tmp_path, text):
    (tmp_path / "manifest.json").write_text(text)
    with pytest.raises(StoreCorruptError):
        read_manifest(LocalFiles(tmp_path))


def test_record_pointing_past_blocks_is_corrupt(tmp_path):
    write_header(LocalFiles(tmp_path), _m())
    write_record(LocalFiles(tmp_path), CommitRecord(commit=1, start=0, ids=_ids(1), states={"a": StateEntry(last_row=4,
                                                                                                 n_tokens=3)}))
    with pytest.raises(StoreCorruptError, match="not committed"):
        read_manifest(LocalFiles(tmp_path))


def test_record_off_a_shard_boundary_is_corrupt(tmp_path):
    write_header(LocalFiles(tmp_path), _m())
    write_record(LocalFiles(tmp_path), CommitRecord(commit=1, start=0, ids=_ids(1)))
    write_record(LocalFiles(tmp_path), CommitRecord(commit=2, start=1, ids=_ids(1, 2)))   # must start at 2
    with pytest.raises(StoreCorruptError, match="shard boundary"):
        read_manifest(LocalFiles(tmp_path))


def test_roots_of_salted_chains_replay_and_records_without_them_are_unchanged(tmp_path):
    root = "ab" * 16
    plain = CommitRecord(commit=1, start=0, ids=_ids(2), tokens=8, time=1.0)
    assert "roots" not in json.loads(plain.to_json())        # what a store without salted chains always wrote
    write_header(LocalFiles(tmp_path), _m())
    write_record(LocalFiles(tmp_path), plain)
    write_record(LocalFiles(tmp_path), CommitRecord(commit=2, start=2, ids=_ids(2, 1), tokens=8, time=2.0,
                                                    roots={"2": root}))
    m = read_manifest(LocalFiles(tmp_path))
    assert m.roots == {2: bytes.fromhex(root)} and m.root_of(2) == bytes.fromhex(root) and m.root_of(0) == bytes(16)
    again = _m()
    again.load_snapshot(m.snapshot_json(), "snapshot")
    assert again.roots == m.roots


@pytest.mark.parametrize("roots", [{"5": "ab" * 16}, {"0": "ab"}, {"0": "zz" * 16}])
def test_a_root_outside_its_commit_or_malformed_is_corrupt(tmp_path, roots):
    write_header(LocalFiles(tmp_path), _m())
    write_record(LocalFiles(tmp_path), CommitRecord(commit=1, start=0, ids=_ids(2), roots=roots))
    with pytest.raises(StoreCorruptError):
        read_manifest(LocalFiles(tmp_path))
