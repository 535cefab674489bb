"""Deposits on Ray (kvmemory.distributed.ray_add, `kvmemory add --ray`) on a local Ray cluster:
the blocks equal a local add's byte for byte, a worker killed mid-segment is replaced and its
segment recomputed, and nothing half-done becomes visible."""

from __future__ import annotations

import os
import random

import pytest

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.ray

import kvmemory  # noqa: E402
from kvmemory.distributed import ray_add  # noqa: E402
from kvmemory.errors import KVMemoryError  # noqa: E402


@pytest.fixture(scope="module")
def ray_cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, ignore_reinit_error=True)
    yield
    ray.shutdown()


def _docs(tmp_path, rng, n_docs=2, words=700):
    vocab = ("harbour lantern copper meadow signal orchard basalt thimble ferry quarry mill ledger "
             "granite beacon willow tide cart barley forge kettle").split()
    files = []
    for d in range(n_docs):
        f = tmp_path / f"doc{d}.txt"
        f.write_text(" ".join(f"{rng.choice(vocab)}{rng.randrange(100)}" for _ in range(words)) + ".")
        files.append(f)
    return files


def _blocks(mem, doc_id):
    """(block id, KV digest) of a document's blocks, in order."""
    s = mem.store
    meta = s.block_meta(s.manifest.docs[doc_id].rows)
    return [(b.tobytes(), d.tobytes()) for b, d in zip(meta["block_id"], meta["digest"])]


def test_ray_add_stores_what_a_local_add_stores(ray_cluster, tmp_path, tiny_dir, rng):
    files = _docs(tmp_path, rng)
    r = ray_add(tmp_path / "ray.kvm", files, workers=2, model=tiny_dir, segment_blocks=1)
    assert [d.doc_id for d in r.docs] == ["doc0.txt", "doc1.txt"]
    assert r.computed == r.segments > 2 and r.restarts == 0 and len(r.worker_pids) == 2
    assert os.getpid() not in r.worker_pids                      # the driver computed nothing
    with kvmemory.Memory(tmp_path / "local.kvm", model=str(tiny_dir), segment_blocks=1) as local:
        local.add_files(files)
        with kvmemory.Memory(tmp_path / "ray.kvm", model=str(tiny_dir)) as mem:
            for f in files:
                assert _blocks(mem, f.name) == _blocks(local, f.name)      # same ids, same KV bytes
            assert mem.verify() == []
            a = mem.ask("Which word follows harbour?", max_new_tokens=4)
            b = local.ask("Which word follows harbour?", max_new_tokens=4)
            assert a.text == b.text and a.sources == b.sources


def test_a_worker_killed_mid_segment_is_replaced_and_its_segment_recomputed(ray_cluster, tmp_path, tiny_dir, rng):
    files = _docs(tmp_path, rng, n_docs=1, words=900)
    marker = tmp_path / "killed"

    def die_once(key):                  # runs in the worker after the prefill, before the commit
        if key == (0, 1) and not marker.exists():
            marker.write_text(str(os.getpid()))
            os._exit(1)
    r = ray_add(tmp_path / "s.kvm", files, workers=2, model=tiny_dir, segment_blocks=1, hook=die_once)
    assert marker.exists() and r.restarts == 1 and r.computed == r.segments
    with kvmemory.Memory(tmp_path / "s.kvm", model=str(tiny_dir)) as mem:
        assert [d.doc_id for d in mem.docs()] == ["doc0.txt"]
        assert mem.verify() == []
        with kvmemory.Memory(tmp_path / "local.kvm", model=str(tiny_dir), segment_blocks=1) as local:
            local.add_files(files)
            assert _blocks(mem, "doc0.txt") == _blocks(local, "doc0.txt")


def test_a_segment_that_keeps_failing_leaves_nothing_visible_and_a_rerun_resumes(ray_cluster, tmp_path, tiny_dir,
                                                                                  rng):
    files = _docs(tmp_path, rng, n_docs=1, words=900)

    def always_die(key):
        if key == (0, 2):
            os._exit(1)
    with pytest.raises(KVMemoryError, match="failed 2 times"):
        ray_add(tmp_path / "s.kvm", files, workers=2, model=tiny_dir, segment_blocks=1, hook=always_die,
                max_restarts=1)
    with kvmemory.Memory(tmp_path / "s.kvm", model=str(tiny_dir)) as mem:
        assert mem.docs() == []                                  # no document names the stored segments
        stored = mem.store.n_blocks
        assert stored >= 1
    r = ray_add(tmp_path / "s.kvm", files, workers=2, model=tiny_dir, segment_blocks=1)
    assert r.computed < r.segments and [d.doc_id for d in r.docs] == ["doc0.txt"]


@pytest.mark.real_model
def test_ray_add_with_the_real_model(ray_cluster, tmp_path, real_model):
    files = _docs(tmp_path, random.Random(7), n_docs=1, words=500)
    r = ray_add(tmp_path / "ray.kvm", files, workers=2, segment_blocks=1)
    assert r.computed == r.segments >= 2 and len(r.worker_pids) == 2
    with kvmemory.Memory(tmp_path / "local.kvm", model=real_model, segment_blocks=1) as local:
        local.add_files(files)
        with kvmemory.Memory(tmp_path / "ray.kvm", model=real_model) as mem:
            assert _blocks(mem, "doc0.txt") == _blocks(local, "doc0.txt")


def test_cli_add_with_ray(ray_cluster, tmp_path, tiny_dir, rng, capsys):
    from kvmemory.cli import main

    files = _docs(tmp_path, rng, n_docs=2, words=400)
    store = tmp_path / "cli.kvm"
    assert main(["add", str(store), *map(str, files), "--ray", "--workers", "2", "--model", str(tiny_dir),
                 "--segment-blocks", "1"]) == 0
    out = capsys.readouterr().out
    assert "added doc0.txt" in out and "added doc1.txt" in out and "ray: 2 workers" in out
    with kvmemory.Memory(store, model=str(tiny_dir)) as mem:
        assert [d.doc_id for d in mem.docs()] == ["doc0.txt", "doc1.txt"] and mem.verify() == []
    assert main(["add", str(store), str(files[0]), "--ray", "--model", str(tiny_dir)]) == 1   # already there
    assert "already exists" in capsys.readouterr().err
