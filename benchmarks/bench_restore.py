"""Restore vs recompute, and restore bandwidth vs the disk's raw sequential read bandwidth.

For each state length (fresh random tokens every run), side by side in one run:
  recompute  canonical block-aligned prefill of the state with the real default model
  cold       Memory.load (scatter-read into the state layout + digest-verify) after evicting the store from the page cache
  warm       Memory.load again, files in the page cache
  raw (same files)  single-threaded sequential 16 MiB reads of exactly the shard files the state
             lives in, evicted the same way, interleaved with the cold restores: the fair ceiling
  raw (fresh file)  the same reads of a file written just before (on a VM disk the host may still
             cache it, which flatters this number; reported for reference)
  public     Memory.load(id).cache(), cold: what a user calls to get a transformers cache
  safetensors  what a user writes by hand instead: the same KV saved with safetensors.torch.save_file,
             loaded cold with safetensors.torch.load_file and put in a DynamicCache (no verification)
Prints a table, writes JSON and a PNG.  Usage: python benchmarks/bench_restore.py [--lengths 512,...]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import describe, drop_from_page_cache, write_json  # noqa: E402

import kvmemory  # noqa: E402
from kvmemory import kv as kvops  # noqa: E402


def raw_read_bw(path: Path, nbytes: int, reps: int) -> float:
    """Median cold sequential read bandwidth (bytes/s) of a fresh file of nbytes."""
    with open(path, "wb") as f:
        chunk = os.urandom(1 << 24)
        for _ in range(0, nbytes, len(chunk)):
            f.write(chunk)
        f.flush()
        os.fsync(f.fileno())
    out = []
    buf = bytearray(1 << 24)
    for _ in range(reps):
        drop_from_page_cache(path)
        t = time.perf_counter()
        with open(path, "rb", buffering=0) as f:
            total = 0
            while n := f.readinto(buf):
                total += n
        out.append(total / (time.perf_counter() - t))
    path.unlink()
    return statistics.median(out)


def raw_read_files(files: list[Path]) -> tuple[int, float]:
    buf = bytearray(1 << 24)
    total = 0
    t = time.perf_counter()
    for p in files:
        with open(p, "rb", buffering=0) as f:
            while n := f.readinto(buf):
                total += n
    return total, time.perf_counter() - t


def state_files(mem, sid) -> list[Path]:
    """The kv shard files holding a state's blocks."""
    store = mem.store
    per = store.manifest.shard_blocks
    shards = sorted({r // per for r in store.chain(store.manifest.states[sid].last_row)})
    return [store.root / "data" / "kv" / "c" / str(s) / "0" / "0" / "0" / "0" / "0" for s in shards]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="512,1024,2048,4096,8192")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where to put the store (default: a temp dir on /tmp's disk)")
    ap.add_argument("--out", default="benchmarks/results", help="folder for JSON and PNG")
    args = ap.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    rng = random.Random()
    work = Path(tempfile.mkdtemp(prefix="bench-restore-", dir=args.dir))
    mem = kvmemory.Memory(work / "s.kvm")
    C = mem.block_tokens
    rows = []
    method = "?"
    for n in lengths:
        ids = [rng.randrange(mem.tokenizer.vocab_size) for _ in range(n)]
        st = mem.save(ids)
        sid, nbytes = st.id, st.kv.numel() * st.kv.element_size()
        del st
        t = time.perf_counter()
        cache = kvops.make_cache(None, mem.model.config)
        for _ in kvops.prefill_blocks(mem.model, ids, C, cache):
            pass
        recompute = time.perf_counter() - t
        del cache
        cold, warm, cache_s, raw_same, public, sft = [], [], [], [], [], []
        files = state_files(mem, sid)
        st_file = work / f"state-{n}.safetensors"
        from safetensors.torch import load_file, save_file
        save_file({"kv": mem.load(sid).kv.contiguous()}, str(st_file))
        for _ in range(args.reps):
            drop_from_page_cache(work / "s.kvm" / "data")
            t = time.perf_counter()
            c = mem.load(sid).cache()
            public.append(time.perf_counter() - t)
            del c
            drop_from_page_cache(st_file)
            t = time.perf_counter()
            kv = load_file(str(st_file))["kv"]
            c = kvops.make_cache(kv, mem.model.config)
            sft.append(time.perf_counter() - t)
            del c, kv
            method = drop_from_page_cache(work / "s.kvm" / "data")
            nb, dt = raw_read_files(files)
            raw_same.append(nb / dt)
            drop_from_page_cache(work / "s.kvm" / "data")
            t = time.perf_counter()
            s = mem.load(sid)
            cold.append(time.perf_counter() - t)
            del s
            t = time.perf_counter()
            s = mem.load(sid)
            warm.append(time.perf_counter() - t)
            t = time.perf_counter()
            c = s.cache()
            cache_s.append(time.perf_counter() - t)
            del s, c
        row = {"tokens": n, "kv_bytes": nbytes, "recompute_s": recompute, "cold_s": statistics.median(cold),
               "warm_s": statistics.median(warm), "to_cache_s": statistics.median(cache_s),
               "public_cold_s": statistics.median(public), "safetensors_cold_s": statistics.median(sft)}
        row["raw_same_files_gbps"] = statistics.median(raw_same) / 1e9
        row["cold_gbps"] = nbytes / row["cold_s"] / 1e9
        row["warm_gbps"] = nbytes / row["warm_s"] / 1e9
        row["public_cold_gbps"] = nbytes / row["public_cold_s"] / 1e9
        row["public_vs_raw"] = row["public_cold_gbps"] / row["raw_same_files_gbps"]
        row["public_vs_safetensors"] = row["safetensors_cold_s"] / row["public_cold_s"]
        row["speedup_cold"] = recompute / row["cold_s"]
        row["speedup_warm"] = recompute / row["warm_s"]
        rows.append(row)
        print(f"  {n} tokens: recompute {recompute:.2f} s, cold {row['cold_s']:.3f} s, warm {row['warm_s']:.3f} s",
              file=sys.stderr)
    raw = raw_read_bw(work / "raw.bin", max(r["kv_bytes"] for r in rows), args.reps)
    for r in rows:
        r["cold_vs_raw"] = r["cold_gbps"] / r["raw_same_files_gbps"]
        r["cold_vs_raw_fresh_file"] = r["cold_gbps"] * 1e9 / raw
    machine = describe()
    result = {"benchmark": "restore", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "machine": machine, "model": mem.model_name, "block_tokens": C, "cache_eviction": method,
              "raw_disk_gbps": raw / 1e9, "rows": rows}
    print(f"\nrestore vs recompute — {mem.model_name} fp32, C={C}; machine: {machine['cpu']}, "
          f"{machine['cores']} cores; page cache evicted by {method}")
    print(f"raw sequential read of a freshly written file: {raw / 1e9:.2f} GB/s (cold, 16 MiB reads, same run)")
    print("cold/raw compares with raw sequential reads of the same shard files, evicted the same way\n")
    hdr = (f"{'tokens':>6} {'KV MiB':>7} {'recompute s':>11} {'cold s':>7} {'warm s':>7} {'cold GB/s':>9} "
           f"{'raw GB/s':>8} {'cold/raw':>8} {'warm GB/s':>9} {'x cold':>7} {'x warm':>7} {'->cache s':>9}")
    print(hdr)
    for r in rows:
        print(f"{r['tokens']:6d} {r['kv_bytes'] / 2**20:7.0f} {r['recompute_s']:11.2f} {r['cold_s']:7.3f} "
              f"{r['warm_s']:7.3f} {r['cold_gbps']:9.2f} {r['raw_same_files_gbps']:8.2f} {r['cold_vs_raw']:8.0%} {r['warm_gbps']:9.2f} "
              f"{r['speedup_cold']:6.0f}x {r['speedup_warm']:6.0f}x {r['to_cache_s']:9.3f}")
    print("\nthe public call against what a user would write instead (cold, same run):")
    print(f"{'tokens':>6} {'KV MiB':>7} {'load().cache() s':>16} {'safetensors s':>13} {'raw read s':>10} "
          f"{'public/raw':>10} {'x safetensors':>13}")
    for r in rows:
        raw_s = r["kv_bytes"] / (r["raw_same_files_gbps"] * 1e9)
        print(f"{r['tokens']:6d} {r['kv_bytes'] / 2**20:7.0f} {r['public_cold_s']:16.3f} {r['safetensors_cold_s']:13.3f} "
              f"{raw_s:10.3f} {r['public_vs_raw']:10.0%} {r['public_vs_safetensors']:12.2f}x")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d")
    write_json((out / f"restore-{stamp}.json"), result)
    _plot(rows, raw, out / f"restore-{stamp}.png", machine)
    print(f"\nwrote {out}/restore-{stamp}.json and .png")
    import shutil
    shutil.rmtree(work, ignore_errors=True)


def _plot(rows, raw, path, machine) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    x = [r["tokens"] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    a.plot(x, [r["recompute_s"] for r in rows], "o-", label="recompute")
    a.plot(x, [r["cold_s"] for r in rows], "o-", label="restore (cold)")
    a.plot(x, [r["warm_s"] for r in rows], "o-", label="restore (warm)")
    a.set(xscale="log", yscale="log", xlabel="state tokens", ylabel="seconds", title="restore vs recompute")
    a.legend()
    b.plot(x, [r["cold_gbps"] for r in rows], "o-", label="restore cold")
    b.plot(x, [r["warm_gbps"] for r in rows], "o-", label="restore warm")
    b.plot(x, [r["public_cold_gbps"] for r in rows], "o-", label="load().cache() cold")
    b.plot(x, [r["kv_bytes"] / r["safetensors_cold_s"] / 1e9 for r in rows], "s:", label="safetensors by hand, cold")
    b.plot(x, [r["raw_same_files_gbps"] for r in rows], "k--", label="raw read, same files")
    b.set(xscale="log", xlabel="state tokens", ylabel="GB/s", title="restore bandwidth")
    b.legend()
    fig.suptitle(f"kvmemory restore — {machine['cpu']}, {machine['cores']} cores", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
