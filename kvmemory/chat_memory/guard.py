"""A reply that would open as the memory's own framing ("The user said: ...", "On 2026-12-04, ...",
"You replied: ...") instead of answering: a small model shown remembered turns may copy their form
(benchmarks/bench_chat_recall.py counts these). Guard wraps a pick (greedy, a sampler, a grammar) and,
while the reply so far is one token short of such an opening, takes that completing token out of the
choice: the model's next best is picked. Nothing else of the reply changes."""

from __future__ import annotations

import torch

# how a remembered turn reads (kvmemory/chat_memory/turns.py), as a reply would begin copying it
# ("The user" alone would also take "The user's locker code is ..." away: measured, it cost answers)
OPENINGS = ("The user said", "the user said", "The user asked", "User:", "On 20", "You replied", "You said")


class Guard:
    """pick(logits) -> token id, the wrapped pick's, never completing an OPENINGS at the reply's start.
    One per reply (it remembers the tokens picked). banned: how many picks it changed the choices of."""

    def __init__(self, tokenizer, pick=None, openings=OPENINGS) -> None:
        self.pick = pick if pick is not None else (lambda x: int(x.argmax()))
        self.seqs = [ids for o in openings if (ids := list(tokenizer(o, add_special_tokens=False)["input_ids"]))]
        self.longest = max((len(s) for s in self.seqs), default=0)
        self.out: list[int] = []
        self.banned = 0

    def __call__(self, logits: torch.Tensor) -> int:
        n = len(self.out)
        if n < self.longest:
            ban = sorted({s[n] for s in self.seqs if len(s) == n + 1 and s[:n] == self.out})
            if ban:
                logits = logits.clone()
                logits[..., ban] = float("-inf")
                self.banned += 1
        t = self.pick(logits)
        self.out.append(t)
        return t
