"""Model families at their real size: random weights in a popular checkpoint's exact config (speed,
bytes and exactness do not depend on training), on this machine.

Per family, one after the other in one run:
  prefill      tokens/s of the canonical block-aligned prefill (a save of --tokens tokens)
  restore      a stored state of --tokens tokens restored from disk + a 32-token suffix (time to the
               suffix's logits) against recomputing the prefix + the suffix: the TTFT ratio
  bytes        KV bytes per token (geometry) and on disk (the store's kv files / stored tokens)
  E3           --e3 states (fresh random lengths up to --tokens / 4) restored + a suffix: logits
               bit-identical to the canonical prefill's (torch.equal), counted
  batched      a decode step of 8 sequences batched (forward_many) against 8 steps alone
  dead         the share of the stored KV bytes a local (sliding-window) layer holds past its window
               for a state of --tokens tokens: stored, never attended to by the tokens after it
Families whose config the engine refuses (Phi-3.5-mini's longrope) are reported with the reason.

    python benchmarks/bench_models.py                          # every family, 4,096 tokens, bfloat16
    python benchmarks/bench_models.py --families qwen2.5-0.5b --tokens 1024 --dtype float32
"""

from __future__ import annotations

import argparse
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import add_common_args, finish, plot, seed_of  # noqa: E402

import torch  # noqa: E402

# the published configs of popular checkpoints (config.json values that shape the computation)
CHECKPOINTS = {
    # not a checkpoint: a 2-layer Llama for the benchmark's own smoke test (tests/benchmarks)
    "tiny-llama": ("LlamaConfig", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=49152,
                                       max_position_embeddings=8192, tie_word_embeddings=True,
                                       rope_parameters={"rope_theta": 100000.0, "rope_type": "default"})),
    "smollm2-135m": ("LlamaConfig", dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                                         num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
                                         max_position_embeddings=8192, tie_word_embeddings=True,
                                         rope_parameters={"rope_theta": 100000.0, "rope_type": "default"})),
    "llama-3.2-1b": ("LlamaConfig", dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                                         num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                                         vocab_size=128256, max_position_embeddings=131072, tie_word_embeddings=True,
                                         rope_parameters={"rope_theta": 500000.0, "rope_type": "llama3",
                                                          "factor": 32.0, "low_freq_factor": 1.0,
                                                          "high_freq_factor": 4.0,
                                                          "original_max_position_embeddings": 8192})),
    "qwen2.5-0.5b": ("Qwen2Config", dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                                         num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
                                         max_position_embeddings=32768, tie_word_embeddings=True,
                                         use_sliding_window=False,
                                         rope_parameters={"rope_theta": 1000000.0, "rope_type": "default"})),
    "qwen3-0.6b": ("Qwen3Config", dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                                       num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                                       vocab_size=151936, max_position_embeddings=40960, tie_word_embeddings=True,
                                       use_sliding_window=False,
                                       rope_parameters={"rope_theta": 1000000.0, "rope_type": "default"})),
    "olmo-2-1b": ("Olmo2Config", dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                                      num_attention_heads=16, num_key_value_heads=16, vocab_size=100352,
                                      max_position_embeddings=4096, tie_word_embeddings=False,
                                      rope_parameters={"rope_theta": 500000.0, "rope_type": "default"})),
    "gemma-3-1b": ("Gemma3TextConfig", dict(hidden_size=1152, intermediate_size=6912, num_hidden_layers=26,
                                            num_attention_heads=4, num_key_value_heads=1, head_dim=256,
                                            vocab_size=262144, max_position_embeddings=32768, sliding_window=512,
                                            rope_parameters={"rope_theta": 1000000.0, "rope_type": "default"})),
    # refused (longrope past its original window): reported with the reason, never built
    "phi-3.5-mini": ("Phi3Config", dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=32,
                                        num_attention_heads=32, num_key_value_heads=32, vocab_size=32064,
                                        max_position_embeddings=131072, original_max_position_embeddings=4096,
                                        sliding_window=None,
                                        rope_parameters={"rope_theta": 10000.0, "rope_type": "longrope",
                                                         "short_factor": [1.0] * 48, "long_factor": [1.5] * 48,
                                                         "original_max_position_embeddings": 4096})),
}


