"""What every `kvmemory` command shares: the epilog, the --model argument, opening a store's Memory."""

from __future__ import annotations

import argparse
import sys

from kvmemory.config import DTYPES
from kvmemory.errors import KVMemoryError

EPILOG = ("STORE is a directory or s3://bucket/prefix on any S3-compatible service (AWS_ENDPOINT_URL, "
          "AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_REGION, AWS_ALLOW_HTTP=true for plain HTTP). "
          "Environment: KVMEMORY_CACHE_DIR (converted model weights), KVMEMORY_LOCK_TIMEOUT (seconds a writer "
          "waits), KVMEMORY_HOST_CACHE_BYTES (the pager's host-RAM budget), KVMEMORY_STORE_CACHE_DIR and "
          "KVMEMORY_STORE_CACHE_BYTES (local disk tier of an s3:// store), KVMEMORY_INVARIANT=1 (invariant "
          "kernels, as --invariant), KVMEMORY_DTYPE (as --dtype); for a store being created: "
          "KVMEMORY_BLOCK_TOKENS (tokens per block, default 256; 64 for a store of chat memory), "
          "KVMEMORY_PREFILL_TOKENS (tokens per forward of the canonical prefill, a divisor of the block's; "
          "64 for a chat server's store: a conversation's next turn computes at most 63 tokens of its last "
          "block again, not 255; deposits ~25% slower), KVMEMORY_CODEC (none, zstd or lz4), KVMEMORY_SHARD_BLOCKS.")

CREATES = "store directory or s3://bucket/prefix (created if missing)"

__all__ = ["CREATES", "EPILOG", "KVMemoryError", "model_arg", "open_memory", "positive_int", "progress", "store_dtype",
           "store_header"]


def model_arg(sp) -> None:
    sp.add_argument("--model", metavar="MODEL", default=None,
                    help="a local transformers model directory, a .gguf file (dequantized to float32 once, then "
                         "cached) or a Hugging Face Hub id already in the local cache (nothing is downloaded); "
                         "default: the embedded SmolLM2-135M-Instruct")
    sp.add_argument("--device", default=None, metavar="DEVICE",
                    help="cpu (default), cuda, cuda:N or auto (cuda where there is one); a device this machine "
                         "lacks is an error (env KVMEMORY_DEVICE)")
    sp.add_argument("--invariant", action="store_true", default=None,
                    help="compute with the invariant kernels: the same KV bytes whatever the chunking, the batch "
                         "or the thread count (slower: docs/concepts/exactness.md); a store records its mode and "
                         "opens only in it (env KVMEMORY_INVARIANT=1)")
    sp.add_argument("--dtype", choices=DTYPES, default=None,
                    help="what a model loaded from disk computes in, for a store being created (default float32; env "
                         "KVMEMORY_DTYPE): bfloat16 prefills ~2.5x and decodes ~1.8x faster where the CPU has "
                         "AVX-512 BF16 or AMX, its KV half the bytes. A store records its dtype: an existing one is "
                         "opened in it (another --dtype is an error)")
    sp.add_argument("--encrypt", action="store_true", default=None,
                    help="a store being created is encrypted at rest (AES-256-GCM: blocks' KV and token ids, "
                         "selection indexes; a data key per chat user): keys from KVMEMORY_KEYRING (a directory "
                         "apart from the store) and KVMEMORY_MASTER_KEY or KVMEMORY_MASTER_KEY_FILE (env "
                         "KVMEMORY_ENCRYPT=1); an encrypted store needs them to open")


def positive_int(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {n}")
    return n


def progress(total: int, desc: str, unit: str = "block"):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit=unit, disable=not sys.stderr.isatty())


def store_header(store):
    """The header of an existing store at `store` (its Manifest), or None where there is none yet."""
    from kvmemory.store.location import locate
    from kvmemory.store.log import read_manifest
    loc = locate(store, must_exist=False)
    return read_manifest(loc.files) if loc.exists else None


def store_dtype(args) -> str | None:
    """The dtype to open args.store in: --dtype, else KVMEMORY_DTYPE, else the dtype an existing
    store's blocks were computed in (its header), else None (Memory's default)."""
    import os

    if getattr(args, "dtype", None) or os.environ.get("KVMEMORY_DTYPE"):
        return getattr(args, "dtype", None)
    header = store_header(args.store)
    return header.kv_dtype if header is not None else None


def open_memory(args, read_only=False, create=False, **kw):
    """The Memory of args.store. Only commands that write a first state or entry (save, learn, add) may
    create a store: a mistyped path given to ask, rm, reindex ... is an error, not a new empty store."""
    from kvmemory.memory import Memory
    from kvmemory.store.location import locate

    if not create and not locate(args.store, must_exist=False).exists:
        raise KVMemoryError(f"no kvmemory store at {args.store}; check the path, or create one with kvmemory save "
                            "or kvmemory add")
    import os
    model = getattr(args, "model", None) or os.environ.get("KVMEMORY_MODEL") or None
    return Memory(args.store, model=model, read_only=read_only,
                  invariant=getattr(args, "invariant", None), dtype=store_dtype(args),
                  device=getattr(args, "device", None), encrypt=getattr(args, "encrypt", None) or None, **kw)
