"""One configuration (kvmemory/settings.py): every serve flag and KVMEMORY_* setting in one typed schema,
from a flag, the environment or a --config file, in that precedence; --print-config shows what is in
force and where it came from; a bad value or an unknown name is an error naming it."""

import os
import subprocess
import sys
import time
import tomllib

import pytest

from kvmemory.errors import InputError
from kvmemory.settings import ENV, FIELDS, Settings, load, render
from tests.clirun import run


def _run(*args, env=None):
    return run(*args, env={**{k: v for k, v in os.environ.items() if k not in ENV}, **(env or {})}, text=True)


def test_precedence_flag_over_environment_over_file_over_default(tmp_path):
    f = tmp_path / "kvmemory.toml"
    f.write_text('batch = 2\nport = 9001\n[kvmemory]\ndtype = "bfloat16"\nhost_cache_bytes = 1024\n')
    s, src = load({"port": 9002, "batch": None}, config_file=f, env={"KVMEMORY_BATCH": "4", "KVMEMORY_CODEC": "lz4"})
    assert (s.port, src["port"]) == (9002, "flag")
    assert (s.batch, src["batch"]) == (4, "env KVMEMORY_BATCH")
    assert (s.dtype, src["dtype"]) == ("bfloat16", f"file {f}")
    assert (s.host_cache_bytes, s.codec) == (1024, "lz4")
    assert (s.log_level, src["log_level"]) == ("info", "default") and s.block_tokens is None
    again = tomllib.loads(render(s, src))["kvmemory"]                     # what it prints is a config file
    assert again["port"] == 9002 and again["batch"] == 4 and again["dtype"] == "bfloat16" and "block_tokens" not in again
    assert Settings.model_validate(again) == s


def test_bad_values_and_unknown_names_are_errors_that_name_them(tmp_path):
    with pytest.raises(InputError, match="KVMEMORY_PORT"):
        load(env={"KVMEMORY_PORT": "eighty"})
    with pytest.raises(InputError, match="device"):
        load({"device": "tpu"})
    f = tmp_path / "bad.toml"
    f.write_text("prot = 80\n")
    with pytest.raises(InputError, match="unknown setting.*prot"):
        load(config_file=f)
    f.write_text("port = [\n")
    with pytest.raises(InputError, match="not valid TOML"):
        load(config_file=f)
    f.write_text('log_level = "loud"\n')
    with pytest.raises(InputError, match=r"log_level='loud' \(file"):
        load(config_file=f)
    with pytest.raises(InputError, match="cannot read"):
        load(config_file=tmp_path / "missing.toml")


def test_every_setting_has_an_environment_twin_and_the_schema_reads_the_environment(monkeypatch):
    assert set(ENV.values()) == set(FIELDS)
    monkeypatch.setenv("KVMEMORY_REPLICAS", "3")
    monkeypatch.setenv("KVMEMORY_LOCK_TIMEOUT", "2.5")
    assert Settings().replicas == 3                       # pydantic-settings' own reading of the environment
    assert load()[0].lock_timeout_s == 2.5


def test_print_config_shows_what_is_in_force(tmp_path):
    f = tmp_path / "k.toml"
    f.write_text('queue = 5\nlog_format = "json"\n')
    r = _run("serve", tmp_path / "s.kvm", "--config", f, "--print-config", "--batch", "3",
             env={"KVMEMORY_QUEUE": "7"})
    assert r.returncode == 0, r.stderr
    got = tomllib.loads(r.stdout)["kvmemory"]
    assert got["queue"] == 7 and got["batch"] == 3 and got["log_format"] == "json" and got["port"] == 8000
    assert "# env KVMEMORY_QUEUE" in r.stdout and "# flag" in r.stdout and f"# file {f}" in r.stdout
    assert not (tmp_path / "s.kvm").exists()                     # printing opens no store
    bad = _run("serve", tmp_path / "s.kvm", "--print-config", env={"KVMEMORY_BATCH": "zero"})
    assert bad.returncode == 1 and "KVMEMORY_BATCH" in bad.stderr


def test_a_server_runs_with_the_files_settings(tmp_path, tiny_dir):
    httpx = pytest.importorskip("httpx")
    from tests.server.test_server import _free_port
    port = _free_port()
    f = tmp_path / "k.toml"
    f.write_text(f'port = {port}\nmodel = "{tiny_dir}"\nlog_level = "warning"\nblock_tokens = 32\n')
    p = subprocess.Popen([sys.executable, "-m", "kvmemory.cli", "serve", str(tmp_path / "s.kvm"), "--config", str(f)],
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                         env={**{k: v for k, v in os.environ.items() if k not in ENV}, "HF_HUB_OFFLINE": "1"})
    try:
        deadline = time.time() + 180
        while time.time() < deadline:
            try:
                h = httpx.get(f"http://127.0.0.1:{port}/health", timeout=1)
                if h.status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
            assert p.poll() is None, p.stderr.read().decode()[-2000:]
        r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=120,
                       json={"model": "kvmemory", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
        assert r.status_code == 200
    finally:
        p.terminate()
        p.wait(timeout=30)
    from kvmemory.cli.common import store_header
    assert store_header(tmp_path / "s.kvm").block_tokens == 32          # the file's store setting took effect
