"""tests/clirun.py, the in-process runner of the command line and the scripts: what it returns is what a
subprocess returns, and it leaves this process as it found it."""

import os
import random
import sys

import torch

from tests.clirun import run, run_script


def test_a_command_in_process_answers_as_the_process_does(tmp_path):
    for args in (("--version",), ("info", tmp_path / "nope"), ("frobnicate",)):
        a, b = run(*args), run(*args, process=True)
        assert (a.returncode, a.stdout) == (b.returncode, b.stdout), args
        assert a.stderr.splitlines()[-1:] == b.stderr.splitlines()[-1:], args      # the error line, or none
    env = {**os.environ, "KVMEMORY_PROBE_X": "1"}
    streams = (sys.stdin, sys.stdout, sys.stderr)
    assert run("info", tmp_path / "nope", env=env).returncode == 1
    assert "KVMEMORY_PROBE_X" not in os.environ and (sys.stdin, sys.stdout, sys.stderr) == streams


def test_a_script_runs_as_main_and_everything_is_put_back(tmp_path):
    (tmp_path / "helper.py").write_text("import os\nWORD = os.environ.get('PROBE_WORD', 'unset')\n")
    script = tmp_path / "script.py"
    script.write_text("import os, random, sys\nimport torch\nimport helper\n"
                      "random.seed(1); torch.manual_seed(1)\n"
                      "print(helper.WORD, sys.argv[1:], os.getcwd() == os.environ['PROBE_CWD'], __name__)\n"
                      "print('to stderr', file=sys.stderr)\n"
                      "if sys.argv[1] == 'fail':\n    raise SystemExit(3)\n"
                      "if sys.argv[1] == 'boom':\n    raise ValueError('boom')\n")
    cwd, path, state = os.getcwd(), list(sys.path), (random.getstate(), torch.get_rng_state())
    env = {**os.environ, "PROBE_WORD": "fresh", "PROBE_CWD": str(tmp_path)}
    for arg, code in (("ok", 0), ("fail", 3), ("boom", 1)):
        r = run_script([sys.executable, str(script), arg], cwd=tmp_path, text=True, env=env)
        assert r.returncode == code and r.stdout == f"fresh ['{arg}'] True __main__\n", r
        assert r.stderr.startswith("to stderr\n") and ("ValueError: boom" in r.stderr) == (arg == "boom")
    assert os.getcwd() == cwd and sys.path == path and "helper" not in sys.modules
    assert random.getstate() == state[0] and torch.equal(torch.get_rng_state(), state[1])
