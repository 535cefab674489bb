"""kvmemory.decode.sampler with the sampling keys clients send: exactly `sample` at neutral values,
and each key doing what it says on logits where the answer is known."""

from __future__ import annotations

import torch

from kvmemory.decode import Sampler, sample, sampler


def test_neutral_keys_draw_exactly_what_sample_draws():
    logits = torch.randn(500, generator=torch.Generator().manual_seed(3))
    plain = [sample(logits, 0.8, 0.9, torch.Generator().manual_seed(7)) for _ in range(1)]
    a = sampler(0.8, 0.9, seed=7)
    b = sampler(0.8, 0.9, seed=7, top_k=0, min_p=0.0, repetition_penalty=1.0, presence_penalty=0.0,
                frequency_penalty=0.0, logit_bias={})
    assert not isinstance(b, Sampler)
    assert [a(logits) for _ in range(20)][:1] == plain and [b(logits) for _ in range(1)] == plain


def test_logit_bias_forces_and_bans_tokens():
    logits = torch.zeros(100)
    logits[5] = 3.0
    assert sampler(0.0, logit_bias={42: 100.0})(logits) == 42
    assert sampler(0.0, logit_bias={5: -100.0})(logits) != 5
    draws = {sampler(1.0, seed=s, logit_bias={42: 100.0})(logits) for s in range(20)}
    assert draws == {42}


def test_top_k_and_min_p_keep_only_the_likeliest():
    logits = torch.linspace(0, 4, 50)                # token 49 the likeliest, then 48, ...
    assert {sampler(1.0, seed=s, top_k=1)(logits) for s in range(30)} == {49}
    assert {sampler(1.0, seed=s, top_k=3)(logits) for s in range(200)} <= {47, 48, 49}
    assert {sampler(1.0, seed=s, min_p=1.0)(logits) for s in range(30)} == {49}
    p = torch.softmax(logits, -1)
    kept = {i for i in range(50) if p[i] >= 0.5 * p.max()}
    assert {sampler(1.0, seed=s, min_p=0.5)(logits) for s in range(300)} <= kept


def test_penalties_push_away_from_tokens_already_used():
    logits = torch.zeros(10)
    logits[3], logits[4] = 2.0, 1.9
    pick = sampler(0.0, frequency_penalty=0.5)                    # per use: 3 twice (1.0) falls under 4 once (1.4)
    assert [pick(logits) for _ in range(4)] == [3, 4, 3, 4]
    pick = sampler(0.0, presence_penalty=1.0)                     # once is all: 3 (1.0) stays over 4 (0.9)
    assert [pick(logits) for _ in range(4)] == [3, 4, 3, 3]
    rep = sampler(0.0, repetition_penalty=2.0, prompt=[3])
    assert rep(logits) == 4                                       # 2.0 / 2 = 1.0 < 1.9: the prompt's token penalised
    neg = torch.full((10,), -1.0)
    neg[7] = -0.5
    assert sampler(0.0, repetition_penalty=3.0, prompt=[7])(neg) != 7   # a negative logit multiplied: -1.5


def test_a_vanishing_temperature_draws_the_largest_logit_not_nan():
    """A subnormal temperature (5e-324 passes the API's 0..2 bound) overflows logits / T: the draw is
    its limit, the largest logit's token (ties shared), through `sample` and the Sampler alike; an
    ordinary temperature draws exactly what it drew before (softmax(logits / T))."""
    from kvmemory.decode import tempered
    logits = torch.randn(500, generator=torch.Generator().manual_seed(5))
    best = int(logits.argmax())
    for t in (5e-324, 1e-45, 1e-300):
        assert {sample(logits, t, 1.0, torch.Generator().manual_seed(s)) for s in range(10)} == {best}
        assert {sampler(t, seed=s, top_k=50, presence_penalty=0.5)(logits) for s in range(10)} == {best}
    tied = torch.zeros(8)
    tied[[2, 6]] = 4.0
    assert tempered(tied, 5e-324).tolist() == [0, 0, 0.5, 0, 0, 0, 0.5, 0]
    assert torch.equal(tempered(logits, 0.7), torch.softmax(logits / 0.7, dim=-1))


def test_a_vanishing_top_p_keeps_the_most_likely_token_not_nothing():
    # found by tests/server/test_schema.py's hostile values: top_p = 5e-324 rounds to 0 in float32, so
    # "cumulative mass before a token < top_p" held for no token, and the draw from all zeros was a 500
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(50, generator=g)
    best = int(logits.argmax())
    for top_p in (5e-324, 1e-45, 1e-30):
        assert sample(logits, 1.0, top_p, torch.Generator().manual_seed(1)) == best
        for s in (Sampler(1.0, top_p, torch.Generator().manual_seed(1), 3, 0.0, 1.0, 0.0, 0.0, {}, ()),
                  sampler(0.7, top_p, seed=2, min_p=0.01)):
            assert [s(logits) for _ in range(5)] == [best] * 5
