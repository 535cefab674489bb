"""The `kvmemory` command line. Usage errors exit 2, runtime errors exit 1 with one line.

Each command's parser sits beside its handler: states.py (save, generate, info, verify, demo),
documents.py (add, ask, docs, rm, reindex, gc), library.py (learn, solve), serve.py (serve)."""

from __future__ import annotations

import argparse
import os
import sys

from kvmemory.cli import documents, keys, library, serve, states
from kvmemory.cli.common import EPILOG, model_arg
from kvmemory.errors import KVMemoryError

MODULES = (states, documents, serve, library, keys)


def _parser() -> argparse.ArgumentParser:
    from kvmemory import __version__

    p = argparse.ArgumentParser(
        prog="kvmemory",
        description="Byte-exact KV-cache memory for frozen language models: save a prompt's attention "
                    "state once, restore it later instead of recomputing it.",
        epilog=EPILOG)
    p.add_argument("--version", action="version", version=f"kvmemory {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(name, run, help_, desc, store=True, model=False):
        """A subcommand run by run(args); store: the STORE argument (True, or its help text); model: --model."""
        sp = sub.add_parser(name, help=help_, description=desc, epilog=EPILOG)
        if store:
            sp.add_argument("store", metavar="STORE", **({"help": store} if isinstance(store, str) else {}))
        if model:
            model_arg(sp)
        sp.set_defaults(run=run)
        return sp
    for m in MODULES:
        m.register(add)
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)   # exits 2 on usage errors
    if not sys.stderr.isatty():
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        return args.run(args)
    except KVMemoryError as e:
        print(f"kvmemory {args.command}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"kvmemory {args.command}: interrupted", file=sys.stderr)
        return 130
