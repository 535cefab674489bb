"""How much of each long test runs. The default run (what `make test` and CI run) is bounded so the
suite stays well inside CI's time; KVMEMORY_FULL_TESTS=1 (`make test-full`) runs the full amounts.
Each knob also takes an environment override of its own (KVMEMORY_E3_STATES=50, ...), which wins."""

from __future__ import annotations

import os

FULL = os.environ.get("KVMEMORY_FULL_TESTS") == "1"


def bound(name: str, quick: int, full: int) -> int:
    """The amount a long test runs: $name if set, else `full` under KVMEMORY_FULL_TESTS=1, else `quick`."""
    v = os.environ.get(name)
    if v:
        n = int(v)
        if n < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
        return n
    return full if FULL else quick
