"""A Memory shared by threads, two processes writing one store, gc, the device policy, typed
errors at the boundary. Tiny random-weight model (the plumbing does not depend on the weights)."""

import os
import random
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch

import kvmemory
from kvmemory.errors import InputError, StoreCorruptError
from tests.clirun import run


def words(rng, n, tag=""):
    vocab = ["river", "lantern", "copper", "meadow", "falcon", "harbor", "quartz", "willow", "ember", "glacier",
             "orchard", "thunder", "velvet", "canyon", "saffron", "beacon"]
    return f"{tag} " + " ".join(rng.choice(vocab) for _ in range(n))


def cli(*args):
    return run(*args, env={**os.environ, "HF_HUB_OFFLINE": "1"}, text=True)


def test_two_processes_adding_at_once_both_end_up_indexed(tmp_path, tiny_dir, rng, monkeypatch):
    store = tmp_path / "s.kvm"
    files = []
    for name in ("one.txt", "two.txt"):
        f = tmp_path / name
        f.write_text(words(rng, 900, tag=f"The {name} document."))
        files.append(f)
    procs = [subprocess.Popen([sys.executable, "-m", "kvmemory.cli", "add", str(store), str(f), "--model",
                               str(tiny_dir), "--segment-blocks", "1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for f in files]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-800:] for o in outs]
    with kvmemory.Memory(store, model=str(tiny_dir)) as mem:
        assert {d.doc_id for d in mem.docs()} == {"one.txt", "two.txt"}
        docs = mem.documents

        def no_rebuild(*a, **k):
            raise AssertionError("an index had to be rebuilt: one process's entries were lost")
        monkeypatch.setattr(docs, "rebuild", no_rebuild)
        live = docs.live_rows()
        from kvmemory.index import windows as win
        for kind in ("dense", "bm25", "keys"):
            assert live <= {win.row_of(i) for i in docs.index(kind).ids()}
        assert mem.ask("What is the two.txt document?", max_new_tokens=2).sources


def test_pager_cache_holds_its_own_bytes_not_the_batch(store_path, tiny, rng):
    with kvmemory.Memory(store_path, model=tiny, segment_blocks=2) as mem:
        mem.add(words(rng, 1200), doc_id="d")
        rows = mem.docs()[0].blocks
        live = sorted(mem.documents.live_rows())
        assert len(live) == rows >= 3
        pool, st = mem.pager.fetch(live)
        assert st.from_disk == len(live)
        blocks, st2 = mem.pager.fetch(live, stacked=False)        # the same blocks, not copied into one
        assert st2.from_host == len(live) and len(blocks) == len(live)
        assert all(torch.equal(b, pool[i]) and b.data_ptr() == mem.pager.host.get(r).data_ptr()
                   for i, (b, r) in enumerate(zip(blocks, live)))
        for r in live:
            v = mem.pager.host.get(r)
            assert v.untyped_storage().nbytes() == v.numel() * v.element_size(), "a cached block pins the batch"
        block = live and mem.pager.host.get(live[0])
        budget = 2 * block.numel() * block.element_size()
        mem.pager.host.set_budget(budget)
        mem.pager.fetch(live)
        held = sum(v.untyped_storage().nbytes() for v, _ in mem.pager.host._items.values())
        assert mem.pager.host.used_bytes <= budget and held <= budget


def test_memory_shared_by_eight_threads(store_path, tiny, rng):
    """Concurrent ask / save / load / add: no error, every load digest-checked and byte-equal to what was
    saved, the pager's budget held. KVMEMORY_STRESS_S sets the duration (60 for the full check)."""
    seconds = float(os.environ.get("KVMEMORY_STRESS_S", "8"))
    mem = kvmemory.Memory(store_path, model=tiny, segment_blocks=1)
    mem.add(words(rng, 600, "Seed document."), doc_id="seed")
    budget = 3 * mem.block_tokens * 2 * 2 * 2 * 16 * 4          # three blocks of the tiny model
    mem.pager.host.set_budget(budget)
    saved: dict[str, torch.Tensor] = {}
    errors: list[str] = []
    counts = {"ask": 0, "save": 0, "load": 0, "add": 0}
    stop = time.monotonic() + seconds
    lock = threading.Lock()

    def worker(k: int) -> None:
        r = random.Random(rng.randrange(2**31) + k)
        while time.monotonic() < stop and not errors:
            op = r.choice(["ask", "ask", "save", "load", "load", "add"])
            try:
                if op == "ask":
                    assert mem.ask("Which document is the seed?", max_new_tokens=2).sources
                elif op == "save":
                    st = mem.save(words(r, r.randrange(20, 400)))
                    with lock:
                        saved[st.id] = st.kv.clone()
                elif op == "load":
                    with lock:
                        items = list(saved.items())
                    if items:
                        sid, kv = r.choice(items)
                        assert torch.equal(mem.load(sid).kv, kv), f"state {sid} read back different bytes"
                else:
                    mem.add(words(r, r.randrange(100, 500), f"Doc {k}-{r.randrange(10**9)}."))
                with lock:
                    counts[op] += 1
                    assert mem.pager.host.used_bytes <= budget
            except Exception as e:   # noqa: BLE001 -- the test collects every failure
                errors.append(f"{op}: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert min(counts.values()) >= 1, counts
    assert mem.verify() == []
    for sid, kv in saved.items():
        assert torch.equal(mem.load(sid).kv, kv)
    mem.close()


def test_ask_refuses_a_block_whose_positions_were_changed(store_path, tiny, rng):
    with kvmemory.Memory(store_path, model=tiny, segment_blocks=2) as mem:
        mem.add(words(rng, 1500, "The vault code is 4417."), doc_id="d")
        rows = sorted(mem.documents.live_rows())
    import zarr
    pos = zarr.open_array(str(store_path / "data" / "positions"), mode="r+")
    for r in rows:
        p = pos[r]
        pos[r] = np.where(p >= 0, p + 512, p)           # every block now claims another RoPE position
    with kvmemory.Memory(store_path, model=tiny) as mem:
        with pytest.raises(StoreCorruptError, match="does not match"):
            mem.ask("What is the vault code?", max_new_tokens=2)


def test_gc_after_rm_frees_disk_and_keeps_answers(tmp_path, tiny_dir, tiny, rng):
    store = tmp_path / "s.kvm"
    with kvmemory.Memory(store, model=tiny, segment_blocks=2) as mem:
        mem.add(words(rng, 800, "The keeper is Ada."), doc_id="keep")
        mem.add(words(rng, 1600, "The drop document."), doc_id="drop")
        state = mem.save("a state that stays")
        before = mem.info()["disk_bytes"]
        mem.remove("drop")
        assert mem.gc().blocks_freed == 0                 # within the grace period
        report = mem.gc(grace_s=0)
        assert report.blocks_freed == 7 and report.bytes_freed > 0
        assert mem.info()["disk_bytes"] < before
        assert mem.verify() == []
        assert [s[0] for s in mem.ask("Who is the keeper?", max_new_tokens=2).sources] == ["keep"]
        assert torch.equal(mem.load(state.id).kv, state.kv)
        mem.remove("keep")
    r = cli("gc", store, "--grace", "0")
    assert r.returncode == 0 and "freed 4 blocks" in r.stdout, r.stderr
    assert cli("verify", store).returncode == 0


def test_device_policy_puts_model_inputs_on_the_models_device():
    from kvmemory.device import device_of, ids_tensor, to_host, to_model
    model = torch.nn.Linear(2, 2, device="meta")          # a device that is not the CPU, without a GPU
    assert device_of(model).type == "meta"
    assert ids_tensor([1, 2, 3], model).device.type == "meta" and ids_tensor([1], model).shape == (1, 1)
    x = torch.ones(3)
    assert to_model(x, model).device.type == "meta"
    cpu = torch.nn.Linear(2, 2)
    assert to_model(x, cpu) is x and to_host(x).data_ptr() == x.data_ptr()      # no copy when already there


def test_typed_errors_at_the_boundary(tmp_path, tiny, tiny_dir, rng):
    for bad in (0, -1, True, 2.5):
        with pytest.raises(InputError, match="segment_blocks"):
            kvmemory.Memory(tmp_path / f"s{bad}", model=tiny, segment_blocks=bad)
    assert not any(tmp_path.iterdir()), "a rejected Memory created a store"
    with kvmemory.Memory(tmp_path / "s.kvm", model=tiny, segment_blocks=2) as mem:
        for doc_id in ("tab\there", "esc\x1b[31m", "del\x7f", "line\u2028sep", "x" * 201):
            with pytest.raises(InputError, match="document id"):
                mem.add("some text", doc_id=doc_id)
        a, b = tmp_path / "a", tmp_path / "b"
        a.mkdir()
        b.mkdir()
        (a / "same.txt").write_text(words(rng, 50))
        (b / "same.txt").write_text(words(rng, 50))
        (a / "other.txt").write_text(words(rng, 50))
        commit = mem.require_store().manifest.commit
        with pytest.raises(InputError, match="same.txt"):
            mem.add_files([a / "other.txt", a / "same.txt", b / "same.txt"])
        assert mem.docs() == [] and mem.require_store().manifest.commit == commit
    f = tmp_path / "doc.txt"
    f.write_text(words(rng, 50))
    r = cli("add", tmp_path / "c.kvm", f, "--segment-blocks", "0", "--model", tiny_dir)
    assert r.returncode == 2 and "segment-blocks" in r.stderr and not (tmp_path / "c.kvm").exists()
    r = cli("add", tmp_path / "c.kvm", a / "same.txt", b / "same.txt", "--model", tiny_dir)
    assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1 and "same.txt" in r.stderr
