"""What every benchmark shares: its seed (drawn fresh unless given), the date, the machine, the command
that ran it, where its results go (benchmarks/results/ by default), and its plot.

    from common import RESULTS, add_common_args, finish, plot, seed_of
    ap = argparse.ArgumentParser(...); add_common_args(ap)
    args = ap.parse_args(); seed = seed_of(args)
    ...
    path = finish(res, seed, args, "codec")          # res + seed, date, machine, command -> JSON
    plot(path, draw)                                 # draw(fig) -> a PNG beside the JSON
"""

from __future__ import annotations

import json
import random
import shlex
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
if str(ROOT) not in sys.path:          # kvmemory from this checkout, not whatever is installed
    sys.path.insert(0, str(ROOT))

from machine import describe, drop_from_page_cache  # noqa: E402

__all__ = ["RESULTS", "ROOT", "add_common_args", "command", "describe", "drop_from_page_cache", "finish", "plot",
           "seed_of", "today", "write_json"]


def add_common_args(ap, out: bool = True) -> None:
    """--seed (default: a fresh draw, printed and recorded) and --out (a folder, default benchmarks/results)."""
    ap.add_argument("--seed", type=int, default=None, help="reproduce a draw (default: a fresh one, recorded)")
    if out:
        ap.add_argument("--out", type=Path, default=RESULTS, help=f"a folder for the JSON and PNG (default {RESULTS})")


def seed_of(args) -> int:
    """args.seed, or a fresh draw; printed either way so a run can be reproduced."""
    seed = args.seed if getattr(args, "seed", None) is not None else random.SystemRandom().randrange(2**31)
    print(f"seed {seed}", file=sys.stderr)
    return seed


def today() -> str:
    """The date (UTC) results are named and stamped with."""
    return time.strftime("%Y-%m-%d", time.gmtime())


def command() -> str:
    """The command line that ran this benchmark."""
    return shlex.join(["python", *sys.argv])


def finish(res: dict, seed: int, args, name: str, path: Path | None = None) -> Path:
    """res stamped with the benchmark's name, date, seed, command, arguments and machine, written as JSON
    to `path` (default: --out/<name>-<date>.json). Returns the path."""
    res = {"benchmark": name, "date": today(), "seed": seed, "command": command(), "machine": describe(),
           "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}, **res}
    if path is None:
        path = Path(getattr(args, "out", None) or RESULTS) / f"{name}-{today()}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(res, indent=1, default=str))
    print(f"wrote {path}")
    return path


def write_json(path: Path, res: dict, seed: int | None = None) -> Path:
    """res written as JSON at `path`, stamped with the command that ran it (and the date, the machine and
    the seed where res does not say them already)."""
    stamp = {"date": today(), "machine": describe(), **({"seed": seed} if seed is not None else {})}
    res = {**{k: v for k, v in stamp.items() if k not in res}, **res, "command": command()}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(res, indent=1, default=str))
    return path


def plot(path: Path, draw: Callable, size: tuple[float, float] = (8, 4.5), dpi: int = 110) -> Path | None:
    """draw(fig) onto a new figure, saved as a PNG beside `path` (its suffix replaced). Without matplotlib
    (not a CI dependency of every run) it says so and returns None."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install 'kvmemory[bench]')", file=sys.stderr)
        return None
    fig = plt.figure(figsize=size)
    draw(fig)
    fig.tight_layout()
    png = Path(path).with_suffix(".png")
    fig.savefig(png, dpi=dpi)
    plt.close(fig)
    return png
