"""Window planning. Pure: no torch.

The window the model attends to when answering:

    [prelude][slot 0][slot 1]...[slot k-1][question][answer]
     0..p-1   p..     ...

Selected blocks go into slots in document order (by document, then position in it), packed
back to back. A block computed at deposit position d and placed at slot position s has its
keys re-rotated by s - d; when s == d (common: a segment's first block lands in slot 0) it
is grafted byte for byte. The window's size is bounded by the model's positional window, so
decode cost per token is flat however large the store is.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Candidate:
    row: int             # block row in the store
    doc_id: str
    doc_rank: int        # the document's order of deposit (document order across docs)
    doc_start: int       # the block's first token within its document
    n_tokens: int
    deposit_pos: int     # absolute position the block was computed at
    score: float


@dataclass(frozen=True)
class Slot:
    candidate: Candidate
    slot_pos: int        # absolute position in the window
    offset: int          # token offset in the window's KV buffer (== slot_pos)

    @property
    def shift(self) -> int:
        return self.slot_pos - self.candidate.deposit_pos


@dataclass(frozen=True)
class WindowPlan:
    prelude_tokens: int
    slots: tuple[Slot, ...]
    question_tokens: int
    max_new_tokens: int

    @property
    def context_tokens(self) -> int:
        """Tokens in the KV buffer before the question: prelude + slots."""
        return self.prelude_tokens + sum(s.candidate.n_tokens for s in self.slots)

    @property
    def total_tokens(self) -> int:
        return self.context_tokens + self.question_tokens + self.max_new_tokens

    @property
    def exact_slots(self) -> int:
        return sum(1 for s in self.slots if s.shift == 0)


def plan(candidates: list[Candidate], prelude_tokens: int, question_tokens: int, max_new_tokens: int,
         window_tokens: int, top_k: int) -> WindowPlan:
    """Take the best-scoring candidates that fit, then lay them out in document order."""
    budget = window_tokens - prelude_tokens - question_tokens - max_new_tokens
    if budget < 0:
        raise ValueError(f"the question ({question_tokens} tokens) and answer ({max_new_tokens}) do not fit the "
                         f"window of {window_tokens} tokens")
    chosen, used, seen = [], 0, set()
    for c in sorted(candidates, key=lambda c: -c.score):
        if len(chosen) == top_k:
            break
        if c.row in seen or used + c.n_tokens > budget:
            continue
        chosen.append(c)
        seen.add(c.row)
        used += c.n_tokens
    slots, pos = [], prelude_tokens
    for c in sorted(chosen, key=lambda c: (c.doc_rank, c.doc_start)):
        slots.append(Slot(c, pos, pos))
        pos += c.n_tokens
    return WindowPlan(prelude_tokens, tuple(slots), question_tokens, max_new_tokens)
