"""Selective recompute (kvmemory/blend.py) on a small random model: the seams (`always`), alone
and with r, against one forward of the window's text."""

import pytest
import torch

from kvmemory import kv as kvops
from kvmemory.blend import blend_prefill
from tests.conftest import make_tiny


@pytest.fixture(scope="module")
def model(real_model):
    return make_tiny(real_model[1], seed=3, layers=4)        # 4 layers: the selection at layer 2 happens


@torch.inference_mode()
def _kv(model, ids, start=0):
    cache = kvops.make_cache(None, model.config)
    pos = torch.arange(start, start + len(ids)).unsqueeze(0)
    model(input_ids=torch.tensor([ids]), position_ids=pos, past_key_values=cache, use_cache=True)
    return kvops.cache_slice(cache, 0, len(ids))


def _window(model, rng, W=96, exact=40):
    """A window whose first `exact` tokens' K/V are the one-forward K/V, and whose rest was
    computed without them (the rest alone, at its own positions): a graft that missed its context."""
    ids = torch.randint(100, 4000, (W,), generator=rng).tolist()
    full = _kv(model, ids)
    graft = full.clone()
    graft[:, :, :, exact:] = _kv(model, ids[exact:], start=exact)
    return ids, full, graft


@torch.inference_mode()
def test_seams_alone_recompute_exactly_those_tokens(model):
    rng = torch.Generator().manual_seed(7)
    ids, full, graft = _window(model, rng)
    q = [11, 12, 13, 14]
    ref = model(input_ids=torch.tensor([ids + q])).logits[0, -1]
    seams = list(range(40, 48))
    logits, kv, st = blend_prefill(model, graft, ids, q, 0.0, exact_tokens=40, always=seams)
    assert st.recomputed == 8 and st.checked == 8
    rest = [t for t in range(96) if t not in seams]
    assert torch.equal(kv[:, :, :, rest], graft[:, :, :, rest])              # nobody else's K/V moved
    assert not torch.equal(kv[:, :, :, seams], graft[:, :, :, seams])
    # the seams' deeper layers now see the exact prefix: they match the one-forward K/V
    torch.testing.assert_close(kv[:, :, :, seams], full[:, :, :, seams], atol=1e-4, rtol=1e-4)
    # every token after the exact prefix a seam: the window's text re-prefilled
    logits_all, _, st_all = blend_prefill(model, graft, ids, q, 0.0, exact_tokens=40, always=range(40, 96))
    torch.testing.assert_close(logits_all, ref, atol=1e-4, rtol=1e-4)
    assert st_all.recomputed == 56
    err = lambda x: float((x - ref).abs().max())               # noqa: E731
    assert err(logits) < err(blend_prefill(model, graft, ids, q, 0.0, exact_tokens=40, always=[95])[0])


@torch.inference_mode()
def test_seams_with_r_are_kept_whatever_their_deviation(model):
    rng = torch.Generator().manual_seed(8)
    ids, full, graft = _window(model, rng)
    q = [21, 22]
    _, plain_kv, plain = blend_prefill(model, graft, ids, q, 0.1, exact_tokens=40)
    # past layer 1 (where the deviation is measured) a token keeps its grafted K/V unless kept
    kept = lambda kv: {t for t in range(40, 96) if not torch.equal(kv[2:, :, :, t], graft[2:, :, :, t])}  # noqa: E731
    seams = [t for t in range(95, 39, -1) if t not in kept(plain_kv)][:6]     # ones the deviation passed over
    _, kv, st = blend_prefill(model, graft, ids, q, 0.1, exact_tokens=40, always=seams)
    assert plain.recomputed == round(0.1 * 96) == len(kept(plain_kv))
    assert st.recomputed == plain.recomputed + len(seams) == len(kept(kv))
    assert kept(kv) == kept(plain_kv) | set(seams)


def test_bad_seams_are_refused(model):
    rng = torch.Generator().manual_seed(9)
    ids, _, graft = _window(model, rng)
    with pytest.raises(ValueError, match="r must be"):
        blend_prefill(model, graft, ids, [5], 0.0)                          # nothing to recompute
    with pytest.raises(ValueError, match="exact_tokens"):
        blend_prefill(model, graft, ids, [5], 0.0, exact_tokens=40, always=[10])
    with pytest.raises(ValueError, match="exact_tokens"):
        blend_prefill(model, graft, ids, [5], 0.5, exact_tokens=40, always=[96])
