"""serve's dtype when nobody chose one (kvmemory/model/choose.py): bfloat16 only where this CPU has the
instructions (never a timing: the same machine, the same choice), for the default model whose answers
were measured; float32 otherwise; a store opens in its own dtype; /health says which and why."""

import os
import subprocess
import sys
import time

import pytest

from kvmemory.model import choose


def test_the_choice_follows_the_cpu_and_the_model_and_times_nothing(monkeypatch):
    monkeypatch.setattr(choose, "cpu_flags", lambda: {"avx2", "avx512f"})
    d, why = choose.default_dtype()
    assert d == "float32" and "neither AVX-512 BF16 nor AMX" in why
    for flags, named in (({"avx512f", "avx512_bf16"}, "avx512_bf16"), ({"amx_bf16", "amx_tile"}, "amx_bf16")):
        monkeypatch.setattr(choose, "cpu_flags", lambda flags=flags: flags)
        monkeypatch.setattr(time, "perf_counter", lambda: pytest.fail("the dtype choice timed something"))
        d, why = choose.default_dtype()
        monkeypatch.undo()
        assert d == "bfloat16" and named in why, why
        monkeypatch.setattr(choose, "cpu_flags", lambda flags=flags: flags)
        d, why = choose.default_dtype(default_model=False)
        assert d == "float32" and "not measured" in why


def test_health_says_the_dtype_and_why(tmp_path, tiny_dir):
    httpx = pytest.importorskip("httpx")
    from tests.server.test_server import _free_port

    def start(*extra):
        port = _free_port()
        p = subprocess.Popen([sys.executable, "-m", "kvmemory.cli", "serve", str(tmp_path / "s.kvm"), "--port",
                              str(port), "--log-level", "warning", "--model", str(tiny_dir), *extra],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                             env={**{k: v for k, v in os.environ.items() if k != "KVMEMORY_DTYPE"},
                                  "HF_HUB_OFFLINE": "1"})
        deadline = time.time() + 180
        while time.time() < deadline:
            try:
                h = httpx.get(f"http://127.0.0.1:{port}/health", timeout=1)
                if h.status_code == 200:
                    return p, h.json()
            except httpx.HTTPError:
                time.sleep(0.2)
            assert p.poll() is None, p.stderr.read().decode()[-2000:]
        raise AssertionError("no server")

    p, h = start()                                   # a model whose bf16 answers nobody measured: float32
    p.terminate()
    err = p.communicate(timeout=30)[1].decode()
    assert h["dtype"] == "float32" and "not measured" in h["dtype_reason"]
    assert "computing in float32" in err
    p, h = start("--dtype", "float32")               # the store exists: asked for, the same
    p.terminate()
    p.wait(timeout=30)
    assert h["dtype"] == "float32" and h["dtype_reason"] == "asked for (flag)"
    p, h = start()                                   # the store's own dtype
    p.terminate()
    p.wait(timeout=30)
    assert h["dtype"] == "float32" and "store's blocks" in h["dtype_reason"]
