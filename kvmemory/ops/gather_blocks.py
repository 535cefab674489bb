"""gather_blocks: copy selected blocks into the window's KV buffer, re-rotating keys (RoPE).

    pool    [P, L, 2, H, C, D]   blocks (host RAM, pinned host, or a GPU block pool)
    idx     [k] int64            which pool entries to gather, in slot order
    n       [k] int64            valid tokens of each (<= C)
    dst     [k] int64            token offset of each slot in the window buffer
    shift   [k] int64            slot position - deposit position (0: exact byte copy)
    out     [L, 2, H, T, D]      the window buffer (written in place)
    freqs   [R / 2] float32      RoPE inverse frequencies (rotate-half layout over the first R <= D dims),
            or [L, R / 2]        one set per layer (layers of different types: Gemma 3)

Values (index 1) are copied as is; keys (index 0) are rotated by shift * freqs. A zero shift
is a byte-exact copy. The math is done in float64 and rounded once to the buffer's dtype.
"""

from __future__ import annotations

import torch

from kvmemory.rope import rotate, shift_cos_sin


def _check(pool, idx, n, dst, shift, out, freqs) -> None:
    if isinstance(pool, (list, tuple)):               # the blocks one by one: each [L, 2, H, C, D]
        if any(b.dim() != 5 or b.shape != pool[0].shape for b in pool):
            raise ValueError("pool: a list of blocks of one shape [L, 2, H, C, D]")
        if pool:
            _check(pool[0].unsqueeze(0), idx, n, dst, shift, out, freqs)
        elif len(idx):
            raise ValueError("an empty pool has no block to gather")
        return
    if pool.dim() != 6 or out.dim() != 5 or pool.shape[1:4] != out.shape[0:3] or pool.shape[5] != out.shape[4]:
        raise ValueError(f"pool {tuple(pool.shape)} [P, L, 2, H, C, D] and out {tuple(out.shape)} [L, 2, H, T, D] "
                         "do not match")
    if not (len(idx) == len(n) == len(dst) == len(shift)):
        raise ValueError("idx, n, dst and shift must have one entry per gathered block")
    if freqs.shape[-1] * 2 > out.shape[4] or freqs.shape[-1] == 0 or pool.dtype != out.dtype or (
            freqs.dim() == 2 and freqs.shape[0] != out.shape[0]) or freqs.dim() > 2:
        raise ValueError("freqs must be [R/2] or per layer [L, R/2] (R <= head_dim) and pool/out the same dtype")
    if len(n) and (int(n.max()) > pool.shape[4] or int((dst + n).max()) > out.shape[3] or int(dst.min()) < 0):
        raise ValueError("a block does not fit its slot in the window buffer")


def gather_blocks_ref(pool, idx, n, dst, shift, out, freqs) -> torch.Tensor:
    """Pure-torch reference (and CPU path) of gather_blocks; see the module docstring. pool may
    also be a list of blocks [L, 2, H, C, D] (the pager's, unstacked: no copy of them all first)."""
    _check(pool, idx, n, dst, shift, out, freqs)
    cos, sin = shift_cos_sin(shift.cpu(), freqs.cpu())               # [k, R/2], or per layer [k, L, R/2]
    if freqs.dim() == 2:                                              # [k, L, 1, 1, R/2]: each layer its own
        cos, sin = cos[:, :, None, None, :], sin[:, :, None, None, :]
    for i in range(len(idx)):
        b, k, d, s = int(idx[i]), int(n[i]), int(dst[i]), int(shift[i])
        block = pool[b][:, :, :, :k]                                  # [L, 2, H, k, D]
        out[:, 1, :, d:d + k] = block[:, 1]
        if s == 0:
            out[:, 0, :, d:d + k] = block[:, 0]                       # exact: no arithmetic
        else:
            out[:, 0, :, d:d + k] = rotate(block[:, 0], cos[i].to(out.device), sin[i].to(out.device))
    return out


def gather_blocks(pool, idx, n, dst, shift, out, freqs) -> torch.Tensor:
    """Dispatch: the CUDA kernel for CUDA tensors when it is built, otherwise the reference."""
    # the kernel rotates whole heads with one set of frequencies; a partial rotary's keys, or per-layer
    # frequencies, go through the reference (the same float64 rotation)
    if out.is_cuda and not isinstance(pool, (list, tuple)) and freqs.dim() == 1 and freqs.shape[-1] * 2 == out.shape[4]:
        from kvmemory.ops import cuda_ext

        kernel = cuda_ext.load()
        if kernel is not None:
            _check(pool, idx, n, dst, shift, out, freqs)
            kernel.gather_blocks(pool, idx.to(out.device), n.to(out.device), dst.to(out.device),
                                 shift.to(out.device), out, freqs.to(out.device))
            return out
    return gather_blocks_ref(pool, idx, n, dst, shift, out, freqs)
