"""`kvmemory ARGS...` and `python SCRIPT ARGS...` for the tests, run in this process: `run` through
`kvmemory.cli.main(argv)` (the same code `python -m kvmemory.cli` runs, without its ~5 s import of torch
and transformers per call), or in a real subprocess (`process=True`: the entry point itself, anything that
must not share this process); `run_script` a benchmark or an example as `__main__`. Both return a
subprocess.CompletedProcess; an exception that escapes is written to stderr as a traceback with exit code
1, as the interpreter would. In this process there is no timeout."""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
import traceback


def run(*args, stdin: bytes | None = None, env: dict[str, str] | None = None, text: bool = False,
        timeout: float = 600, process: bool = False) -> subprocess.CompletedProcess:
    """`env`, as subprocess's: the whole environment the command sees (this process's is put back after);
    `text`: stdout and stderr decoded."""
    argv = [str(a) for a in args]
    if process:
        return subprocess.run([sys.executable, "-m", "kvmemory.cli", *argv], input=stdin, capture_output=True,
                              timeout=timeout, env=env, text=text)
    from kvmemory.cli import main

    with _captured(stdin, env) as (out, err):
        code = _exit_code(main, argv)
    return _completed(["kvmemory", *argv], code, out, err, text)


def run_script(cmd: list, cwd=None, text: bool = False, stdin: bytes | None = None, env: dict[str, str] | None = None,
               **_subprocess_kwargs) -> subprocess.CompletedProcess:
    """`subprocess.run([sys.executable, SCRIPT, ARGS...], cwd=..., capture_output=True, text=...)` run in this
    process instead: SCRIPT as __main__ (runpy), with sys.argv, the working directory, sys.path and the
    modules of SCRIPT's folder (imported afresh: a module reading the environment at import, as
    examples/town.py does, reads `env`) as a fresh interpreter would have them, all put back after, with
    the global random generators (random, numpy, torch) the script may seed. Keyword arguments
    subprocess.run takes and this has no use for (capture_output, timeout) are accepted and ignored."""
    import random
    import runpy

    import numpy as np
    import torch

    assert cmd[0] == sys.executable, cmd
    rngs = random.getstate(), np.random.get_state(), torch.get_rng_state()   # bench_models seeds torch
    script, argv = str(cmd[1]), [str(a) for a in cmd[2:]]
    where, path, args = os.getcwd(), list(sys.path), sys.argv
    if cwd is not None:
        os.chdir(cwd)
    sys.argv = [script, *argv]
    folder = os.path.dirname(os.path.abspath(script))
    sys.path.insert(0, folder)
    siblings = _modules_in(folder)
    for name in siblings:
        del sys.modules[name]

    def as_main(_):
        runpy.run_path(script, run_name="__main__")
    try:
        with _captured(stdin, env) as (out, err):
            code = _exit_code(as_main, argv)
    finally:
        os.chdir(where)
        sys.path[:], sys.argv = path, args
        for name in _modules_in(folder):
            del sys.modules[name]
        sys.modules.update(siblings)
        random.setstate(rngs[0])
        np.random.set_state(rngs[1])
        torch.set_rng_state(rngs[2])
    return _completed(cmd, code, out, err, text)


def _completed(args: list, code: int, out: io.BytesIO, err: io.BytesIO, text: bool) -> subprocess.CompletedProcess:
    """What subprocess.run returns for this run: stdout and stderr as bytes, or decoded (`text`)."""
    o, e = out.getvalue(), err.getvalue()
    return subprocess.CompletedProcess(args, code, o.decode() if text else o, e.decode() if text else e)


def _modules_in(folder: str) -> dict:
    """The imported modules whose file lies in `folder` or below, by name."""
    return {n: m for n, m in list(sys.modules.items())
            if (getattr(m, "__file__", None) or "").startswith(folder + os.sep)}


def _exit_code(fn, argv) -> int:
    """fn(argv)'s exit code as the interpreter would give it; an exception's traceback goes to stderr."""
    try:
        code = fn(argv)
        return code if isinstance(code, int) else 0
    except SystemExit as e:                 # argparse: usage errors (2), --help and --version (0)
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr)
        return 1
    except Exception:                       # what the interpreter would print, and its exit code
        traceback.print_exc(file=sys.stderr)
        return 1


@contextlib.contextmanager
def _captured(stdin: bytes | None, env: dict[str, str] | None):
    """sys.stdin reads `stdin`; what goes to sys.stdout and sys.stderr lands in the two BytesIO yielded;
    os.environ is `env` where given. All put back after."""
    out, err = io.BytesIO(), io.BytesIO()
    streams, environ = (sys.stdin, sys.stdout, sys.stderr), dict(os.environ)
    if env is not None:
        os.environ.clear()
        os.environ.update(env)
    wrapped = (io.TextIOWrapper(io.BytesIO(stdin or b""), encoding="utf-8"),
               io.TextIOWrapper(out, encoding="utf-8", write_through=True),
               io.TextIOWrapper(err, encoding="utf-8", write_through=True))
    sys.stdin, sys.stdout, sys.stderr = wrapped
    # what main()'s TRANSFORMERS_VERBOSITY and HF_HUB_DISABLE_PROGRESS_BARS do in a fresh process, where
    # transformers is imported after main() sets them
    from transformers.utils import logging as hf_logging
    bars, verbosity = hf_logging.is_progress_bar_enabled(), hf_logging.get_verbosity()
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    try:
        yield out, err
    finally:
        sys.stdin, sys.stdout, sys.stderr = streams
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()
        os.environ.clear()
        os.environ.update(environ)
        for w in wrapped:
            w.flush()
            w.detach()                      # the buffers outlive their wrappers
