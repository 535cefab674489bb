"""Window planning. Pure: no torch.

The window the model attends to when answering:

    [prelude][slot 0][slot 1]...[slot k-1][question][answer]
     0..p-1   p..     ...

Selected blocks go into slots in document order (by document, then position in it), packed
back to back. With segment-prefix expansion (`context`), a selected block comes with the
blocks before it in its deposit segment, down to the segment's start, so it sits after
exactly the context it was computed with; a run that starts its segment and lands in the
first slot is then grafted byte for byte, whole. Expansion is budget-aware: when a run does
not fit whole, it is cut from the front (the selected block itself always comes first).
A block computed at deposit position d and placed at slot position s has its
keys re-rotated by s - d; when s == d (common: a segment's first block lands in slot 0) it
is grafted byte for byte. The window's size is bounded by the model's positional window, so
decode cost per token is flat however large the store is.
"""

from __future__ import annotations

from dataclasses import dataclass


ORDERS = ("document", "best_last")


@dataclass(frozen=True)
class Candidate:
    row: int             # block row in the store
    doc_id: str
    doc_rank: int        # the document's order of deposit (document order across docs)
    doc_start: int       # the block's first token within its document
    n_tokens: int
    deposit_pos: int     # absolute position the block was computed at
    score: float
    selected: bool = True   # False: brought in as context of a selected block (segment prefix)


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

    def exact_prefix_tokens(self) -> int:
        """Tokens from the window's start whose KV is exactly what a re-prefill of the window in
        block-chunked order computes: the prelude and the leading slots grafted at their deposit
        positions behind the blocks they were computed after (a segment's run from its start)."""
        n = self.prelude_tokens
        for i, s in enumerate(self.slots):
            c = s.candidate
            prev = self.slots[i - 1].candidate if i else None
            follows = (c.deposit_pos == self.prelude_tokens if prev is None else
                       _together(prev, c))
            if s.shift != 0 or not follows:
                break
            n += c.n_tokens
        return n

    def exact_head(self) -> WindowPlan:
        """The plan of the window's exact prefix alone (exact_prefix_tokens: the prelude and its
        leading slots)."""
        n, at = self.exact_prefix_tokens(), self.prelude_tokens
        head = []
        for s in self.slots:
            if at >= n:
                break
            head.append(s)
            at += s.candidate.n_tokens
        return WindowPlan(self.prelude_tokens, tuple(head), self.question_tokens, self.max_new_tokens)

    def seam_positions(self, n: int) -> list[int]:
        """Window positions of the first n tokens of every run of blocks that were computed
        together (each block deposited right after the one before it) except a leading run that
        starts its segment: where a run meets context it was not computed in (another run, or
        the prelude when the run was cut from the front). Empty for n == 0 and for a window of
        one such run from its segment's start."""
        if n <= 0:
            return []
        exact = self.exact_prefix_tokens()
        spans = [(run[0].offset, run[-1].offset + run[-1].candidate.n_tokens) for run in self.runs()]
        return [t for a, b in spans if a >= exact for t in range(a, min(a + n, b))]

    def runs(self) -> list[tuple[Slot, ...]]:
        """The slots cut into runs of blocks that were computed together (each deposited right
        after the one before it), window order."""
        runs: list[list[Slot]] = []
        for i, s in enumerate(self.slots):
            if i and _together(self.slots[i - 1].candidate, s.candidate):
                runs[-1].append(s)
            else:
                runs.append([s])
        return [tuple(r) for r in runs]


def plan(candidates: list[Candidate], prelude_tokens: int, question_tokens: int, max_new_tokens: int,
         window_tokens: int, top_k: int, context: dict[int, list[Candidate]] | None = None,
         max_context_tokens: int | None = None, order: str = "document") -> WindowPlan:
    """Take the best-scoring candidates that fit (up to top_k), then as much of each one's
    `context` (row -> the blocks before it in its segment, in document order) as fits, best
    candidate's first, nearest block first; lay all out in document order, or (order
    "best_last") with the run of consecutive blocks that holds the best-scoring selected
    candidate moved last, nearest the question.

    The slots hold at most max_context_tokens tokens (None: what the window has room for): a
    budget that does not depend on the store, so the window's cost does not either. In a small
    store the selected blocks share segments and their context overlaps; in a large one each
    brings its own, and without a budget the window grows with the store until it is full."""
    budget = window_tokens - prelude_tokens - question_tokens - max_new_tokens
    if order not in ORDERS:
        raise ValueError(f"order is one of {ORDERS}, got {order!r}")
    if budget < 0:
        raise ValueError(f"the question ({question_tokens} tokens) and answer ({max_new_tokens}) do not fit the "
                         f"window of {window_tokens} tokens")
    if max_context_tokens is not None:
        budget = min(budget, max_context_tokens)
    chosen: dict[int, Candidate] = {}
    used = 0
    picked: list[Candidate] = []
    for c in sorted(candidates, key=lambda c: -c.score):
        if len(picked) == top_k:
            break
        if c.row in chosen or used + c.n_tokens > budget:
            continue
        chosen[c.row] = c
        picked.append(c)
        used += c.n_tokens
    for c in picked:
        for p in reversed((context or {}).get(c.row, [])):     # nearest first: cut from the front
            if p.row in chosen:
                continue                      # a context block that was selected itself counts as selected
            if used + p.n_tokens > budget:
                break
            chosen[p.row] = Candidate(**{**p.__dict__, "selected": False})
            used += p.n_tokens
    runs = _runs(sorted(chosen.values(), key=lambda c: (c.doc_rank, c.doc_start)))
    if order == "best_last" and len(runs) > 1:
        def best_score(run):
            return max((c.score for c in run if c.selected), default=float("-inf"))
        best = max(range(len(runs)), key=lambda i: best_score(runs[i]))
        runs.append(runs.pop(best))
    slots, pos = [], prelude_tokens
    for c in (c for run in runs for c in run):
        slots.append(Slot(c, pos, pos))
        pos += c.n_tokens
    return WindowPlan(prelude_tokens, tuple(slots), question_tokens, max_new_tokens)


def follows(prev: Candidate, c: Candidate) -> bool:
    """c is the block after prev in the same document."""
    return prev.doc_id == c.doc_id and prev.doc_start + prev.n_tokens == c.doc_start


def _together(prev: Candidate, c: Candidate) -> bool:
    """c was deposited right after prev, in the same forward sequence (computed together)."""
    return follows(prev, c) and prev.deposit_pos + prev.n_tokens == c.deposit_pos


def _runs(cands: list[Candidate]) -> list[list[Candidate]]:
    """Candidates in document order cut into runs of consecutive blocks of one document."""
    runs: list[list[Candidate]] = []
    for c in cands:
        if runs and follows(runs[-1][-1], c):
            runs[-1].append(c)
        else:
            runs.append([c])
    return runs
