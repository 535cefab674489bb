"""window_attention: the reference against torch SDPA on a grid (CPU), the CUDA kernel
against the reference (marked gpu), and the transformers registration."""

import math

import pytest
import torch
import torch.nn.functional as F

from kvmemory.ops import use_window_attention, window_attention, window_attention_ref

TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3),
       torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2)}


def paged(gen, Hkv, D, seq_len, page, dtype, spare=3):
    """Random pages in shuffled order plus the contiguous [Hkv, T, D] they spell."""
    n = -(-seq_len // page)
    pool_k = torch.randn((n + spare, Hkv, page, D), generator=gen).to(dtype)
    pool_v = torch.randn((n + spare, Hkv, page, D), generator=gen).to(dtype)
    table = torch.randperm(n + spare, generator=gen)[:n].to(torch.int32)
    k = pool_k[table.long()].permute(1, 0, 2, 3).reshape(Hkv, -1, D)[:, :seq_len]
    v = pool_v[table.long()].permute(1, 0, 2, 3).reshape(Hkv, -1, D)[:, :seq_len]
    return pool_k, pool_v, table, k, v


def sdpa(q, k, v):
    """torch SDPA on the contiguous layout: q [nq, Hq, D], k/v [Hkv, T, D]."""
    nq, Hq, D = q.shape
    T = k.shape[1]
    g = Hq // k.shape[0]
    mask = torch.arange(T)[None, :] <= (T - nq + torch.arange(nq))[:, None]
    out = F.scaled_dot_product_attention(q.float().transpose(0, 1), k.float().repeat_interleave(g, 0),
                                         v.float().repeat_interleave(g, 0), attn_mask=mask)
    return out.transpose(0, 1).to(q.dtype)


GRID = [(1, 1, 64, 1, 17, 16), (3, 1, 64, 1, 700, 256), (9, 3, 64, 4, 513, 256), (8, 2, 128, 3, 64, 7),
        (4, 4, 32, 2, 2, 1)]


@pytest.mark.parametrize("Hq,Hkv,D,nq,T,page", GRID)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_reference_matches_sdpa(Hq, Hkv, D, nq, T, page, dtype):
    gen = torch.Generator().manual_seed(Hq * 100 + T + page)
    pk, pv, table, k, v = paged(gen, Hkv, D, T, page, dtype)
    q = torch.randn((nq, Hq, D), generator=gen).to(dtype)
    torch.testing.assert_close(window_attention_ref(q, pk, pv, table, T), sdpa(q, k, v), **TOL[dtype])
    assert torch.equal(window_attention(q, pk, pv, table, T), window_attention_ref(q, pk, pv, table, T))


def test_causal_within_new_tokens():
    gen = torch.Generator().manual_seed(0)
    pk, pv, table, k, v = paged(gen, 1, 32, 10, 4, torch.float32)
    q = torch.randn((3, 1, 32), generator=gen)
    out = window_attention_ref(q, pk, pv, table, 10)
    # the first new token must not see the two after it: same as attending over 8 tokens
    first = window_attention_ref(q[:1], pk, pv, table, 8)
    torch.testing.assert_close(out[:1], first, atol=1e-6, rtol=1e-6)
    s = (q[0, 0] @ k[0, :8].T) / math.sqrt(32)
    torch.testing.assert_close(out[0, 0], s.softmax(-1) @ v[0, :8], atol=1e-5, rtol=1e-5)


def test_registered_attention_gives_the_same_logits_on_cpu(tiny):
    model, _ = tiny
    ids = torch.randint(0, 1000, (1, 40))
    with torch.inference_mode():
        want = model(input_ids=ids).logits
        use_window_attention(model)
        try:
            got = model(input_ids=ids).logits
        finally:
            model.set_attn_implementation("sdpa")
    assert torch.equal(got, want)     # on the CPU the registered function is the SDPA path


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("Hq,Hkv,D,nq,T,page", GRID)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_cuda_kernel_matches_reference(Hq, Hkv, D, nq, T, page, dtype):
    from kvmemory.ops import cuda_ext
    if cuda_ext.load() is None:
        pytest.skip(f"CUDA extension not built: {cuda_ext.why_not()}")
    gen = torch.Generator().manual_seed(Hq + T + page)
    pk, pv, table, _, _ = paged(gen, Hkv, D, T, page, dtype)
    q = torch.randn((nq, Hq, D), generator=gen).to(dtype)
    want = window_attention_ref(q, pk, pv, table, T)
    got = window_attention(q.cuda(), pk.cuda(), pv.cuda(), table.cuda(), T).cpu()
    torch.testing.assert_close(got, want, **TOL[dtype])
