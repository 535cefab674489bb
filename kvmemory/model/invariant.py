"""Invariant mode: the model's reducing ops replaced by versions whose every output row is reduced
in an order that does not depend on how many rows there are, how a prompt is chunked, what else
is in the batch, or how many threads run.

Where the default kernels differ (probed on the reference CPU, default model, fp32): the GEMM
behind nn.Linear rounds the rows of a product of 1-3 rows (and 5-7, 9-11 at two threads) unlike
those of a longer one, and the CPU flash-attention kernel tiles queries and keys by sizes chosen
from the sequence length. So a decode step's row, a chunk's rows and the same rows inside one
longer pass round differently in the last bits, and a restored state continues like the chunked
computation, not like one pass.

The replacements:

- linear: a product of few rows is padded with zero rows (a decode step of one sequence: to 4
  rows on the reference CPU); every other product runs unchanged where the BLAS already reduces
  each of its rows the same way, or in products of a fixed number of rows where it does not
  (SCHEMES; the machine's is chosen and checked at install: `choose`, `check`).
- attention: keys in KEY_BLOCK-key blocks at absolute key positions (0, 256, 512, ...), the last
  one padded; every product of a block is a fixed-shape problem ([rows, D] x [D, KEY_BLOCK],
  [rows, KEY_BLOCK] x [KEY_BLOCK, D], rows padded as for linear); a query's max over all its
  scores (exact in any order), and the blocks' sums and weighted values added one block after
  another in key order. A key beyond a query's position gets exactly zero weight, so a block
  entirely beyond it adds exact zeros after its real blocks: a query's result is the same whether
  the pass that computes it holds later keys (one pass) or not (chunked, restored, decoded).
- RMSNorm, RoPE and the elementwise ops already reduce per row in a fixed order (tested).

Installed in place (`install(model)`): each nn.Linear's class is swapped for InvariantLinear (the
same parameters, no copy), and the attention implementation set to "kvmemory_invariant", a
function registered with transformers' AttentionInterface. The model's fingerprint then names
the mode (kvmemory/model/fingerprint.py): a store's blocks are computed by one mode only, and a
store of the other mode does not open with it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvmemory.errors import ModelLoadError
from kvmemory.model.half import set_attention

NAME = "kvmemory_invariant"
MODE = "invariant-v1"            # recorded in the fingerprint and the store's header
DEFAULT = "default"              # the header's name for the default kernels (the key is then absent)
KEY_BLOCK = 256                  # keys per attention block
QUERY_SLAB = 64                  # queries scored at once: speed and memory, not bits (2x faster than 256 here)
# How a product's rows are reduced the same way whatever their number: (pad quantum, full rows,
# tile). A product of fewer than `full rows` rows is padded with zero rows to a multiple of the
# pad quantum (a decode step of one sequence); a longer one runs as it is (tile None) or in
# products of exactly `tile` rows, the last padded. The BLAS decides which holds on a machine, so
# `install` uses the first of SCHEMES that `check` finds keeping every row's bits there:
# - (2, 2, None): bfloat16 on the reference CPU (oneDNN's bf16 GEMM, AVX-512 BF16): a one-row
#   product whose rows are 1,536 long (the MLP's down projection) rounds ~10% of rows unlike the
#   same row of any longer product, and every product of 2 or more rows reduces a row the same
#   way (probed for M = 1..64 at several row offsets on every Linear shape; 2026-12-04). It fails
#   `check` in float32 (2-row products round apart there), so a float32 model takes the next.
# - (4, 12, None): the reference CPU (AMD EPYC, MKL sgemm, AVX-512) reduces a row of an [M, K] x
#   [K, N] product the same way for every M >= 12 and for M = 4 and 8, at one thread and two
#   (probed for M = 1..620 and 60 random M up to 9,000 on every Linear shape of the default model).
# - (16, 16, 32): an Intel Xeon with AVX-512 and AMX (2026-12-03) rounds rows of fewer than 16
#   unlike longer products at one thread, and at two threads splits a [M, 1536] x [1536, 576]
#   product of M >= 57 rows unlike one thread; products of 16 and of 32 rows agree with each other
#   and with one thread's long product. Its price here: the linears of a 256-token prefill 1.6x,
#   those of a one-sequence decode step 2.8x (against the default kernels).
# Every scheme `check` accepts gives a row the bits of the same row of a long product at one
# thread, so which one runs never changes a stored byte; a machine that keeps none raises
# InvariantUnavailableError, never a silent fallback.
PAIRS, REFERENCE, TILED = (2, 2, None), (4, 12, None), (16, 16, 32)
SCHEMES = (PAIRS, REFERENCE, TILED)
SCHEME_ATTR = "invariant_scheme"  # each module of an installed model holds its scheme (install sets it)


class InvariantUnavailableError(ModelLoadError):
    """This machine's kernels do not reduce rows independently of the row count (see `check`)."""


