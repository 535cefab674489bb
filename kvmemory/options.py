"""AskOptions: how `ask` selects, grafts and answers, in one frozen, validated place. Memory.ask, the
HTTP schema (server/schemas.AskRequest), the CLI's `kvmemory ask` flags and kvmemory.ask all take it.

The defaults are measured (kvmemory/config.py says where)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from kvmemory.config import (ASK_CONTEXT_TOKENS, ASK_MIN_RELEVANCE, ASK_ORDER, ASK_RECOMPUTE, ASK_RERANK,
                             ASK_REREAD, ASK_RERANK_KEEP, ASK_RERANK_MARGIN, ASK_SEAM, ASK_TOP_K)
from kvmemory.errors import InputError
from kvmemory.index import SELECTORS
from kvmemory.window import ORDERS

MAX_NEW_TOKENS = 48                # an answer, not an essay: a few dozen tokens


def check_recompute(recompute) -> None:
    """recompute (ask, solve, chat memory): the fraction of the grafted tokens to recompute, a number in
    [0, 1] (not a boolean)."""
    if isinstance(recompute, bool) or not isinstance(recompute, (int, float)) or not 0.0 <= recompute <= 1.0:
        raise InputError(f"recompute is the fraction of the grafted tokens to recompute, a number in [0, 1], "
                         f"got {recompute!r}")


def check_min_relevance(min_relevance, of: str = "block") -> None:
    """min_relevance (ask, chat memory): a hit after the first needs this fraction of the first's BM25
    score, a number in [0, 1] (not a boolean)."""
    if not _num(min_relevance) or not 0.0 <= min_relevance <= 1.0:
        raise InputError(f"min_relevance is a fraction of the best {of}'s BM25 score in [0, 1], got {min_relevance!r}")


def _int(v, lo: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= lo


def _num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


@dataclass(frozen=True)
class AskOptions:
    """top_k: blocks selected (each with its segment prefix when expand). selector: "text" (MiniLM
    windows + BM25, fused), "dense", "bm25" or "keys". max_new_tokens: the answer's length at most.
    recompute: the fraction of the grafted tokens recomputed with the question (0: none; 1: the
    window re-read). min_relevance: a selected block after the first needs this fraction of the
    first's BM25 score. rerank: the fused ranking's first `rerank` blocks re-ordered by the
    question's likelihood over their stored KV (0 or 1: off); rerank_margin: a second block only
    within this many nats per question token of the best; rerank_keep: the first ranking's best block
    stays in the window whatever the re-rank says (the re-rank's best joins it). max_context_tokens: the grafted tokens at
    most, whatever the store's size. seam: the first `seam` tokens of every grafted run that meets
    context it was not computed in, recomputed. reread: the window's tokens after its exact prefix (the
    leading run grafted where it was computed) prefilled over it instead of grafted: the window then holds
    what re-reading its text computes, and recompute and seam have nothing left to do; a window of one
    exact run is grafted whole either way. order: "document" or "best_last"."""

    top_k: int = ASK_TOP_K
    selector: str = "text"
    max_new_tokens: int = MAX_NEW_TOKENS
    recompute: float = ASK_RECOMPUTE
    expand: bool = True
    min_relevance: float = ASK_MIN_RELEVANCE
    rerank: int = ASK_RERANK
    rerank_margin: float = ASK_RERANK_MARGIN
    rerank_keep: bool = ASK_RERANK_KEEP
    max_context_tokens: int = ASK_CONTEXT_TOKENS
    seam: int = ASK_SEAM
    reread: bool = ASK_REREAD
    order: str = ASK_ORDER

    def __post_init__(self) -> None:
        if not _int(self.top_k, 1) or not _int(self.max_new_tokens, 1):
            raise InputError(f"top_k and max_new_tokens must be >= 1, got {self.top_k} and {self.max_new_tokens}")
        if self.selector not in SELECTORS:
            raise InputError(f"selector must be one of {SELECTORS}, got {self.selector!r}")
        check_recompute(self.recompute)
        if not isinstance(self.expand, bool):
            raise InputError(f"expand is true or false, got {self.expand!r}")
        check_min_relevance(self.min_relevance)
        if not _int(self.rerank, 0):
            raise InputError(f"rerank is how many ranked blocks to re-rank with the model (0: none), "
                             f"got {self.rerank!r}")
        if not _num(self.rerank_margin) or not self.rerank_margin >= 0:
            raise InputError(f"rerank_margin is in nats per question token, a number >= 0, got {self.rerank_margin!r}")
        if not isinstance(self.rerank_keep, bool):
            raise InputError(f"rerank_keep is true or false, got {self.rerank_keep!r}")
        if not _int(self.max_context_tokens, 1):
            raise InputError(f"max_context_tokens is a number of tokens >= 1, got {self.max_context_tokens!r}")
        if not _int(self.seam, 0):
            raise InputError(f"seam is how many tokens to recompute at the start of each grafted run (0: none), "
                             f"got {self.seam!r}")
        if not isinstance(self.reread, bool):
            raise InputError(f"reread is true or false, got {self.reread!r}")
        if self.order not in ORDERS:
            raise InputError(f"order is one of {', '.join(ORDERS)}, got {self.order!r}")

    def but(self, **changes: Any) -> AskOptions:
        """A copy with `changes` (None values ignored: the option keeps this one's value); an unknown
        name is an InputError naming it."""
        names = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(changes) - names)
        if unknown:
            raise InputError(f"unknown ask option(s) {', '.join(unknown)}; the options are {', '.join(sorted(names))}")
        return dataclasses.replace(self, **{k: v for k, v in changes.items() if v is not None})

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def option_names() -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(AskOptions))


# what each option is, in a sentence (the CLI's --help; AskOptions' docstring says the same at length)
HELP = {
    "top_k": ("N", "blocks to select; each comes with the blocks before it in its segment"),
    "selector": (None, "text: MiniLM windows + BM25, fused; dense, bm25: one of them alone; keys: the model's own "
                       "keys (opt-in, weaker)"),
    "max_new_tokens": ("N", "the answer's length at most, in tokens"),
    "recompute": ("R", "fraction of the window's tokens to recompute so grafted blocks see each other "
                       "(0..1; 1 = re-prefill the window's text)"),
    "expand": (None, "graft the blocks before each selected one in its segment"),
    "min_relevance": ("F", "drop selected blocks whose BM25 score is below F x the best block's (0..1)"),
    "rerank": ("N", "re-rank the first N ranked blocks by the question's likelihood over their stored KV (0: off)"),
    "rerank_margin": ("M", "with rerank, keep a block after the best only within M nats per question token"),
    "rerank_keep": (None, "with rerank, keep the first ranking's best block in the window; the re-rank's best "
                          "joins it"),
    "max_context_tokens": ("N", "at most N grafted tokens, whatever the store's size"),
    "seam": ("N", "recompute the first N tokens of every grafted run that meets context it was not computed in, "
                  "at every layer (0: off)"),
    "reread": (None, "prefill the grafted tokens after the window's exact prefix over it instead of grafting them "
                     "re-rotated (a window of one exact run costs nothing more)"),
    "order": (None, "document: runs in document order; best_last: the run holding the best block nearest the "
                    "question"),
}
CHOICES = {"selector": SELECTORS, "order": ORDERS}
