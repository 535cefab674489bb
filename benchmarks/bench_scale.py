"""Past one machine: deposit throughput on Ray workers, and restore bandwidth by storage tier.

Side by side in one run, on fresh random inputs:

deposit   the same fresh documents deposited with the real default model
            local      Memory.add_files in this process (torch's default threads)
            ray x1     kvmemory.distributed.ray_add with 1 Ray worker (1 CPU)
            ray x2     ray_add with 2 workers (1 CPU each)
          tokens/s each, and the ratio to local. Every Ray store is checked to hold the same block
          ids as the local one, and whether their KV bytes are equal too: workers run 1 torch thread
          each here, local 2, and on CPU a partial block's bytes can differ with the thread count
          (ray_add's default, as many threads as the driver, stores equal bytes: tested).

restore   states of the real model's KV geometry (random bytes: bandwidth does not depend on
          them), read with BlockStore.read_state_kv (digest-verified) from
            local store        a store directory (page cache warm: this user cannot drop caches)
            s3 (object store)  a store on moto's S3 server on 127.0.0.1, a fresh disk tier:
                               every shard object fetched over HTTP
            s3 (disk tier)     the same reads again: served from the local disk tier
            safetensors        the same KV saved as one safetensors file per state and loaded
                               (what a user writes by hand; no verification)
          MB/s each and the ratio to the local store.

The object store here is a local emulator: its bandwidth says what kvmemory's S3 path costs in
CPU and protocol, not what a real S3 bucket delivers over a network. Writes JSON and a PNG;
the projection to a cluster is in docs/scale-out.md.

Usage: python benchmarks/bench_scale.py [--tokens 4096] [--states 8 --state-tokens 2048]
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import describe, seed_of, write_json  # noqa: E402
from s3server import start_moto  # noqa: E402

import torch  # noqa: E402

import kvmemory  # noqa: E402
from kvmemory import hashing, kv as kvops  # noqa: E402
from kvmemory.store.manifest import Manifest, StateEntry  # noqa: E402
from kvmemory.store import BlockStore, Change  # noqa: E402
from kvmemory.store.files import open_files  # noqa: E402

WORDS = ("harbour lantern copper meadow signal orchard basalt thimble ferry quarry mill ledger granite beacon "
         "willow tide cart barley forge kettle river council market bridge tower garden winter summer").split()


def fresh_docs(d: Path, n_docs: int, tokens: int, rng: random.Random) -> list[Path]:
    files = []
    for i in range(n_docs):
        words = []
        while len(words) < tokens // 2:                     # ~2 tokens a word with a number suffix
            words.append(f"{rng.choice(WORDS)}{rng.randrange(1000)}")
        f = d / f"doc{i}.txt"
        f.write_text(" ".join(words) + ".")
        files.append(f)
    return files


def blocks_of(mem: kvmemory.Memory) -> dict:
    s = mem.store
    out = {}
    for doc, e in s.manifest.docs.items():
        meta = s.block_meta(e.rows)
        out[doc] = [(b.tobytes(), g.tobytes()) for b, g in zip(meta["block_id"], meta["digest"])]
    return out


def deposit(args, work: Path, rng: random.Random) -> dict:
    import ray

    from kvmemory.distributed import ray_add

    files = fresh_docs(work, args.docs, args.tokens // args.docs, rng)
    rows = {}
    t = time.perf_counter()
    with kvmemory.Memory(work / "local.kvm", segment_blocks=args.segment_blocks) as mem:
        load_s = time.perf_counter() - t
        t = time.perf_counter()
        infos = mem.add_files(files)
        s = time.perf_counter() - t
        ref = blocks_of(mem)
    tokens = sum(i.n_tokens for i in infos)
    rows["local"] = {"seconds": s, "tokens": tokens, "tokens_per_s": tokens / s, "model_load_s": load_s}
    print(f"  local: {tokens} tokens in {s:.1f} s = {tokens / s:.0f} tok/s", flush=True)
    ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False)
    try:
        for n in (1, 2):
            path = work / f"ray{n}.kvm"
            r = ray_add(path, files, workers=n, segment_blocks=args.segment_blocks, threads_per_worker=1)
            with kvmemory.Memory(path) as mem:
                got = blocks_of(mem)
            same_ids = {d: [b for b, _ in v] for d, v in got.items()} == {d: [b for b, _ in v] for d, v in ref.items()}
            same = got == ref
            # compute: from every worker ready (model loaded) to the last document committed, as
            # local's add_files; total: with the driver's and the workers' model loads
            rows[f"ray x{n}"] = {"seconds": r.compute_seconds, "tokens": r.tokens,
                                 "tokens_per_s": r.compute_tokens_per_s, "total_seconds": r.seconds,
                                 "total_tokens_per_s": r.tokens_per_s, "workers": r.workers,
                                 "threads_per_worker": 1, "same_block_ids": same_ids, "same_kv_bytes": same}
            print(f"  ray x{n}: {r.tokens} tokens in {r.compute_seconds:.1f} s = {r.compute_tokens_per_s:.0f} tok/s "
                  f"({r.seconds:.1f} s with model loads); same block ids as local: {same_ids}, same KV bytes: {same}",
                  flush=True)
    finally:
        ray.shutdown()
    for k, v in rows.items():
        v["ratio_to_local"] = v["tokens_per_s"] / rows["local"]["tokens_per_s"]
    return rows


def restore(args, work: Path, gen: torch.Generator) -> dict:
    import boto3
    from safetensors.torch import load_file, save_file

    proc, endpoint = start_moto(timeout_s=30)
    opts = {"endpoint": endpoint, "access_key_id": "bench", "secret_access_key": "bench", "region": "us-east-1",
            "allow_http": True}
    try:
        boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="bench", aws_secret_access_key="bench",
                     region_name="us-east-1").create_bucket(Bucket="kvm-bench")
        # the real default model's geometry, fp32 (what it computes on CPU)
        L, H, D, C = 30, 3, 64, 256
        m = Manifest(fingerprint="kvm1-bench", block_tokens=C, shard_blocks=64, codec="none", kv_dtype="float32",
                     model={"name": "bench", "layers": L, "kv_heads": H, "head_dim": D, "max_positions": 8192})
        local = BlockStore.create(work / "local.kvm", m)
        remote = BlockStore.create_remote(open_files("s3://kvm-bench/store", opts), work / "w-writer", m)
        states, tensors = [], {}
        for i in range(args.states):
            tokens = [int(t) for t in torch.randint(0, 49152, (args.state_tokens,), generator=gen)]
            kv = torch.randn((L, 2, H, args.state_tokens, D), generator=gen)
            ids = hashing.chain_ids(m.fingerprint, tokens, C)
            for store in (local, remote):
                def build(s, ids=ids, tokens=tokens, kv=kv):
                    new, rows = s.plan_chain(ids, tokens, 0, -1,
                                             lambda j: kvops.to_storage(kv[:, :, :, j * C:(j + 1) * C]))
                    return Change(new, {ids[-1].hex(): StateEntry(last_row=rows[-1], n_tokens=len(tokens))})
                store.commit(build)
            sid = ids[-1].hex()
            states.append(sid)
            save_file({"kv": kv}, str(work / f"{sid}.safetensors"))
            tensors[sid] = kv
        nbytes = sum(t.numel() * 4 for t in tensors.values())

        def read_all(store) -> float:
            t = time.perf_counter()
            for sid in states:
                rows = store.chain(store.manifest.states[sid].last_row)
                kv = store.read_state_kv(rows)
                assert kv.shape[3] == args.state_tokens
            return time.perf_counter() - t

        out = {}
        fresh_local = BlockStore.open(work / "local.kvm")
        out["local store"] = read_all(fresh_local)
        reader = BlockStore.open("s3://kvm-bench/store", storage_options=opts, work_dir=work / "w-reader")
        out["s3 (object store)"] = read_all(reader)
        fetched = reader.cache.stats.bytes_fetched
        out["s3 (disk tier)"] = read_all(reader)
        assert reader.cache.stats.bytes_fetched == fetched          # the second pass fetched nothing
        t = time.perf_counter()
        for sid in states:
            kv = load_file(str(work / f"{sid}.safetensors"))["kv"]
            assert torch.equal(kv, tensors[sid])
        out["safetensors"] = time.perf_counter() - t
        rows = {k: {"seconds": v, "bytes": nbytes, "mb_per_s": nbytes / v / 1e6} for k, v in out.items()}
        for k, v in rows.items():
            v["ratio_to_local"] = v["mb_per_s"] / rows["local store"]["mb_per_s"]
            print(f"  {k:18} {v['mb_per_s']:8.0f} MB/s  x{v['ratio_to_local']:.2f} of local", flush=True)
        rows["_meta"] = {"states": args.states, "state_tokens": args.state_tokens, "kv_bytes": nbytes,
                         "bytes_fetched": fetched, "object_store": "moto 5.2 server on 127.0.0.1 (HTTP)"}
        return rows
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def plot(res: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    dep = res["deposit"]
    a1.bar(list(dep), [v["tokens_per_s"] for v in dep.values()], color=["gray", "tab:blue", "tab:blue"])
    a1.set_ylabel("tokens / s")
    a1.set_title("deposit, real model (workers ready -> last commit)")
    rest = {k: v for k, v in res["restore"].items() if not k.startswith("_")}
    a2.bar(list(rest), [v["mb_per_s"] for v in rest.values()], color=["gray", "tab:orange", "tab:green", "tab:purple"])
    a2.set_ylabel("MB / s (digest-verified, except safetensors)")
    a2.set_title("restore by tier")
    a2.tick_params(axis="x", labelrotation=15)
    fig.suptitle(f"bench_scale {res['date']} — {res['machine']['cpu']}, {res['machine']['cores']} cores", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=4096, help="tokens deposited per configuration")
    ap.add_argument("--docs", type=int, default=2)
    ap.add_argument("--segment-blocks", type=int, default=1)
    ap.add_argument("--states", type=int, default=8, help="states read per restore tier")
    ap.add_argument("--state-tokens", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=None, help="default: fresh")
    ap.add_argument("--skip-deposit", action="store_true")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = ap.parse_args()
    seed = seed_of(args)
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    res = {"date": datetime.now(timezone.utc).strftime("%Y-%m-%d"), "seed": seed, "args": vars(args),
           "machine": describe()}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="kvm-scale-") as d:
        d = Path(d)
        print("restore by tier:", flush=True)
        (d / "r").mkdir()
        res["restore"] = restore(args, d / "r", gen)
        if not args.skip_deposit:
            print("deposit:", flush=True)
            (d / "d").mkdir()
            res["deposit"] = deposit(args, d / "d", rng)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"scale-{res['date']}"
    write_json(stem.with_suffix(".json"), res, seed)
    if "deposit" in res:
        plot(res, stem.with_suffix(".png"))
    print(f"wrote {stem}.json/.png; seed {seed}; {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
