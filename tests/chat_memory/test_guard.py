"""The reply guard (kvmemory/chat_memory/guard.py): a reply never completes one of the memory's own
openings at its start; everything else it picks as the wrapped pick does."""

from __future__ import annotations

import torch

from kvmemory.chat_memory.guard import OPENINGS, Guard


def _favour(vocab: int, *ranked: int) -> torch.Tensor:
    """Logits whose best tokens are `ranked`, in that order."""
    x = torch.zeros(vocab)
    for i, t in enumerate(ranked):
        x[t] = 10.0 - i
    return x


def test_a_reply_never_opens_as_a_remembered_turn_reads(tokenizer):
    ids = lambda s: tokenizer(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    V = len(tokenizer)
    the, user, said = ids("The user said")
    s = ids("'s")[0]
    g = Guard(tokenizer)
    assert g(_favour(V, the)) == the and g(_favour(V, user)) == user     # "The user's ..." is an answer
    assert g(_favour(V, said, s)) == s                     # "The user said" reads as a remembered turn
    assert g.banned == 1
    assert g(_favour(V, said)) == said                     # later in the reply, any token
    for o in OPENINGS:
        seq = ids(o)
        g = Guard(tokenizer)
        picked = [g(_favour(V, t, 7)) for t in seq]
        assert picked != seq and picked[:-1] == seq[:-1] and picked[-1] == 7, o


def test_it_wraps_another_pick_and_leaves_other_replies_alone(tokenizer):
    V = len(tokenizer)
    seen = []

    def inner(logits):
        seen.append(logits)
        return int(logits.argmax())
    g = Guard(tokenizer, inner)
    reply = tokenizer("Your locker combination is 52917.", add_special_tokens=False)["input_ids"]
    assert [g(_favour(V, t)) for t in reply] == reply and g.banned == 0
    assert len(seen) == len(reply)


class _Spy(Guard):
    """A Guard that records itself (made: every one built)."""
    made: list = []

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        _Spy.made.append(self)


def test_a_reply_that_recalled_turns_is_guarded_by_default(make_memory, monkeypatch):
    """ChatMemory.guard is on (GUARD): a Python reply with recalled turns picks through a Guard; one
    that recalled nothing, or with guard off, does not."""
    from kvmemory.chat_memory import window
    monkeypatch.setattr(_Spy, "made", [])
    monkeypatch.setattr(window, "Guard", _Spy)
    alice = make_memory().chat_memory("alice")
    assert alice.guard is True
    _, st = alice.reply([{"role": "user", "content": "Remember: my locker code is 4417."}], session="s1",
                        max_new_tokens=3)
    assert st["recalled"] == [] and _Spy.made == []                 # nothing recalled: nothing to guard
    _, st = alice.reply([{"role": "user", "content": "What is my locker code?"}], session="s2", max_new_tokens=3)
    assert st["recalled"] and len(_Spy.made) == 1 and len(_Spy.made[0].out) >= st["tokens_decoded"] > 0
    alice.guard = False
    _, st = alice.reply([{"role": "user", "content": "Which locker code did I tell you?"}], session="s3",
                        max_new_tokens=3)
    assert st["recalled"] and len(_Spy.made) == 1
