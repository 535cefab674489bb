"""Lossless compression of real KV: which codec, at what speed, and does a cold restore gain?

Real KV of the default model (fp32, and the same values cast to bf16): a fresh text prefilled the
canonical way, cut in 256-token blocks. For each Blosc codec (zstd, lz4, lz4hc at a few levels;
no shuffle, byte shuffle, bit shuffle) side by side on the same blocks: compression ratio, encode
and decode GB/s (of uncompressed bytes; Blosc's own threads), every decode checked bit-exact.
Then the store itself: the same document deposited into a raw, a zstd and an lz4 store
(StoreConfig(codec=...)), its blocks read back verified from a cold page cache (median of
--reps), against the raw store's read. Then the compact tier (lossy, opt-in): the raw store
compacted to bf16 and fp16 (`Memory.compact`), each copy's disk bytes, compaction time, cold
verified read (decoded to fp32), and its error against the exact blocks: next-token KL and the
greedy token at every chain end (one per deposit segment, plus the prelude), key/value relative
error; and the KL of fresh 16-token suffixes after restoring each segment's chain from the copy
against restoring it exact (a measure the compaction did not take: fresh inputs).

    python benchmarks/bench_codec.py --tokens 4096
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import add_common_args, drop_from_page_cache, finish, plot, seed_of  # noqa: E402

WORDS = ("the of and a to in is was he for it with as his on be at by had are but from or have an they which "
         "one you were all we her she there would their will when who him been has more if no out so said what "
         "up its about than into them can only other new some time could these two may first then do any like "
         "my now over such our man me even most made after also did many before must through back years where "
         "much your way well down should because each just those people how too little state good very make "
         "world still own see men work long get here between both life being under never day same another "
         "know while last might us great old year off come since against go came right used take three").split()

CODECS = [("zstd", 1, "noshuffle"), ("zstd", 1, "shuffle"), ("zstd", 3, "shuffle"), ("zstd", 5, "shuffle"),
          ("zstd", 1, "bitshuffle"), ("zstd", 3, "bitshuffle"), ("lz4", 5, "noshuffle"), ("lz4", 5, "shuffle"),
          ("lz4", 5, "bitshuffle"), ("lz4hc", 5, "shuffle")]
SHUFFLE = {"noshuffle": 0, "shuffle": 1, "bitshuffle": 2}


def prose(rng: random.Random, n_words: int) -> str:
    out = []
    while len(out) < n_words:
        s = [rng.choice(WORDS) for _ in range(rng.randrange(6, 18))]
        out += [s[0].capitalize()] + s[1:-1] + [s[-1] + "."]
    return " ".join(out)


def round_trips(blocks: list[np.ndarray], reps: int, encode, decode):
    """Encode every block, decode it again (decode(packed, block)), reps times: (packed, decoded,
    median encode seconds, median decode seconds)."""
    enc, dec = [], []
    for _ in range(reps):
        t = time.perf_counter()
        packed = [encode(b) for b in blocks]
        enc.append(time.perf_counter() - t)
        t = time.perf_counter()
        back = [decode(p, b) for p, b in zip(packed, blocks)]
        dec.append(time.perf_counter() - t)
    return packed, back, statistics.median(enc), statistics.median(dec)


def codec_table(blocks: list[np.ndarray], reps: int) -> list[dict]:
    from numcodecs import Blosc
    raw = sum(b.nbytes for b in blocks)
    rows = []
    for cname, level, shuffle in CODECS:
        c = Blosc(cname=cname, clevel=level, shuffle=SHUFFLE[shuffle])
        packed, back, enc, dec = round_trips(blocks, reps, c.encode,
                                             lambda p, b: np.frombuffer(c.decode(p), dtype=b.dtype))
        for b, x in zip(blocks, back):                       # lossless, bit for bit
            assert np.array_equal(b.reshape(-1).view(np.uint8), x.view(np.uint8)), (cname, shuffle)
        size = sum(len(p) for p in packed)
        rows.append({"codec": f"{cname}-{level}-{shuffle}", "ratio": raw / size, "encode_GBps": raw / enc / 1e9,
                     "decode_GBps": raw / dec / 1e9})
    return rows


def store_reads(text: str, reps: int, tmp: Path) -> list[dict]:
    import kvmemory
    from kvmemory.config import StoreConfig
    from kvmemory.store.blocks import BlockStore
    out = []
    for codec in ("none", "zstd", "lz4"):
        path = tmp / f"{codec}.kvm"
        mem = kvmemory.Memory(path, store_config=StoreConfig(codec=codec))
        t = time.perf_counter()
        mem.add(text, doc_id="doc")
        add_s = time.perf_counter() - t
        rows = list(mem.store.manifest.docs["doc"].rows)
        n_tokens = mem.store.manifest.docs["doc"].n_tokens
        mem.close()
        times = []
        for _ in range(reps):
            method = drop_from_page_cache(path)
            store = BlockStore.open(path, read_only=True)       # nothing cached in the process either
            t = time.perf_counter()
            kv, _ = store.read_kv(rows)                          # digest-verified
            times.append(time.perf_counter() - t)
        disk = sum(p.stat().st_size for p in (path / "data").rglob("*") if p.is_file())
        out.append({"codec": codec, "tokens": n_tokens, "blocks": len(rows), "kv_bytes": int(kv.nbytes),
                    "disk_bytes": disk, "read_cold_s": statistics.median(times), "read_all_s": times,
                    "evicted_by": method, "deposit_s": add_s})
    return out


def encoding_speed(blocks: list[np.ndarray], reps: int) -> dict:
    """Encode and decode GB/s (of fp32 bytes) of each compact encoding on the same blocks."""
    from kvmemory.store import encoding as encodings
    raw = sum(b.nbytes for b in blocks)
    out = {}
    for name in ("bf16", "fp16"):
        e = encodings.get(name, "float32")
        packed, back, enc, dec = round_trips(blocks, reps, e.encode, lambda p, b: e.decode(p))
        assert all(np.array_equal(e.encode(x), p) for x, p in zip(back, packed))   # decoding widens exactly
        out[name] = {"encode_GBps": raw / enc / 1e9, "decode_GBps": raw / dec / 1e9}
    return out


def compact_tier(tmp: Path, reps: int, rng: random.Random, speed: dict) -> list[dict]:
    """The raw store compacted to bf16 and fp16: size, time, cold read, error against the exact blocks."""
    import torch

    import kvmemory
    from kvmemory import kv as kvops
    from kvmemory.compact import chain_ends
    from kvmemory.exactness import kl_divergence
    from kvmemory.store.blocks import BlockStore
    exact_path = tmp / "none.kvm"
    mem = kvmemory.Memory(exact_path, read_only=True)
    rows = list(mem.store.manifest.docs["doc"].rows)
    vocab = mem.model.get_input_embeddings().num_embeddings
    ends = chain_ends(mem.store)
    suffixes = [[rng.randrange(vocab) for _ in range(16)] for _ in ends]
    out = []
    for enc in ("bf16", "fp16"):
        path = tmp / f"compact-{enc}.kvm"
        t = time.perf_counter()
        rep = mem.compact(path, enc)
        compact_s = time.perf_counter() - t
        times = []
        for _ in range(reps):
            method = drop_from_page_cache(path)
            store = BlockStore.open(path, read_only=True)
            t = time.perf_counter()
            store.read_kv(rows)                               # digest-verified, decoded to fp32
            times.append(time.perf_counter() - t)
        copy = BlockStore.open(path, read_only=True)
        fresh = []                                           # KL over fresh suffixes, every position
        with torch.inference_mode():
            for end, suf in zip(ends, suffixes):
                chain = mem.store.chain(end)
                logits = []
                for st in (mem.store, copy):
                    kv = kvops.from_storage(st.read_state_kv(chain), torch.float32)
                    cache = kvops.make_cache(kv, mem.model.config)
                    logits.append(mem.model(input_ids=torch.tensor([suf]), past_key_values=cache).logits[0])
                fresh.append(kl_divergence(logits[0], logits[1]) / len(suf))
        disk = sum(p.stat().st_size for p in (path / "data").rglob("*") if p.is_file())
        out.append({"encoding": enc, **speed[enc], "blocks": rep.blocks, "tokens": rep.tokens, "disk_bytes": disk,
                    "compact_s": compact_s, "read_cold_s": statistics.median(times), "read_all_s": times,
                    "evicted_by": method, "chains": rep.chains, "chains_same_top1": rep.chains_same_top1,
                    "kl_max": rep.kl_max, "kl_mean": rep.kl_mean, "logit_diff_max": rep.logit_diff_max,
                    "key_rel_error_max": rep.key_rel_error_max, "value_rel_error_max": rep.value_rel_error_max,
                    "fresh_suffix_kl_per_token_max": max(fresh),
                    "fresh_suffix_kl_per_token_mean": statistics.mean(fresh)})
    mem.close()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=4096, help="tokens of fresh text prefilled (KV measured)")
    ap.add_argument("--reps", type=int, default=3)
    add_common_args(ap)
    ap.add_argument("--tag", default="", help="appended to the result files' names")
    args = ap.parse_args()
    seed = seed_of(args)
    rng = random.Random(seed)
    import torch

    import kvmemory
    from kvmemory import kv as kvops
    text = prose(rng, int(args.tokens * 0.8))
    with tempfile.TemporaryDirectory(prefix="kvm-codec-") as tmp:
        mem = kvmemory.Memory(Path(tmp) / "probe.kvm")
        ids = mem.tokenize(text)[:args.tokens]
        with torch.inference_mode():
            blocks32 = [kv.contiguous().numpy().copy() for _, kv, _ in kvops.prefill_blocks(mem.model, ids, 256)]
        mem.close()
        blocks16 = [torch.from_numpy(b).to(torch.bfloat16).view(torch.int16).numpy() for b in blocks32]
        table = {"float32": codec_table(blocks32, args.reps), "bfloat16": codec_table(blocks16, args.reps)}
        store = store_reads(text, args.reps, Path(tmp))
        compact = compact_tier(Path(tmp), args.reps, rng, encoding_speed(blocks32, args.reps))
    res = {"tokens": len(ids), "blocks": len(blocks32), "codecs": table, "store": store, "compact": compact}
    out = finish(res, seed, args, "codec" + (f"-{args.tag}" if args.tag else ""))
    for dt, rows in table.items():
        print(f"\n{dt} KV, {len(ids)} tokens in {len(blocks32)} blocks (seed {seed}):")
        print("| codec | ratio | encode GB/s | decode GB/s |\n|---|---|---|---|")
        for r in rows:
            print(f"| {r['codec']} | {r['ratio']:.3f} | {r['encode_GBps']:.2f} | {r['decode_GBps']:.2f} |")
    print("\n| store codec | tokens | on disk / KV | cold verified read | vs raw |\n|---|---|---|---|---|")
    base = store[0]["read_cold_s"]
    for s in store:
        print(f"| {s['codec']} | {s['tokens']} | {s['disk_bytes'] / s['kv_bytes']:.3f} | {s['read_cold_s'] * 1000:.0f} ms"
              f" | x{s['read_cold_s'] / base:.2f} |")
    print("\n| compact tier | encode / decode GB/s | on disk / KV | compaction | cold verified read | vs raw "
          "| next-token KL max (mean) | same greedy token | fresh-suffix KL/token max (mean) "
          "| key / value rel. error max |\n|---|---|---|---|---|---|---|---|---|---|")
    for c in compact:
        print(f"| {c['encoding']} | {c['encode_GBps']:.2f} / {c['decode_GBps']:.2f} "
              f"| {c['disk_bytes'] / store[0]['kv_bytes']:.3f} | {c['compact_s']:.1f} s "
              f"| {c['read_cold_s'] * 1000:.0f} ms | x{c['read_cold_s'] / base:.2f} | {c['kl_max']:.2g} "
              f"({c['kl_mean']:.2g}) | {c['chains_same_top1']}/{c['chains']} "
              f"| {c['fresh_suffix_kl_per_token_max']:.2g} "
              f"({c['fresh_suffix_kl_per_token_mean']:.2g}) | {c['key_rel_error_max']:.2g} / "
              f"{c['value_rel_error_max']:.2g} |")

    def draw(fig):
        ax = fig.subplots()
        for dt, mk in (("float32", "o"), ("bfloat16", "s")):
            for r in table[dt]:
                ax.scatter(r["ratio"], r["decode_GBps"], marker=mk)
                ax.annotate(f"{r['codec']} {dt[:4]}", (r["ratio"], r["decode_GBps"]), fontsize=6)
        ax.set(xlabel="compression ratio", ylabel="decode GB/s", title="lossless codecs on real KV")
    plot(out, draw)
    return 0


if __name__ == "__main__":
    sys.exit(main())
