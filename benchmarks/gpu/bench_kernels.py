"""GPU kernel benchmark against ceilings measured in the same run (needs a CUDA GPU).

  gather   gather_blocks (32 blocks of the default model's geometry, half of them shifted)
           vs device-to-device copy bandwidth of the same bytes           target >= 80%
  page-in  the pager's host tier -> GPU (pinned) vs one pinned H2D copy    target >= 80%
  attn     window_attention, 1 query token over 8,192 tokens, 9 q / 3 kv heads of 64,
           vs torch SDPA (and flash_attn_with_kvcache when importable)      target <= 1.2x
Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import datetime, timezone
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def timed(fn, reps=20) -> float:
    """Median seconds of fn() measured with CUDA events."""
    fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        out.append(a.elapsed_time(b) / 1e3)
    return sorted(out)[len(out) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    args = ap.parse_args()
    from kvmemory.ops import cuda_ext, gather_blocks, window_attention
    if not torch.cuda.is_available() or cuda_ext.load() is None:
        sys.exit(f"no usable CUDA kernels: {cuda_ext.why_not()}")
    dev, dt = torch.device("cuda"), getattr(torch, args.dtype)
    L, H, C, D, k = 30, 3, 256, 64, 32
    rows = []
    # ---- gather vs device copy
    pool = torch.randn((64, L, 2, H, C, D), device=dev).to(dt)
    out = torch.empty((L, 2, H, k * C, D), device=dev, dtype=dt)
    idx = torch.randperm(64, device=dev)[:k]
    n = torch.full((k,), C, device=dev)
    dst = torch.arange(k, device=dev) * C
    freqs = (1.0 / 100000 ** (torch.arange(0, D, 2, device=dev).float() / D))
    nbytes = out.numel() * out.element_size()
    src = pool[:k].clone()
    copy_s = timed(lambda: out.view(-1).copy_(src.view(-1)))
    for label, shift in (("gather, no shift", torch.zeros(k, dtype=torch.long, device=dev)),
                         ("gather, half shifted", (torch.arange(k, device=dev) % 2) * 1000)):
        s = timed(lambda shift=shift: gather_blocks(pool, idx, n, dst, shift, out, freqs))
        rows.append({"op": label, "GB/s": 2 * nbytes / s / 1e9, "ceiling": "device copy",
                     "ceiling GB/s": 2 * nbytes / copy_s / 1e9, "ratio": copy_s / s})
    # ---- page-in: host tier (pinned blocks) -> GPU
    host = [torch.randn((L, 2, H, C, D)).to(dt).pin_memory() for _ in range(k)]
    big = torch.cat([h.view(-1) for h in host]).pin_memory()
    big_dev = torch.empty_like(big, device=dev)
    h2d_s = timed(lambda: big_dev.copy_(big, non_blocking=True), reps=10)
    blocks_dev = torch.empty((k, L, 2, H, C, D), device=dev, dtype=dt)

    def page_in():
        for i, h in enumerate(host):
            blocks_dev[i].copy_(h, non_blocking=True)
    pin_s = timed(page_in, reps=10)
    rows.append({"op": "page-in (pinned blocks)", "GB/s": nbytes / pin_s / 1e9, "ceiling": "pinned H2D",
                 "ceiling GB/s": nbytes / h2d_s / 1e9, "ratio": h2d_s / pin_s})
    # ---- window attention vs SDPA (and flash-attn)
    T, Hq = 8192, 9
    q = torch.randn((1, Hq, D), device=dev).to(dt)
    kp = torch.randn((T // C, H, C, D), device=dev).to(dt)
    vp = torch.randn((T // C, H, C, D), device=dev).to(dt)
    table = torch.randperm(T // C, device=dev).to(torch.int32)
    attn_s = timed(lambda: window_attention(q, kp, vp, table, T))
    kc = kp[table.long()].permute(1, 0, 2, 3).reshape(H, T, D).contiguous()
    vc = vp[table.long()].permute(1, 0, 2, 3).reshape(H, T, D).contiguous()
    qs = q.transpose(0, 1).unsqueeze(0)
    sdpa_s = timed(lambda: torch.nn.functional.scaled_dot_product_attention(qs, kc.unsqueeze(0), vc.unsqueeze(0),
                                                                             enable_gqa=True))
    best, best_name = sdpa_s, "SDPA (contiguous)"
    try:
        from flash_attn import flash_attn_with_kvcache
        if dt != torch.float32:
            kf = kp.permute(0, 2, 1, 3).contiguous()
            vf = vp.permute(0, 2, 1, 3).contiguous()
            fa_s = timed(lambda: flash_attn_with_kvcache(q.unsqueeze(0), kf, vf, cache_seqlens=torch.tensor(
                [T], device=dev, dtype=torch.int32), block_table=table.unsqueeze(0)))
            rows.append({"op": "flash_attn_with_kvcache (paged)", "us": fa_s * 1e6})
            if fa_s < best:
                best, best_name = fa_s, "flash-attn (paged)"
    except ImportError:
        pass
    rows.append({"op": "window_attention (paged)", "us": attn_s * 1e6, "ceiling": best_name,
                 "ceiling us": best * 1e6, "ratio": attn_s / best})
    result = {"benchmark": "gpu-kernels", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "gpu": torch.cuda.get_device_name(0), "dtype": args.dtype, "rows": rows}
    for r in rows:
        print("  ".join(f"{k_}={v:.3g}" if isinstance(v, float) else f"{k_}={v}" for k_, v in r.items()))
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"gpu-kernels-{args.dtype}.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
