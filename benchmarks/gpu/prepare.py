"""Everything the GPU machine lacks, fetched here into .gpu/ (ignored) so one run there needs nothing else:

  .gpu/wheels     the wheels in wheels.txt for that machine's Python (3.12, manylinux x86-64), pinned
  .gpu/tokenizer  the default model's tokenizer files (its weights stay here: random weights of its
                  config stand in there, bench_engine.py)
  .gpu/minilm     MiniLM's config and tokenizer files (likewise)

It checks the wheels' total (under 60 MiB) and what would travel with the working tree (under the device
tool's 64 MiB). `make gpu-wheels` runs it; then, with a device lent:

    run(command="bash benchmarks/gpu/run.sh", carry=[".gpu"], timeout_s=480)
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
PLATFORMS = ["manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux_2_5_x86_64", "manylinux1_x86_64",
             *(f"manylinux_2_{n}_x86_64" for n in (24, 27, 28, 31, 34, 35))]
WHEELS_MAX = 60 << 20
TRAVEL_MAX = 64 << 20


def norm(name: str) -> str:
    """A distribution's name as pip compares them (a wheel's file name spells '-' as '_')."""
    return name.strip().lower().replace("_", "-").replace(".", "-")


def pins(path: Path = HERE / "wheels.txt") -> dict[str, str]:
    """name (normalised) -> version, from a requirements file of name==version lines."""
    out = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            out[norm(name)] = version.strip()
    return out


def copy_minilm_files(src: Path, dst: Path) -> None:
    """MiniLM's config and tokenizer files (not its weights) from src into dst."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in Path(src).iterdir():
        if f.is_file() and f.suffix in (".json", ".txt") and f.name != "data_config.json":
            shutil.copy(f, dst / f.name)


def fetch(dest: Path) -> list[Path]:
    dest.mkdir(parents=True, exist_ok=True)
    want = pins()
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
           "--python-version", "3.12", "--implementation", "cp", "--abi", "cp312", "--abi", "abi3", "--abi", "none",
           *[a for p in PLATFORMS for a in ("--platform", p)], "--platform", "any", "-d", str(dest),
           *[f"{n}=={v}" for n, v in want.items()]]
    subprocess.run(cmd, check=True)
    keep = []
    for w in sorted(dest.glob("*.whl")):              # one version of each: stale ones would stop the install
        name, version = w.name.split("-")[:2]
        if want.get(norm(name)) == version:
            keep.append(w)
        else:
            w.unlink()
    missing = set(want) - {norm(w.name.split("-")[0]) for w in keep}
    if missing:
        raise SystemExit(f"no wheel for {', '.join(sorted(missing))}")
    return keep


def tokenizers(dest: Path) -> None:
    from transformers import AutoTokenizer

    from kvmemory.config import RuntimeConfig, from_env
    from kvmemory.index.embedder import model_dir
    from kvmemory.model import default_model_dir
    tok_dir = dest / "tokenizer"
    shutil.rmtree(tok_dir, ignore_errors=True)
    AutoTokenizer.from_pretrained(default_model_dir(from_env(RuntimeConfig).resolved_cache_dir())).save_pretrained(tok_dir)
    shutil.rmtree(dest / "minilm", ignore_errors=True)
    copy_minilm_files(model_dir(), dest / "minilm")


def size(paths) -> int:
    return sum(p.stat().st_size for p in paths if p.is_file())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dest", type=Path, default=ROOT / ".gpu")
    args = ap.parse_args()
    wheels = fetch(args.dest / "wheels")
    tokenizers(args.dest)
    w = size(wheels)
    tracked = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                             capture_output=True, check=True).stdout.decode().split("\0")
    tree = size(ROOT / t for t in tracked if t)
    carried = size(args.dest.rglob("*"))
    print(f"{len(wheels)} wheels, {w / 2**20:.1f} MiB; .gpu/ {carried / 2**20:.1f} MiB; with the working tree "
          f"{(tree + carried) / 2**20:.1f} MiB travel")
    if w > WHEELS_MAX:
        raise SystemExit(f"the wheels are {w / 2**20:.1f} MiB, over {WHEELS_MAX >> 20} MiB")
    if tree + carried > TRAVEL_MAX:
        raise SystemExit(f"{(tree + carried) / 2**20:.1f} MiB would travel, over the device tool's {TRAVEL_MAX >> 20} MiB")


if __name__ == "__main__":
    main()
