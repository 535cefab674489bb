"""Many users in one store: per-user selection indexes load lazily and cost nothing while a user is
idle. Deposits a few exchanges for each of N users, then measures the process's memory and the
recall latency of users whose indexes are not loaded (cold: read from disk on the request) and of
the same users again (warm), and what a user costs on disk.

    python benchmarks/bench_chat_memory_users.py --users 1000
"""

from __future__ import annotations

import argparse
import random
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_chat_memory import FILLER, exchange  # noqa: E402
from common import describe, seed_of, write_json  # noqa: E402

import kvmemory  # noqa: E402


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--users", type=int, default=1000)
    ap.add_argument("--turns", type=int, default=2, help="exchanges per user")
    ap.add_argument("--probe", type=int, default=50, help="users whose recall is timed")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--codec", default="zstd", help="the store's codec (default zstd: a short turn's block is "
                                                    "mostly padding, which raw blocks keep on disk)")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    seed = seed_of(args)
    rng = random.Random(seed)
    from kvmemory.config import StoreConfig
    mem = kvmemory.Memory(Path(tempfile.mkdtemp(prefix="kvm-users-")) / "m.kvm", store_config=StoreConfig(codec=args.codec))
    _ = mem.documents.embedder                           # load MiniLM before the baseline
    base = rss_mib()
    t0 = time.perf_counter()
    names = [f"u{i:05d}-{rng.randrange(1 << 20):05x}" for i in range(args.users)]
    for i, name in enumerate(names):
        cm = mem.chat_memory(name)
        for t in range(args.turns):
            u, a = rng.choice(FILLER)
            cm.remember(exchange(f"{u} (note {i}.{t}: my code is {rng.randrange(10000)})", a), f"s{t}")
    deposit_s = time.perf_counter() - t0
    after = rss_mib()
    probe = rng.sample(names, min(args.probe, len(names)))
    cold, warm = [], []
    for name in probe:
        mem.drop_user_documents(mem.chat_memory(name).scope)       # not loaded: as for an idle user
        t = time.perf_counter()
        mem.chat_memory(name).recall("what is my code?", k=3)
        cold.append(time.perf_counter() - t)
        t = time.perf_counter()
        mem.chat_memory(name).recall("what is my code?", k=3)
        warm.append(time.perf_counter() - t)
    users_dir = mem.path / "users"
    index_bytes = sum(f.stat().st_size for f in users_dir.rglob("*") if f.is_file())
    disk = mem.require_store().disk_bytes()
    res = {"seed": seed, "args": vars(args), "machine": describe(), "deposit_s": deposit_s, "disk_bytes": disk,
           "rss_mib": {"before_users": base, "after_users": after, "per_user_kib": 1024 * (after - base) / args.users},
           "recall_ms": {"cold_median": 1000 * statistics.median(cold), "cold_max": 1000 * max(cold),
                         "warm_median": 1000 * statistics.median(warm)},
           "index_bytes_per_user": index_bytes / args.users, "loaded_users": len(mem.scopes)}
    mem.close()
    import shutil
    shutil.rmtree(Path(mem.path).parent, ignore_errors=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"chat-memory-users-{time.strftime('%Y-%m-%d')}-{args.users}.json"
    write_json(path, res, seed)
    m = res["machine"]
    print(f"machine: {m['cpu']}, {m['cores']} cores; seed {seed}")
    print(f"{args.users} users x {args.turns} exchanges deposited in {deposit_s:.0f} s; RSS {base:.0f} -> {after:.0f} MiB "
          f"({res['rss_mib']['per_user_kib']:.1f} KiB a user; {res['loaded_users']} users' indexes loaded at most)")
    print(f"recall: cold (indexes read from disk) median {res['recall_ms']['cold_median']:.1f} ms, max "
          f"{res['recall_ms']['cold_max']:.1f} ms; warm median {res['recall_ms']['warm_median']:.1f} ms; "
          f"{res['index_bytes_per_user'] / 1024:.1f} KiB of index files a user; store {disk / 2**20:.0f} MiB on disk "
          f"({args.codec})")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
