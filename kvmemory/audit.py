"""`kvmemory audit`: E3 on a store's own states, for a user who wants to prove their store.

For each of N states drawn at random (a seed, printed, reproduces the draw): the state is
restored from the store (every block digest-checked, ids re-derived) and, independently of the
store, its tokens are prefilled afresh the canonical way (block by block, on block boundaries,
kvmemory.kv.prefill_blocks). The two caches must be the same bytes (torch.equal), and the
next-token logits of a fresh random suffix after each must be bit-identical (KL exactly 0). In
invariant mode (the store's header says so) a third computation is held to the same bytes: one
plain forward pass over the state's tokens and the suffix. With the default kernels that pass
differs in the last bits (a different computation, not part of the contract): its largest
logit difference is reported, not asserted.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from kvmemory import kv as kvops
from kvmemory.errors import CompactStoreError, InputError, KVMemoryError
from kvmemory.exactness import kl_divergence, max_abs_diff
from kvmemory.runtime import Runtime


@dataclass(frozen=True)
class AuditRow:
    state: str
    tokens: int
    exact: bool                      # restored KV == fresh KV and restored logits == fresh logits
    kl: float                        # KL(fresh || restored) of the suffix's logits (0.0 when exact)
    vs_one_pass: float               # max |logit difference| against one plain forward pass
    one_pass_exact: bool             # ... and whether it is 0 (required in invariant mode)
    error: str = ""                  # a read that failed verification (the state then counts as bad)

    @property
    def ok(self) -> bool:
        return not self.error and self.exact


def audit(rt: Runtime, samples: int, seed: int | None = None, progress=None) -> tuple[int, list[AuditRow]]:
    """Audit `samples` random states of the runtime's store (all of them if it holds fewer). Returns
    (seed, rows). A state whose read fails verification is a row with its error, not an exception."""
    from kvmemory.model import invariant
    if isinstance(samples, bool) or not isinstance(samples, int) or samples < 1:
        raise InputError(f"samples must be an integer >= 1, got {samples!r}")
    store = rt.store()
    if store.encoding.lossy:
        raise CompactStoreError(f"store {rt.location} holds {store.manifest.encoding}-encoded KV: E3 holds for exact "
                                "stores only; its blocks' measured error is in `kvmemory info` (encoding_error)")
    seed = random.SystemRandom().randrange(2**31) if seed is None else int(seed)
    rng = random.Random(seed)
    states = sorted(s.id for s in rt.states.states())
    if not states:
        raise KVMemoryError(f"store {rt.location} holds no states to audit")
    picked = rng.sample(states, min(samples, len(states)))
    strict = invariant.installed(rt.model)
    vocab = rt.model.get_input_embeddings().num_embeddings
    rows = []
    for sid in picked:
        suffix = [rng.randrange(vocab) for _ in range(rng.randrange(1, 17))]
        rows.append(_audit_one(rt, sid, suffix, strict))
        if progress is not None:
            progress.update(1)
    return seed, rows


def _audit_one(rt: Runtime, sid: str, suffix: list[int], strict: bool) -> AuditRow:
    """One state: restored vs recomputed (and vs one plain pass, required when strict)."""
    model = rt.model
    try:
        st = rt.load(sid)
    except KVMemoryError as e:
        return AuditRow(sid, 0, False, float("nan"), float("nan"), False, str(e))
    ids = st.token_ids
    with torch.inference_mode():
        fresh = kvops.make_cache(None, model.config)
        for _ in kvops.prefill_blocks(model, ids, rt.block_tokens, fresh, chunk_tokens=rt.prefill_tokens):
            pass
        fresh_kv = kvops.cache_slice(fresh, 0, len(ids))
        same_kv = fresh_kv.shape == st.kv.shape and torch.equal(fresh_kv, st.kv.to(fresh_kv.dtype))
        s = torch.tensor([suffix], device=model.device)
        got = model(input_ids=s, past_key_values=st.cache(), use_cache=True).logits[0]
        want = model(input_ids=s, past_key_values=fresh, use_cache=True).logits[0]
        one = model(input_ids=torch.tensor([ids + suffix], device=model.device)).logits[0, len(ids):]
    diff = max_abs_diff(got, one)
    # invariant mode promises the one-pass bytes too
    error = "differs from one plain forward pass (invariant mode promises it does not)" \
        if strict and diff != 0.0 else ""
    return AuditRow(sid, len(ids), bool(same_kv and torch.equal(got, want)), kl_divergence(want, got), diff,
                    diff == 0.0, error)
