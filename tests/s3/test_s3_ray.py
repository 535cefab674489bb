"""Ray workers depositing into one store on the object store (moto's server), committing without
a shared lock: the store ends with every document whole and every block verified."""

from __future__ import annotations

import random

import pytest

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.ray

import kvmemory  # noqa: E402
from kvmemory.distributed import ray_add  # noqa: E402
from tests.test_distributed import _blocks, _docs, ray_cluster  # noqa: E402,F401


def test_ray_workers_deposit_into_an_s3_store(ray_cluster, s3, tmp_path, tiny_dir):   # noqa: F811
    files = _docs(tmp_path, random.Random(3), n_docs=2, words=800)
    opts = {"endpoint": s3.endpoint, "access_key_id": "testing", "secret_access_key": "testing",
            "region": "us-east-1", "allow_http": True}
    url = s3.url("ray")
    r = ray_add(url, files, workers=2, model=tiny_dir, segment_blocks=1, storage_options=opts)
    assert r.computed == r.segments and len(r.worker_pids) == 2
    assert any(k.startswith("ray/claims/") for k in s3.keys())
    with kvmemory.Memory(url, model=str(tiny_dir), work_dir=tmp_path / "reader") as mem:
        assert sorted(d.doc_id for d in mem.docs()) == ["doc0.txt", "doc1.txt"]
        assert mem.verify() == []
        with kvmemory.Memory(tmp_path / "local.kvm", model=str(tiny_dir), segment_blocks=1) as local:
            local.add_files(files)
            for f in files:
                assert _blocks(mem, f.name) == _blocks(local, f.name)
