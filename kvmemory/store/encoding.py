"""How a store holds its KV words: exactly (the model's own words, the default), or in a compact,
lossy encoding for cold stores (`kvmemory compact`, kvmemory/compact.py).

    exact   the model's KV words as computed (fp32, bf16 words as uint16): E1-E3 hold
    bf16    an fp32 model's KV rounded to bfloat16 (round to nearest even): half the bytes,
            8 significant bits (relative error <= 2**-8 a word), fp32's range
    fp16    rounded to IEEE half: half the bytes, 11 significant bits (<= 2**-11 a word, above 6e-5),
            range +-65504 (a block with a larger word is refused, never clipped)

The encoding is the store's, named in its header: every block of a store has it, a read decodes
it after the block's digest (over the stored, encoded words) is checked, and a store that is not
exact says so in every graft (the per-block error measured when it was encoded, kvmemory/compact.py).
Encoding is deterministic, and decoding widens exactly (every encoded word has one decoded value),
so recomputing a block and encoding it again gives the stored words (E2 for an encoded store).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvmemory.errors import InputError, StoreError
from kvmemory.store.manifest import ENCODINGS

# numpy dtype that holds each KV dtype's raw words losslessly (Zarr has no bfloat16)
STORAGE_DTYPE = {"float32": "float32", "float16": "float16", "bfloat16": "uint16"}
FP16_MAX = 65504.0
ERROR_FIELDS = ("key_rel_error", "value_rel_error", "kl")   # the per-block error array's columns


class EncodingRangeError(StoreError):
    """A KV word the encoding cannot hold (fp16 past +-65504, or not finite): nothing is written."""


@dataclass(frozen=True)
class Encoding:
    name: str
    kv_dtype: str                      # the model's KV dtype (what decode returns, as storage words)

    @property
    def lossy(self) -> bool:
        return self.name != "exact"

    @property
    def itemsize(self) -> int:
        """Bytes one stored KV word takes."""
        return np.dtype(self.storage_dtype).itemsize

    @property
    def storage_dtype(self) -> str:
        return {"exact": STORAGE_DTYPE[self.kv_dtype], "bf16": "uint16", "fp16": "float16"}[self.name]

    def encode(self, words: np.ndarray) -> np.ndarray:
        """The model's KV words (storage words of kv_dtype) -> the stored words (round to nearest even)."""
        if not self.lossy:
            return words
        x = np.asarray(words, dtype=np.float32)
        if not np.isfinite(x).all():
            raise EncodingRangeError(f"a KV word is not finite: the {self.name} encoding keeps only finite blocks")
        if self.name == "fp16":
            big = float(np.abs(x).max()) if x.size else 0.0
            if big > FP16_MAX:
                raise EncodingRangeError(f"a KV word of magnitude {big:.6g} exceeds fp16's range (65504): "
                                         "use the bf16 encoding")
            return _convert(x, np.float16, None)
        return _convert(x, np.int16, "bfloat16").view(np.uint16)

    def decode(self, stored: np.ndarray) -> np.ndarray:
        """Stored words -> the model's KV words (exactly the values the encoding kept)."""
        if not self.lossy:
            return stored
        return _convert(stored.view(np.int16) if self.name == "bf16" else stored, np.float32,
                        "bfloat16" if self.name == "bf16" else None, src_view=True)

    def roundtrip(self, words: np.ndarray) -> np.ndarray:
        return self.decode(self.encode(words))


def _convert(a: np.ndarray, out_dtype, view: str | None, src_view: bool = False) -> np.ndarray:
    """a converted into a new array of out_dtype by torch's vectorised, threaded casts (5-7x numpy's
    for fp16); `view`: the torch dtype that one side's 16-bit words are (bfloat16 as int16)."""
    import torch
    a = np.ascontiguousarray(a)
    out = np.empty(a.shape, dtype=out_dtype)
    src, dst = torch.from_numpy(a), torch.from_numpy(out)
    if view is not None:
        if src_view:
            src = src.view(getattr(torch, view))
        else:
            dst = dst.view(getattr(torch, view))
    dst.copy_(src)
    return out


def get(name: str, kv_dtype: str) -> Encoding:
    """The encoding `name` of a store whose model computes `kv_dtype` KV; InputError if there is none."""
    if name not in ENCODINGS:
        raise InputError(f"encoding must be one of {ENCODINGS}, got {name!r}")
    if name != "exact" and kv_dtype != "float32":
        raise InputError(f"the {name} encoding narrows an fp32 model's KV; this store's KV is {kv_dtype}")
    return Encoding(name, kv_dtype)


def relative_errors(exact: np.ndarray, decoded: np.ndarray) -> tuple[float, float]:
    """(keys, values) relative L2 error of one block [L, 2, H, n, D] decoded against its exact words."""
    out = []
    for kv in (0, 1):
        a = exact[:, kv].astype(np.float64)
        d = decoded[:, kv].astype(np.float64) - a
        norm = float(np.sqrt((a * a).sum()))
        out.append(float(np.sqrt((d * d).sum())) / norm if norm else 0.0)
    return out[0], out[1]
