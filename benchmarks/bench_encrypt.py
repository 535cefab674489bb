"""Encryption at rest: what it costs, side by side with a plain store in one run.

The default model (bfloat16 unless --dtype says otherwise) computes the KV of fresh prose once per
size; the same blocks then go into a plain and an encrypted store (kvmemory/store/seal.py), in
alternating order, rep by rep:

- write: the store's own commit of those blocks (MB/s of KV; each rep a new owner, so every block
  is new: a salted chain), and once per size a whole `Memory.save` (prefill + commit, tokens/s);
- cold restore: the state read back verified (digests, and the GCM tags of the encrypted store)
  after its files were evicted from the page cache, and warm (page cache hot), median of --reps;
- bytes on disk of the two stores.

The ratio encrypted / plain of each median is the figure (target: cold restore within 1.15x).

    python benchmarks/bench_encrypt.py --tokens 2048,8192 --reps 5
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_codec import prose  # noqa: E402
from common import add_common_args, drop_from_page_cache, finish, plot, seed_of  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="2048,8192", help="state sizes, comma-separated, at most the model's window (default 2048,8192)")
    ap.add_argument("--reps", type=int, default=5, help="repetitions of each measurement (default 5)")
    ap.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"), help="the model's dtype")
    add_common_args(ap)
    args = ap.parse_args()
    seed = seed_of(args)
    rng = random.Random(seed)

    import torch

    import kvmemory
    from kvmemory import hashing, kv as kvops
    from kvmemory.keys import LocalKeyProvider, new_master_key, parse_master_key
    from kvmemory.store import Change

    work = Path(tempfile.mkdtemp(prefix="bench-encrypt-"))
    keys = LocalKeyProvider(work / "keyring", parse_master_key(new_master_key(), "bench"))
    plain = kvmemory.Memory(work / "plain.kvm", dtype=args.dtype)
    model = (plain.model, plain.tokenizer)
    enc = kvmemory.Memory(work / "enc.kvm", model=model, encrypt=True, keys=keys)
    stores = {"plain": plain, "encrypted": enc}
    rows = []
    for n in [int(x) for x in args.tokens.split(",")]:
        ids = plain.tokenize(prose(rng, n))[:n]
        while len(ids) < n:
            ids += plain.tokenize(prose(rng, n))[: n - len(ids)]
        row: dict = {"tokens": n}
        # a whole save each (prefill + commit), once
        for name, mem in stores.items():
            t0 = time.perf_counter()
            st = mem.save(ids, label="bench")
            row[f"{name}_save_tok_s"] = n / (time.perf_counter() - t0)
            row[f"{name}_state"] = st.id
        kv = st.kv
        C = plain.store.manifest.block_tokens
        blocks = [kvops.to_storage(kv[:, :, :, i:i + C]) for i in range(0, n, C)]
        kv_bytes = sum(b.nbytes for b in blocks)
        writes: dict[str, list[float]] = {k: [] for k in stores}
        cold: dict[str, list[float]] = {k: [] for k in stores}
        warm: dict[str, list[float]] = {k: [] for k in stores}
        for rep in range(args.reps):
            order = list(stores) if rep % 2 == 0 else list(stores)[::-1]
            for name in order:
                store = stores[name].store
                owner = f"bench-{n}-{rep}"
                root = store.owner_root(owner)
                chain = hashing.chain_ids(store.manifest.fingerprint, ids, C, parent=root)

                def build(s, chain=chain, root=root, owner=owner):
                    new, _ = s.plan_chain(chain, ids, 0, -1, lambda i: blocks[i], root, owner)
                    return Change(new)
                t0 = time.perf_counter()
                store.commit(build)
                writes[name].append(time.perf_counter() - t0)
            for name in order:
                mem = stores[name]
                drop_from_page_cache(mem.path / "data")
                t0 = time.perf_counter()
                got = mem.load(row[f"{name}_state"])
                cold[name].append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                mem.load(row[f"{name}_state"])
                warm[name].append(time.perf_counter() - t0)
                assert torch.equal(got.kv, kv), f"{name}: the restored KV differs"
        for name in stores:
            row[f"{name}_write_mb_s"] = kv_bytes / statistics.median(writes[name]) / 2**20
            row[f"{name}_cold_s"] = statistics.median(cold[name])
            row[f"{name}_warm_s"] = statistics.median(warm[name])
            row[f"{name}_disk_bytes"] = stores[name].store.disk_bytes()
        for k in ("cold_s", "warm_s"):
            row[f"ratio_{k}"] = row[f"encrypted_{k}"] / row[f"plain_{k}"]
        row["ratio_write"] = row["plain_write_mb_s"] / row["encrypted_write_mb_s"]
        row["ratio_save"] = row["plain_save_tok_s"] / row["encrypted_save_tok_s"]
        row["ratio_disk"] = row["encrypted_disk_bytes"] / row["plain_disk_bytes"]
        row["kv_mb"] = kv_bytes / 2**20
        rows.append(row)
        print(f"{n:>6} tokens ({row['kv_mb']:.0f} MB): cold restore {row['plain_cold_s']:.3f} s plain, "
              f"{row['encrypted_cold_s']:.3f} s encrypted (x{row['ratio_cold_s']:.2f}); warm x{row['ratio_warm_s']:.2f}; "
              f"write {row['plain_write_mb_s']:.0f} vs {row['encrypted_write_mb_s']:.0f} MB/s "
              f"(x{row['ratio_write']:.2f}); save x{row['ratio_save']:.2f}; disk x{row['ratio_disk']:.4f}",
              flush=True)
    plain.close()
    enc.close()
    path = finish({"rows": rows, "reps": args.reps, "dtype": args.dtype}, seed, args, "encrypt")

    def draw(fig):
        ax = fig.add_subplot(1, 1, 1)
        labels = ["cold restore", "warm restore", "commit", "save"]
        w = 0.8 / len(rows)
        for i, r in enumerate(rows):
            vals = [r["ratio_cold_s"], r["ratio_warm_s"], r["ratio_write"], r["ratio_save"]]
            ax.bar([j + i * w for j in range(len(labels))], vals, w, label=f"{r['tokens']} tokens")
        ax.axhline(1.15, color="grey", ls="--", lw=1, label="target 1.15x")
        ax.set_xticks([j + w * (len(rows) - 1) / 2 for j in range(len(labels))], labels)
        ax.set_ylabel("encrypted / plain (time)")
        ax.set_title("Encryption at rest: cost against a plain store (same blocks, one run)")
        ax.legend()
    plot(path, draw)


if __name__ == "__main__":
    main()
