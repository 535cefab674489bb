"""Kernel benchmark against ceilings measured in the same run (a CUDA GPU; on the CPU, the torch
references at a small size: the dry run of benchmarks/gpu/run.sh).

  gather   gather_blocks (32 blocks of the default model's geometry, half of them shifted)
           vs a device-to-device copy of the same bytes (share of HBM bandwidth)  target >= 80%
           and vs torch.index_select of the same blocks (no rotation)
  page-in  the pager's host tier -> GPU (pinned) vs one pinned H2D copy    target >= 80%
  attn     window_attention, 1 query token over 8,192 tokens, 9 q / 3 kv heads of 64,
           vs torch SDPA (and flash_attn_with_kvcache when importable)      target <= 1.2x
Prints a table, writes JSON (gpu-kernels-DTYPE.json in --out).

    python benchmarks/gpu/bench_kernels.py --dtype bfloat16 --out /tmp/k
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def timed(fn, device: torch.device, reps: int = 20) -> float:
    """Median seconds of fn(): CUDA events on a GPU, the wall clock on the CPU."""
    fn()
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            out.append(a.elapsed_time(b) / 1e3)
        else:
            t = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t)
    return sorted(out)[len(out) // 2]


def measure(device: str = "cuda", dtype: str = "bfloat16", small: bool = False) -> list[dict]:
    """The rows of the table: each op's GB/s or microseconds beside its ceiling measured here."""
    from kvmemory.ops import gather_blocks, window_attention

    dev, dt = torch.device(device), getattr(torch, dtype)
    cuda = dev.type == "cuda"
    L, H, C, D, k = (2, 3, 16, 64, 4) if small else (30, 3, 256, 64, 32)
    reps = 3 if small else 20
    rows = []
    # ---- gather vs device copy and index_select
    pool = torch.randn((2 * k, L, 2, H, C, D), device=dev).to(dt)
    out = torch.empty((L, 2, H, k * C, D), device=dev, dtype=dt)
    idx = torch.randperm(2 * k, device=dev)[:k]
    n = torch.full((k,), C, device=dev)
    dst = torch.arange(k, device=dev) * C
    freqs = (1.0 / 100000 ** (torch.arange(0, D, 2, device=dev).float() / D))
    nbytes = out.numel() * out.element_size()
    src = pool[:k].clone()
    copy_s = timed(lambda: out.view(-1).copy_(src.view(-1)), dev, reps)
    picked = torch.empty((k, L, 2, H, C, D), device=dev, dtype=dt)
    sel_s = timed(lambda: torch.index_select(pool, 0, idx, out=picked), dev, reps)
    rows.append({"op": "index_select (no rotation)", "GB/s": 2 * nbytes / sel_s / 1e9, "ceiling": "device copy",
                 "ceiling GB/s": 2 * nbytes / copy_s / 1e9, "ratio": copy_s / sel_s})
    for label, shift in (("gather, no shift", torch.zeros(k, dtype=torch.long, device=dev)),
                         ("gather, half shifted", (torch.arange(k, device=dev) % 2) * 1000)):
        s = timed(lambda shift=shift: gather_blocks(pool, idx, n, dst, shift, out, freqs), dev, reps)
        rows.append({"op": label, "GB/s": 2 * nbytes / s / 1e9, "ceiling": "device copy",
                     "ceiling GB/s": 2 * nbytes / copy_s / 1e9, "ratio": copy_s / s,
                     "vs index_select": sel_s / s})
    # ---- page-in: host tier (pinned blocks) -> device
    pin = (lambda t: t.pin_memory()) if cuda else (lambda t: t)
    host = [pin(torch.randn((L, 2, H, C, D)).to(dt)) for _ in range(k)]
    big = pin(torch.cat([h.view(-1) for h in host]))
    big_dev = torch.empty_like(big, device=dev)
    h2d_s = timed(lambda: big_dev.copy_(big, non_blocking=True), dev, max(3, reps // 2))
    blocks_dev = torch.empty((k, L, 2, H, C, D), device=dev, dtype=dt)

    def page_in():
        for i, h in enumerate(host):
            blocks_dev[i].copy_(h, non_blocking=True)
    pin_s = timed(page_in, dev, max(3, reps // 2))
    rows.append({"op": "page-in (pinned blocks)" if cuda else "page-in (host blocks)", "GB/s": nbytes / pin_s / 1e9,
                 "ceiling": "pinned H2D" if cuda else "one host copy",
                 "ceiling GB/s": nbytes / h2d_s / 1e9, "ratio": h2d_s / pin_s})
    # ---- window attention vs SDPA (and flash-attn)
    T, Hq = (4 * C if small else 8192), 9
    q = torch.randn((1, Hq, D), device=dev).to(dt)
    kp = torch.randn((T // C, H, C, D), device=dev).to(dt)
    vp = torch.randn((T // C, H, C, D), device=dev).to(dt)
    table = torch.randperm(T // C, device=dev).to(torch.int32)
    attn_s = timed(lambda: window_attention(q, kp, vp, table, T), dev, reps)
    kc = kp[table.long()].permute(1, 0, 2, 3).reshape(H, T, D).contiguous()
    vc = vp[table.long()].permute(1, 0, 2, 3).reshape(H, T, D).contiguous()
    qs = q.transpose(0, 1).unsqueeze(0)
    sdpa_s = timed(lambda: torch.nn.functional.scaled_dot_product_attention(qs, kc.unsqueeze(0), vc.unsqueeze(0),
                                                                             enable_gqa=True), dev, reps)
    best, best_name = sdpa_s, "SDPA (contiguous)"
    try:
        from flash_attn import flash_attn_with_kvcache
        if dt != torch.float32 and cuda:
            kf = kp.permute(0, 2, 1, 3).contiguous()
            vf = vp.permute(0, 2, 1, 3).contiguous()
            fa_s = timed(lambda: flash_attn_with_kvcache(q.unsqueeze(0), kf, vf, cache_seqlens=torch.tensor(
                [T], device=dev, dtype=torch.int32), block_table=table.unsqueeze(0)), dev, reps)
            rows.append({"op": "flash_attn_with_kvcache (paged)", "us": fa_s * 1e6})
            if fa_s < best:
                best, best_name = fa_s, "flash-attn (paged)"
    except ImportError:
        pass
    rows.append({"op": "window_attention (paged)", "us": attn_s * 1e6, "ceiling": best_name,
                 "ceiling us": best * 1e6, "ratio": attn_s / best, "tokens": T})
    for r in rows:
        r["dtype"] = dtype
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu (the references, at a small size)")
    args = ap.parse_args()
    from kvmemory.ops import cuda_ext
    if args.device != "cpu" and (not torch.cuda.is_available() or cuda_ext.load() is None):
        sys.exit(f"no usable CUDA kernels: {cuda_ext.why_not()}")
    rows = measure(args.device, args.dtype, small=args.device == "cpu")
    result = {"benchmark": "gpu-kernels", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "gpu": torch.cuda.get_device_name(0) if args.device != "cpu" else "cpu", "dtype": args.dtype,
              "rows": rows}
    for r in rows:
        print("  ".join(f"{k_}={v:.3g}" if isinstance(v, float) else f"{k_}={v}" for k_, v in r.items()))
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"gpu-kernels-{args.dtype}.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