def build(name: str, dtype):
    import transformers
    from transformers import AutoModelForCausalLM

    cls, kw = CHECKPOINTS[name]
    cfg = getattr(transformers, cls)(**kw)
    torch.manual_seed(0)
    with torch.device("cpu"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    return model.eval()


@torch.inference_mode()
def canonical_prefill(model, ids, C):
    """The store's canonical prefill (block-aligned forwards of C tokens), on the model's device."""
    from kvmemory import kv as kvops
    cache = kvops.make_cache(None, model.config)
    for s in range(0, len(ids), C):
        model(input_ids=torch.tensor([ids[s:s + C]], device=model.device), past_key_values=cache, use_cache=True)
    return cache


def measure(name: str, args, rng: random.Random, tok, work: Path) -> dict:
    import kvmemory
    from kvmemory.batching import forward_many
    from kvmemory.errors import ModelLoadError
    from kvmemory.model.families import refusal

    cls, kw = CHECKPOINTS[name]
    import transformers
    why = refusal(getattr(transformers, cls)(**kw))
    if why is not None:
        print(f"{name}: refused: {why}", file=sys.stderr)
        return {"family": name, "refused": why}
    t = time.perf_counter()
    model = build(name, getattr(torch, args.dtype))
    build_s = time.perf_counter() - t
    params = sum(p.numel() for p in model.parameters())
    path = work / f"{name}.kvm"
    try:
        mem = kvmemory.Memory(path, model=(model, tok))
    except ModelLoadError as e:
        return {"family": name, "refused": str(e)}
    C = mem.block_tokens
    vocab = min(len(tok), model.config.vocab_size)
    ids = [rng.randrange(100, vocab) for _ in range(args.tokens)]
    suffix = [rng.randrange(100, vocab) for _ in range(32)]
    t = time.perf_counter()
    sid = mem.save(ids).id
    save_s = time.perf_counter() - t
    mem.close()
    disk = sum(f.stat().st_size for f in (path / "data").rglob("*") if f.is_file())
    mem = kvmemory.Memory(path, model=(model, tok))
    t = time.perf_counter()
    st = mem.load(sid)
    with torch.inference_mode():
        graft = mem.model(input_ids=torch.tensor([suffix]), past_key_values=st.cache()).logits[0, -1]
    restore_s = time.perf_counter() - t
    t = time.perf_counter()
    with torch.inference_mode():
        fresh = mem.model(input_ids=torch.tensor([suffix]), past_key_values=canonical_prefill(model, ids, C)).logits[0, -1]
    recompute_s = time.perf_counter() - t
    e3 = [torch.equal(graft, fresh)]
    for _ in range(args.e3 - 1):
        n = rng.randrange(1, max(2, args.tokens // 4))
        x = [rng.randrange(100, vocab) for _ in range(n)]
        sfx = [rng.randrange(100, vocab) for _ in range(rng.randrange(1, 9))]
        s = mem.load(mem.save(x).id)
        with torch.inference_mode():
            a = mem.model(input_ids=torch.tensor([sfx]), past_key_values=s.cache()).logits[0]
            b = mem.model(input_ids=torch.tensor([sfx]), past_key_values=canonical_prefill(model, x, C)).logits[0]
        e3.append(torch.equal(a, b))
    # a decode step of 8 sequences of 256 tokens: batched against one at a time
    caches = [canonical_prefill(model, [rng.randrange(100, vocab) for _ in range(256)], C) for _ in range(8)]
    nxt = [[rng.randrange(100, vocab)] for _ in range(8)]
    t = time.perf_counter()
    for c, n in zip(caches, nxt):
        forward_many(model, [c], [n], [1])
    alone_s = time.perf_counter() - t
    t = time.perf_counter()
    forward_many(model, caches, [[rng.randrange(100, vocab)] for _ in range(8)], [1] * 8)
    batched_s = time.perf_counter() - t
    geo = mem.geometry
    # a local layer's KV older than its window is stored but never attended to by the tokens after it
    cfg = model.config
    local = sum(t in ("sliding_attention",) for t in (getattr(cfg, "layer_types", None) or ()))
    window = getattr(cfg, "sliding_window", None) if local else None
    dead = local / geo.layers * max(0, args.tokens - window) / args.tokens if window else 0.0
    out = {"family": name, "config": cls, "params": params, "dtype": args.dtype, "tokens": args.tokens,
           "build_s": build_s, "prefill_tok_s": args.tokens / save_s, "save_s": save_s,
           "restore_suffix_s": restore_s, "recompute_suffix_s": recompute_s, "ttft_ratio": restore_s / recompute_s,
           "kv_bytes_per_token": geo.bytes_per_token, "disk_bytes_per_token": disk / args.tokens,
           "e3_exact": sum(e3), "e3_states": len(e3),
           "step8_batched_s": batched_s, "step8_alone_s": alone_s, "batched_speedup": alone_s / batched_s,
           "local_layers": local, "window": window, "dead_share": dead}
    mem.close()
    shutil.rmtree(path, ignore_errors=True)
    print(f"{name}: {params / 1e9:.2f}B, prefill {out['prefill_tok_s']:.0f} tok/s, restore+32 {restore_s:.2f} s "
          f"vs recompute {recompute_s:.2f} s (x{1 / out['ttft_ratio']:.1f}), {geo.bytes_per_token} B/token, "
          f"E3 {sum(e3)}/{len(e3)}, 8 steps batched x{out['batched_speedup']:.1f}", file=sys.stderr, flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--families", default=",".join(c for c in CHECKPOINTS if c != "tiny-llama"),
                    help=f"comma-separated of {', '.join(CHECKPOINTS)} (default: all but tiny-llama)")
    ap.add_argument("--tokens", type=int, default=4096, help="the stored state's length (default 4096)")
    ap.add_argument("--e3", type=int, default=5, help="states checked for E3 (default 5)")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16")
    add_common_args(ap)
    args = ap.parse_args()
    names = [n for n in args.families.split(",") if n]
    if unknown := sorted(set(names) - set(CHECKPOINTS)):
        raise SystemExit(f"unknown famil(ies) {', '.join(unknown)}; they are {', '.join(CHECKPOINTS)}")
    seed = seed_of(args)
    rng = random.Random(seed)
    from kvmemory.config import RuntimeConfig, from_env
    from kvmemory.model.loader import default_model_dir
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(default_model_dir(from_env(RuntimeConfig).resolved_cache_dir()))
    work = Path(tempfile.mkdtemp(prefix="bench-models-"))
    try:
        rows = [measure(n, args, rng, tok, work) for n in names]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"\n{'family':>14} {'params':>7} {'prefill tok/s':>13} {'restore+32 s':>12} {'recompute s':>11} "
          f"{'TTFT ratio':>10} {'KV B/tok':>9} {'disk B/tok':>10} {'E3':>5} {'8-step x':>8} {'dead':>5}")
    for r in rows:
        if "refused" in r:
            print(f"{r['family']:>14} refused: {r['refused']}")
            continue
        print(f"{r['family']:>14} {r['params'] / 1e9:6.2f}B {r['prefill_tok_s']:13.0f} {r['restore_suffix_s']:12.2f} "
              f"{r['recompute_suffix_s']:11.2f} {r['ttft_ratio']:10.3f} {r['kv_bytes_per_token']:9d} "
              f"{r['disk_bytes_per_token']:10.0f} {r['e3_exact']}/{r['e3_states']} {r['batched_speedup']:8.1f} "
              f"{r['dead_share']:5.0%}")
    path = finish({"rows": rows}, seed, args, "models")
    ok = [r for r in rows if "refused" not in r]

    def draw(fig):
        a, b = fig.subplots(1, 2)
        names_ = [r["family"] for r in ok]
        a.bar(names_, [r["recompute_suffix_s"] for r in ok], label="recompute + 32")
        a.bar(names_, [r["restore_suffix_s"] for r in ok], label="restore + 32")
        a.set(ylabel="seconds", title=f"time to the suffix's logits, {args.tokens} tokens ({args.dtype})")
        a.legend()
        b.bar(names_, [r["kv_bytes_per_token"] / 1024 for r in ok])
        b.set(ylabel="KiB per token", title="KV bytes per token")
        for ax in (a, b):
            ax.tick_params(axis="x", rotation=30, labelsize=7)
    if ok:
        plot(path, draw, size=(12, 4.5))


if __name__ == "__main__":
    main()
