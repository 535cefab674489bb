"""The dtype `kvmemory serve` computes in when nobody chose one: decided by this CPU's instructions.

bfloat16 prefills the default model ~2.6x and decodes it ~1.8x faster than float32 on a CPU with
AVX-512 BF16 (the 2-core EPYC, benchmarks/results/dtype-2026-12-04.json; a bf16 GEMM ~6x on the AMX Xeon), and the
default model's answers in it were measured no worse (bench_qa, one draw of 60 questions: 31/60
against 30/60 in float32; docs/concepts/precision.md); on a CPU without those instructions bf16 is
slower. So a new store of the default model is served in bfloat16 where this CPU has AVX-512 BF16
or AMX; float32 elsewhere, and for any other model (its answers in bf16 are not measured:
`--dtype bfloat16` chooses it). A store that exists opens in the dtype its blocks were computed
in, always (its dtype is in its fingerprint: never mixed silently).

The choice was once also a bf16 GEMM timed against float32 at start-up (bf16 only where it measured
1.3x faster). A timing is not a function of the machine: one `kvmemory serve` in seven on an AMX
Xeon that measures ~6x made its new store float32 (2026-12-06), so two servers of one machine
answered the same conversation differently. And that float32 GEMM, run before the model's first
bf16 forward, made that forward's KV bytes differ from process to process (see
kvmemory.model.loader.warm_up). The instructions are a function of the machine.
"""

from __future__ import annotations

from pathlib import Path

BF16_FLAGS = ("avx512_bf16", "amx_bf16")


def cpu_flags() -> set[str]:
    """This CPU's feature flags (/proc/cpuinfo; empty where there is none)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


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
    return "bfloat16", (f"this CPU has {have[0]}: bfloat16 prefills ~2.6x faster than float32 on such a CPU, and "
                        "the default model's answers in it were measured no worse (docs/concepts/precision.md)")
