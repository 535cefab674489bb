"""The one greedy decode loop (Memory.generate, ask, the benchmarks)."""

from __future__ import annotations

import torch

from kvmemory.device import ids_tensor


@torch.inference_mode()
def greedy(model, cache, logits: torch.Tensor, max_new_tokens: int, eos: set[int], on_token=None) -> list[int]:
    """Greedy tokens after `logits` (of the last token already in `cache`), extending cache in place.

    Stops at an eos id (not included) or after max_new_tokens, with no forward pass for a token
    it would not use. on_token(new_ids) is called after each token (for streaming)."""
    new: list[int] = []
    nxt = int(logits.argmax())
    while nxt not in eos and len(new) < max_new_tokens:
        new.append(nxt)
        if on_token is not None:
            on_token(new)
        if len(new) == max_new_tokens:
            break
        out = model(input_ids=ids_tensor([nxt], model), past_key_values=cache, use_cache=True)
        nxt = int(out.logits[0, -1].argmax())
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
