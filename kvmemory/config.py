"""Configuration: frozen dataclasses, validated on construction, one loader for env overrides."""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass
from pathlib import Path

from kvmemory.errors import InputError

CODECS = ("none", "zstd", "lz4")


@dataclass(frozen=True)
class StoreConfig:
    """Layout choices fixed when a store is created (later opens read them from the manifest).

    block_tokens: tokens per block (C). 256 by default: on the 2-core reference CPU, chunked
        prefill reaches full single-pass throughput at 256 (371 vs 374 tok/s) while 128 loses
        18%; a 256-token block of the default model is 11.8 MB in fp32, a good I/O unit.
    shard_blocks: blocks per Zarr shard file (4: 47 MB shards for the default model, so a
        million-token store is ~1,000 files and appending one block rewrites at most one shard).
    codec: "none" (raw words, fastest restore), "zstd" (lossless, byte-shuffled, level 3) or "lz4"
        (lossless, bit-shuffled: less ratio, faster decode; benchmarks/bench_codec.py).
    prefill_tokens: tokens per forward of the canonical prefill (kvmemory/kv.py), a divisor of
        block_tokens; 0 (the default): block_tokens, one forward a block. A smaller one (64) lets a
        state that extends a stored one (a conversation's next turn) restore the stored part of
        its last, partial block up to the last multiple of it and compute only the rest (at most
        prefill_tokens - 1 tokens again, not up to block_tokens - 1); deposits run in smaller
        forwards (measured here: 64 prefills ~25% slower than 256, 128 ~5%). It changes the
        bytes of every block, so it is part of the store's fingerprint (blocks of such a store
        are never another store's).
    encrypt: seal the store at rest (AES-256-GCM, kvmemory/store/seal.py): every block's KV and
        token ids and every selection index file, by its owner's data key (a chat user's; the
        store's own for shared documents), data keys wrapped by a master key held apart
        (kvmemory/keys.py: KVMEMORY_KEYRING and KVMEMORY_MASTER_KEY or KVMEMORY_MASTER_KEY_FILE).
    """

    block_tokens: int = 256
    shard_blocks: int = 4
    codec: str = "none"
    prefill_tokens: int = 0
    encrypt: bool = False

    def __post_init__(self) -> None:
        if not (1 <= self.block_tokens <= 65536):
            raise InputError(f"block_tokens must be in 1..65536, got {self.block_tokens}")
        if not (1 <= self.shard_blocks <= 4096):
            raise InputError(f"shard_blocks must be in 1..4096, got {self.shard_blocks}")
        if not (0 <= self.prefill_tokens <= self.block_tokens) or \
                (self.prefill_tokens and self.block_tokens % self.prefill_tokens):
            raise InputError(f"prefill_tokens must be 0 or a divisor of block_tokens ({self.block_tokens}), "
                             f"got {self.prefill_tokens}")
        if self.codec not in CODECS:
            raise InputError(f"codec must be one of {CODECS}, got {self.codec!r}")


DTYPES = ("float32", "bfloat16", "float16")   # what a model loaded from disk may compute in (a loaded model: KVGeometry.dtype)


@dataclass(frozen=True)
class RuntimeConfig:
    """Per-process settings.

    lock_timeout_s: how long a writer waits for another writer's lock before StoreLockedError.
    cache_dir: where converted model weights are cached (default: the user cache directory).
    host_cache_bytes: byte budget of the pager's host-RAM tier (LRU of recently used blocks).
    gpu_cache_bytes: byte budget of the GPU block pool tier (used only when CUDA is present).
    store_cache_bytes: byte budget of the local-disk tier of a store on an object store.
    invariant: compute with the invariant kernels (kvmemory/model/invariant.py): the same KV bytes
        whatever the chunking, the batch or the thread count; a store records the mode.
    dtype: the dtype a model loaded from disk computes in (DTYPES; None: float32). bfloat16 runs
        the default model's prefill ~2.5x and a decode step ~1.8x faster on a CPU with AVX-512 BF16
        (docs/concepts/precision.md); its KV takes half the bytes. A store records its dtype and opens only
        with it: blocks of one dtype are exact against that dtype's computation.
    device: where a model loaded from disk computes: "cpu" (None: the default), "cuda", "cuda:N" or
        "auto" (cuda where there is one); a device the machine lacks is an error, never a fallback.
    """

    lock_timeout_s: float = 30.0
    cache_dir: Path | None = None
    host_cache_bytes: int = 2 << 30
    gpu_cache_bytes: int = 4 << 30
    store_cache_bytes: int = 8 << 30
    invariant: bool = False
    dtype: str | None = None
    device: str | None = None

    def __post_init__(self) -> None:
        if self.device is not None and not (self.device in ("cpu", "cuda", "auto") or
                                            re.fullmatch(r"cuda:\d+", str(self.device))):
            raise InputError(f"device is cpu, cuda, cuda:N or auto, got {self.device!r}")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise InputError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.lock_timeout_s < 0:
            raise InputError(f"lock_timeout_s must be >= 0, got {self.lock_timeout_s}")
        if self.host_cache_bytes < 0 or self.gpu_cache_bytes < 0 or self.store_cache_bytes < 0:
            raise InputError("cache byte budgets must be >= 0")

    def resolved_cache_dir(self) -> Path:
        if self.cache_dir is not None:
            return Path(self.cache_dir)
        import platformdirs

        return Path(platformdirs.user_cache_dir("kvmemory"))


