"""Where a model comes from: a local transformers directory, a .gguf file (converted once, cached by
its hash), a Hugging Face Hub id resolved from the local cache only; on which device and in which
dtype. Through Memory(path, model=...), the CLI's --model and `kvmemory serve`."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

import kvmemory
from kvmemory.errors import InputError, ModelLoadError
from kvmemory.model.loader import _gguf_path, model_source

SHA = "0123456789abcdef0123456789abcdef01234567"


def _hub_cache(root, repo_id: str, model_dir) -> None:
    """A Hugging Face Hub cache holding repo_id as `hf download` leaves it: blobs behind a snapshot."""
    repo = root / ("models--" + repo_id.replace("/", "--"))
    snap = repo / "snapshots" / SHA
    snap.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(SHA)
    for f in model_dir.iterdir():
        shutil.copy(f, snap / f.name)


@pytest.fixture
def hub(tmp_path, tiny_dir, monkeypatch):
    from huggingface_hub import constants
    root = tmp_path / "hub"
    _hub_cache(root, "acme/tiny-llama", tiny_dir)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(root))
    return root


def test_a_hub_id_in_the_local_cache_opens_as_its_directory_does(tmp_path, hub, tiny_dir):
    with kvmemory.Memory(tmp_path / "a.kvm", model=str(tiny_dir)) as a:
        fp = a.fingerprint
    with kvmemory.Memory(tmp_path / "b.kvm", model="acme/tiny-llama") as b:
        assert b.fingerprint == fp and b.model_name == "acme/tiny-llama"
        assert b.save("a few words").n_tokens > 0


def test_a_hub_id_not_in_the_cache_says_how_to_fetch_it_and_downloads_nothing(tmp_path, hub):
    with pytest.raises(ModelLoadError, match="hf download acme/absent") as e:
        kvmemory.Memory(tmp_path / "c.kvm", model="acme/absent")
    assert "never downloads" in str(e.value)
    assert not (hub / "models--acme--absent" / "snapshots").exists()
    assert not (tmp_path / "c.kvm").exists()


def test_what_is_neither_a_directory_a_gguf_nor_a_hub_id_is_refused(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"\0" * 64)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="not a .gguf"):
        model_source(tmp_path / "weights.bin", tmp_path)
    with pytest.raises(ModelLoadError, match="no config.json"):
        model_source(tmp_path / "empty", tmp_path)
    with pytest.raises(ModelLoadError, match="no such model"):
        model_source(tmp_path / "missing" / "dir", tmp_path)
    (tmp_path / "broken.gguf").write_bytes(b"GGUF" + os.urandom(200))
    with pytest.raises(ModelLoadError, match="cannot convert"):
        model_source(tmp_path / "broken.gguf", tmp_path / "cache")
    assert not any((tmp_path / "cache" / "models").glob("broken-*"))       # nothing half-converted is kept


@pytest.mark.real_model
def test_the_default_models_own_gguf_file_is_the_default_model(tmp_path, cache_dir, default_dir):
    """--model given the GGUF the default model comes from (here under another name): the same
    converted directory, the same fingerprint."""
    copy = tmp_path / "my-model.gguf"
    shutil.copy(_gguf_path(), copy)
    path, name = model_source(copy, cache_dir)
    assert path == default_dir and name == "SmolLM2-135M-Instruct"
    with kvmemory.Memory(tmp_path / "d.kvm") as d:
        fp = d.fingerprint
    with kvmemory.Memory(tmp_path / "g.kvm", model=str(copy)) as g:
        assert g.fingerprint == fp


@pytest.mark.real_model
def test_the_cli_adds_and_asks_with_a_gguf_file(tmp_path):
    gguf = _gguf_path()
    doc = tmp_path / "note.txt"
    doc.write_text("The harbour office opens at seven. The ferry to the island leaves at nine.")

    from tests.clirun import run
    r = run("add", tmp_path / "s.kvm", doc, "--model", gguf)
    assert r.returncode == 0, r.stderr
    r = run("ask", tmp_path / "s.kvm", "When does the ferry leave?", "--model", gguf, "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["sources"] and out["sources"][0][0] == "note.txt"


def test_serve_takes_a_hub_id_a_device_and_a_dtype(tmp_path, tiny_dir):
    httpx = pytest.importorskip("httpx")
    from tests.server.test_server import _free_port

    root = tmp_path / "hub"
    _hub_cache(root, "acme/tiny-llama", tiny_dir)
    port = _free_port()
    cmd = [sys.executable, "-m", "kvmemory.cli", "serve", str(tmp_path / "s.kvm"), "--port", str(port),
           "--log-level", "warning", "--model", "acme/tiny-llama", "--device", "cpu", "--dtype", "bfloat16"]
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                         env={**os.environ, "HF_HUB_CACHE": str(root), "HF_HUB_OFFLINE": "1"})
    try:
        import time
        deadline = time.time() + 180
        while time.time() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
            assert p.poll() is None, p.stderr.read().decode()[-2000:]
        r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=120,
                       json={"model": "kvmemory", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    finally:
        p.terminate()
        p.wait(timeout=30)
    with kvmemory.Memory(tmp_path / "s.kvm", model=str(tiny_dir), dtype="bfloat16", read_only=True) as m:
        assert m.geometry.dtype == "bfloat16" and m.store.manifest.kv_dtype == "bfloat16"


def test_a_device_this_machine_lacks_is_an_error_not_a_fallback(tmp_path, tiny_dir):
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    with pytest.raises(ModelLoadError, match="no CUDA device"):
        kvmemory.Memory(tmp_path / "a.kvm", model=str(tiny_dir), device="cuda")
    with pytest.raises(InputError, match="cpu, cuda, cuda:N or auto"):
        kvmemory.Memory(tmp_path / "a.kvm", model=str(tiny_dir), device="tpu")
    assert not (tmp_path / "a.kvm").exists()
    with kvmemory.Memory(tmp_path / "b.kvm", model=str(tiny_dir), device="auto") as m:
        assert m.model.device.type == "cpu"
    (tmp_path / "t.txt").write_text("hello")
    from tests.clirun import run
    r = run("save", tmp_path / "c.kvm", tmp_path / "t.txt", "--model", tiny_dir, "--device", "cuda:0")
    assert r.returncode == 1 and b"no CUDA device" in r.stderr


def test_a_float16_model_keeps_the_exactness_contract(tmp_path, tiny_dir, rng):
    ids = [rng.randrange(100, 5000) for _ in range(300)]
    with kvmemory.Memory(tmp_path / "h.kvm", model=str(tiny_dir), dtype="float16") as m:
        assert m.geometry.dtype == "float16"
        sid = m.save(ids).id
        assert m.verify(recompute=True) == []
        _, rows = m.audit(1, seed=0)
        assert rows[0].ok and rows[0].exact
    with kvmemory.Memory(tmp_path / "h.kvm", model=str(tiny_dir), dtype="float16") as m:
        assert m.load(sid).token_ids == ids
