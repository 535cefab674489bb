"""The dtype `kvmemory serve` computes in when nobody chose one: measured on the machine it starts on.

bfloat16 prefills the default model ~2.6x and decodes it ~1.8x faster than float32 on a CPU with
AVX-512 BF16 or AMX (benchmarks/results/dtype-2026-12-04.json), and the default model's answers in
it were measured no worse (bench_qa, one draw of 60 questions: 31/60 against 30/60 in float32;
docs/concepts/precision.md); on a CPU without those instructions bf16 is slower. So a new store of
the default model is served in bfloat16 where this CPU has AVX-512 BF16 or AMX *and* a bf16 GEMM
measures faster than float32 here at start-up; float32 elsewhere, and for any other model (its
answers in bf16 are not measured: `--dtype bfloat16` chooses it). A store that exists opens in the
dtype its blocks were computed in, always (its dtype is in its fingerprint: never mixed silently).
"""

from __future__ import annotations

import time
from pathlib import Path

BF16_FLAGS = ("avx512_bf16", "amx_bf16")
MIN_SPEEDUP = 1.3          # a bf16 GEMM at least this much faster than fp32, measured at start-up


def cpu_flags() -> set[str]:
    """This CPU's feature flags (/proc/cpuinfo; empty where there is none)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def gemm_speedup(rows: int = 256, dim: int = 1024, reps: int = 5) -> float:
    """float32 time / bfloat16 time of a [rows, dim] x [dim, dim] product here (best of reps)."""
    import torch

    def best(dtype) -> float:
        a = torch.randn(rows, dim).to(dtype)
        b = torch.randn(dim, dim).to(dtype)
        a @ b                                           # warm up
        t = []
        for _ in range(reps):
            s = time.perf_counter()
            a @ b
            t.append(time.perf_counter() - s)
        return min(t)
    return best(torch.float32) / best(torch.bfloat16)


def default_dtype(device: str = "cpu", default_model: bool = True) -> tuple[str, str]:
    """(dtype, why) for a new store served without a dtype asked for."""
    if device.startswith("cuda"):
        import torch
        if torch.cuda.is_available() and torch.cuda.is_bf16_supported():
            return "bfloat16", "a GPU with bfloat16 support"
        return "float32", "a GPU without bfloat16 support"
    if not default_model:
        return "float32", ("this model's answers in bfloat16 are not measured: float32 (--dtype bfloat16 to choose "
                           "it)")
    have = [f for f in BF16_FLAGS if f in cpu_flags()]
    if not have:
        return "float32", "this CPU has neither AVX-512 BF16 nor AMX: bfloat16 would be slower here"
    s = gemm_speedup()
    if s < MIN_SPEEDUP:
        return "float32", f"this CPU has {have[0]}, but a bfloat16 GEMM measured only {s:.2f}x float32's speed here"
    return "bfloat16", (f"this CPU has {have[0]} and a bfloat16 GEMM measured {s:.1f}x float32's speed here; the "
                        "default model's answers in bfloat16 were measured no worse (docs/concepts/precision.md)")