def _env() -> dict[str, str]:
    """environment variable -> the field it sets, of StoreConfig or RuntimeConfig (kvmemory.settings)."""
    from kvmemory.settings import ENV
    names = {f.name for cls in (StoreConfig, RuntimeConfig) for f in dataclasses.fields(cls)}
    return {var: field for var, field in ENV.items() if field in names}


def from_env(cls: type, env: dict[str, str] | None = None, **overrides):
    """Build `cls` (StoreConfig or RuntimeConfig) from defaults, then KVMEMORY_* env, then overrides. The
    environment is read and validated by the one schema of every setting (kvmemory.settings); an
    invalid value is an InputError naming its variable."""
    from kvmemory.settings import load
    env = os.environ if env is None else env
    fields = {f.name for f in dataclasses.fields(cls)}
    settings, source = load(env={k: v for k, v in env.items() if k in _env()})
    kwargs = {k: getattr(settings, k) for k in fields if source.get(k, "default") != "default"}
    kwargs.update({k: v for k, v in overrides.items() if v is not None})
    return cls(**kwargs)

# ask()'s defaults, measured in benchmarks/bench_qa.py (accuracy against k and r on fresh draws)
ASK_TOP_K = 2
ASK_RECOMPUTE = 0.0
ASK_MIN_RELEVANCE = 0.75
# re-rank the fused ranking's first ASK_RERANK blocks by the question's likelihood over their
# stored KV (kvmemory/rerank.py; 0: off); keep a second block only within ASK_RERANK_MARGIN
# nats per question token of the best. On by default since 2026-12-03: over six fresh bench_qa
# draws of 120 questions (32K, 2 x 131K, 3 x 1M) it answered 288 of 720 against 275 without it
# (19 gained, 6 lost, paired), at the same median time to first token
ASK_RERANK = 8
ASK_RERANK_MARGIN = 0.5        # of 0.1 and 0.5 measured at 32K and 131K (bench_qa), 0.5 answered more
# keep the first ranking's best block in the window whatever the re-rank says (its best joins it). On
# by default since 2026-12-04: over five question generators at 32K (120 questions) and two at 131K
# (48), bench_qa: 65 of 168 answered with it, 65 with the plain re-rank, 54 without a re-rank; paired
# against no re-rank +11/-0 (the plain re-rank +12/-1): it never lost an answer on any generator, and
# it cannot drop the block the lexical and dense ranks agreed on (issue 43's records at 130K)
ASK_RERANK_KEEP = True
# the grafted tokens of one answer, whatever the store's size (window.plan)
ASK_CONTEXT_TOKENS = 2048
# recompute the first ASK_SEAM tokens of every grafted run that is not exact, at every layer
# (EPIC-style seams: the tokens where a run meets a window it was not computed in; 0: off)
ASK_SEAM = 0
# re-read the window's tokens after its exact prefix (prefill them over it, the question after them)
# instead of grafting them re-rotated: a window of one exact run (most, with the re-rank) costs nothing
# more, one with a second run (computed apart from the first) pays that run's prefill and holds what a
# re-read of its text computes. On by default since 2026-12-06 (issue 43): on a fresh bench_qa draw of five
# question generators at 131K (120 questions) it answered as text RAG over the same selection on every
# question (36 = 36; grafting the second run apart: 36, +2/-2 against RAG), at the same median TTFT
# (0.19 s, order-balanced; RAG 1.15 s); a window with a second run pays its prefill (median 1.07 s)
ASK_REREAD = True
# where the runs sit: "document" (document order) or "best_last" (the run holding the best
# selected block nearest the question, the others in document order before it)
ASK_ORDER = "document"