def padded_rows(m: int, scheme: tuple = REFERENCE) -> int:
    q, full, _ = scheme
    return m if m >= full else -(-m // q) * q


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           scheme: tuple = REFERENCE) -> torch.Tensor:
    """F.linear with every row reduced the same way whatever the number of rows (under a scheme
    `check` accepts on this machine): the rows, padded with zero rows, in products of `step` rows."""
    _, full, tile = scheme
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    m = x2.shape[0]
    step = tile if m >= full and tile is not None else padded_rows(m, scheme)
    n = -(-m // step) * step
    if n > m:
        x2 = torch.cat([x2, x2.new_zeros(n - m, x2.shape[1])])
    outs = [F.linear(x2[i:i + step], weight, bias) for i in range(0, n, step)]
    out = outs[0] if len(outs) == 1 else torch.cat(outs)
    return out[:m].reshape(*shape[:-1], weight.shape[0])


class InvariantLinear(nn.Linear):
    """nn.Linear through `linear` (installed by swapping a module's class: same parameters)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, getattr(self, SCHEME_ATTR, REFERENCE))


def attention(module, query, key, value, attention_mask=None, scaling=None, dropout=0.0, scheme=None, **kwargs):
    """Causal attention with a fixed reduction order: query [B, Hq, Lq, D], key/value
    [B, Hkv, Lk, D], the queries being the last Lq of the Lk positions (a prefill chunk or a decode
    step after the cache). Returns (output [B, Lq, Hq, D], None), as transformers' attention
    functions do.

    The queries of the heads that share a KV head are the rows of one problem (no copy of the
    cache per head). Per slab of queries: scores against every KEY_BLOCK-key block (fixed-shape
    problems; the cache's last, partial block padded on its own), a row's max over all of them (a
    max is exact in any order), its weights, then each block's sum and weighted values added block
    after block in key order. A block past a query's position adds exact zeros after its real
    blocks, so the result does not depend on how many keys the pass holds beyond it. scheme: how
    query rows are padded (default: the module's, set by install)."""
    if attention_mask is not None:
        raise ValueError("invariant attention computes its causal mask itself; a padded batch is not supported")
    if dropout:
        raise ValueError("invariant attention is for inference: dropout must be 0")
    scheme = scheme or getattr(module, SCHEME_ATTR, REFERENCE)
    b, hq, lq, d = query.shape
    hkv, lk = key.shape[1], key.shape[2]
    g, n = hq // hkv, b * hkv
    scale = d ** -0.5 if scaling is None else scaling
    dev = query.device
    full, tail = divmod(lk, KEY_BLOCK)
    q_all = query.reshape(n, g, lq, d)
    key, value = key.reshape(n, lk, d), value.reshape(n, lk, d)
    outs = []
    for q0 in range(0, lq, QUERY_SLAB):
        r = min(QUERY_SLAB, lq - q0)
        rows = padded_rows(g * r, scheme)
        q = q_all[:, :, q0:q0 + r].reshape(n, g * r, d)
        first = lk - lq + q0                                            # position of the slab's first query
        qpos = torch.arange(first, first + r, device=dev).repeat(g)
        if rows > g * r:
            q = F.pad(q, (0, 0, 0, rows - g * r))
            qpos = F.pad(qpos, (0, rows - g * r), value=lk - 1)
        qpos = qpos.view(1, rows, 1)
        need = (first + r - 1) // KEY_BLOCK + 1                         # blocks past every query: zeros, skipped
        groups = []                                                     # (keys, values, key positions), in key order
        nf = min(full, need)
        if nf:
            groups.append((key[:, :nf * KEY_BLOCK].reshape(n, nf, KEY_BLOCK, d),
                           value[:, :nf * KEY_BLOCK].reshape(n, nf, KEY_BLOCK, d),
                           torch.arange(nf * KEY_BLOCK, device=dev).view(nf, 1, KEY_BLOCK)))
        if tail and need > full:
            pad = (0, 0, 0, KEY_BLOCK - tail)
            groups.append((F.pad(key[:, full * KEY_BLOCK:], pad).unsqueeze(1),
                           F.pad(value[:, full * KEY_BLOCK:], pad).unsqueeze(1),
                           torch.arange(full * KEY_BLOCK, (full + 1) * KEY_BLOCK, device=dev).view(1, 1, KEY_BLOCK)))
        scores = []
        for kb, _, kpos in groups:
            sc = torch.matmul(q.unsqueeze(1), kb.transpose(-1, -2)) * scale           # [n, blocks, rows, KB]
            scores.append(sc.masked_fill((kpos > qpos) | (kpos >= lk), float("-inf")))
        top = scores[0].amax(dim=-1, keepdim=True).amax(dim=1, keepdim=True)          # [n, 1, rows, 1]
        for sc in scores[1:]:
            top = torch.maximum(top, sc.amax(dim=-1, keepdim=True).amax(dim=1, keepdim=True))
        total = acc = None
        for sc, (_, vb, _) in zip(scores, groups):
            p = torch.exp(sc - top)
            sums = p.sum(dim=-1, keepdim=True)                                         # [n, blocks, rows, 1]
            parts = torch.matmul(p, vb)                                                # [n, blocks, rows, D]
            for j in range(sums.shape[1]):                                             # in key order, one at a time
                total = sums[:, j] if total is None else total + sums[:, j]
                acc = parts[:, j] if acc is None else acc + parts[:, j]
        outs.append((acc / total)[:, :g * r].reshape(b, hkv, g, r, d).reshape(b, hq, r, d))
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
    return out.transpose(1, 2).contiguous(), None


def check(model, threads: tuple[int, ...] | None = None, scheme: tuple = REFERENCE) -> None:
    """On this machine, are the model's products row-invariant under `scheme`? For every Linear
    shape of the model, rows of M-row products (M = 1..13, 16, 17, 31, 33, 64, 255) must equal the
    same rows of one 300-row product, and that product the plain 300-row product at one thread;
    attention over slices of 300 queries the same rows of one pass, and that pass the same at every
    thread count. Checked at the current thread count and at one thread, in the model's dtype (a
    bfloat16 model's products run other kernels than float32's). Raises
    InvariantUnavailableError naming the first that is not."""
    shapes = sorted({tuple(mod.weight.shape) for mod in model.modules() if isinstance(mod, nn.Linear)})
    head_dim = getattr(model.config, "head_dim", None) or model.config.hidden_size // model.config.num_attention_heads
    n = torch.get_num_threads()
    g = torch.Generator().manual_seed(0)
    dt = next(model.parameters()).dtype
    ms = list(range(1, 14)) + [16, 17, 31, 33, 64, 255]
    try:
        torch.set_num_threads(1)
        probes = []
        for out_f, in_f in shapes:
            w, x = torch.randn(out_f, in_f, generator=g).to(dt), torch.randn(300, in_f, generator=g).to(dt)
            probes.append((w, x, F.linear(x, w)))
        q, k, v = (torch.randn(1, 2, 300, head_dim, generator=g).to(dt) for _ in range(3))
        one_pass = None
        for t in threads or tuple(sorted({n, 1})):
            torch.set_num_threads(t)
            for w, x, plain in probes:
                out_f, in_f = w.shape
                full = linear(x, w, scheme=scheme)
                if not torch.equal(full, plain):
                    raise InvariantUnavailableError(
                        f"this machine's GEMM rounds a [300, {in_f}] x [{in_f}, {out_f}] product at {t} thread(s) "
                        f"unlike the plain product at one thread: invariant mode cannot be used here")
                for mm in (ms if out_f * in_f < 8 << 20 else ms[:13]):   # the LM head: small products only
                    # a few rows' products at several offsets: a kernel for few rows may round only
                    # some rows apart (bf16 one-row products: ~10% of rows)
                    for s in ((0, 97, 211, 300 - mm) if mm <= 16 else (0,)):
                        if not torch.equal(linear(x[s:s + mm], w, scheme=scheme), full[s:s + mm]):
                            raise InvariantUnavailableError(
                                f"this machine's GEMM rounds a [{mm}, {in_f}] x [{in_f}, {out_f}] product's rows "
                                f"unlike the same rows of a longer one at {t} thread(s): invariant mode cannot be "
                                "used here")
            full, _ = attention(None, q, k, v, scheme=scheme)
            if one_pass is not None and not torch.equal(full, one_pass):
                raise InvariantUnavailableError(
                    f"this machine's batched GEMM rounds attention at {t} thread(s) unlike at the first count "
                    f"checked: invariant mode cannot be used here")
            one_pass = full
            for a, e in ((0, 1), (0, 13), (5, 6), (40, 299), (255, 257), (299, 300)):
                part, _ = attention(None, q[:, :, a:e], k[:, :, :e], v[:, :, :e], scheme=scheme)
                if not torch.equal(part, full[:, a:e]):
                    raise InvariantUnavailableError(
                        f"this machine's batched GEMM rounds attention for queries {a}..{e - 1} unlike one pass at "
                        f"{t} thread(s): invariant mode cannot be used here")
    finally:
        torch.set_num_threads(n)


def choose(model, threads: tuple[int, ...] | None = None) -> tuple:
    """The first of SCHEMES that `check` accepts for `model` on this machine; raises the last
    scheme's InvariantUnavailableError where none is."""
    err = None
    for scheme in SCHEMES:
        try:
            check(model, threads, scheme)
        except InvariantUnavailableError as e:
            err = e
            continue
        return scheme
    raise err


def register() -> None:
    from transformers import AttentionInterface
    AttentionInterface.register(NAME, attention)


def install(model) -> None:
    """Put the model in invariant mode, in place (idempotent), after checking that this machine's
    kernels allow it (`choose`: the first scheme `check` accepts), and that every product of the
    model is an nn.Linear it can replace: a mixture of experts multiplies each expert's weights
    over the tokens routed to it (how many depends on the batch), so it is refused."""
    if getattr(model.config, "attn_logit_softcapping", None):
        raise InvariantUnavailableError(f"{type(model).__name__} soft-caps its attention scores; invariant mode's "
                                        "attention does not")
    for name, p in model.named_parameters():
        if p.dim() >= 3:
            raise InvariantUnavailableError(
                f"{type(model).__name__} multiplies {name} {tuple(p.shape)} outside nn.Linear (a mixture of "
                "experts: each expert's product runs over the tokens routed to it, whose count depends on the "
                "batch); invariant mode covers nn.Linear products only")
    scheme = choose(model)
    register()
    for mod in model.modules():
        setattr(mod, SCHEME_ATTR, scheme)
    for mod in model.modules():
        if type(mod) is nn.Linear:
            mod.__class__ = InvariantLinear
    set_attention(model, NAME)


def installed(model) -> bool:
    return getattr(model.config, "_attn_implementation", None) == NAME


def kernels(model) -> str:
    """The name of the kernels `model` computes with, as a store's header records it."""
    return MODE if installed(model) else DEFAULT
