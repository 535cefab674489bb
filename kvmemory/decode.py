"""The one decode loop (Memory.generate, ask, the server's chat, the benchmarks)."""

from __future__ import annotations

import torch

from kvmemory.device import ids_tensor


@torch.inference_mode()
def greedy(model, cache, logits: torch.Tensor, max_new_tokens: int, eos: set[int], on_token=None,
           pick=None) -> list[int]:
    """Tokens after `logits` (of the last token already in `cache`), extending cache in place.

    pick(logits) -> token id chooses each token (default: argmax, greedy). Stops at an eos id
    (not included), after max_new_tokens, or when on_token(new_ids), called after each token (for
    streaming), returns True; no forward pass for a token it would not use."""
    pick = pick or (lambda x: int(x.argmax()))
    new: list[int] = []
    nxt = pick(logits)
    while nxt not in eos and len(new) < max_new_tokens:
        new.append(nxt)
        if on_token is not None and on_token(new):
            break
        if len(new) == max_new_tokens:
            break
        out = model(input_ids=ids_tensor([nxt], model), past_key_values=cache, use_cache=True)
        nxt = pick(out.logits[0, -1])
    return new


def eos_ids(tokenizer, model) -> set[int]:
    """Token ids that end an answer: the tokenizer's and the generation config's eos."""
    ids = set()
    for v in (tokenizer.eos_token_id, getattr(getattr(model, "generation_config", None), "eos_token_id", None)):
        if isinstance(v, int):
            ids.add(v)
        elif isinstance(v, (list, tuple)):
            ids.update(int(x) for x in v)
    return ids
