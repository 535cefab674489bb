"""gather_blocks: the reference on a grid (CPU), and the CUDA kernel against it (marked gpu).

Tolerances for re-rotated keys: float32 atol 2e-6 + rtol 2e-6 (one rounding of a float64
rotation); bfloat16 and float16: one rounding step of the dtype (rtol 1e-2 / 2e-3).
"""

import pytest
import torch

from kvmemory.ops import gather_blocks, gather_blocks_ref
from kvmemory.rope import rotate, shift_cos_sin

TOL = {torch.float32: dict(atol=2e-6, rtol=2e-6), torch.bfloat16: dict(atol=1e-2, rtol=1e-2),
       torch.float16: dict(atol=2e-3, rtol=2e-3)}


def freqs_for(D, theta=100000.0):
    return 1.0 / theta ** (torch.arange(0, D, 2, dtype=torch.float64) / D)


def case(gen, L, H, C, D, P, k, dtype, max_shift):
    pool = torch.randn((P, L, 2, H, C, D), generator=gen).to(dtype)
    idx = torch.randperm(P, generator=gen)[:k]
    n = torch.randint(1, C + 1, (k,), generator=gen)
    dst = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(n, 0)[:-1]]) + 7
    shift = torch.randint(-max_shift, max_shift + 1, (k,), generator=gen)
    shift[0] = 0
    out = torch.full((L, 2, H, int(dst[-1] + n[-1]) + 3, D), float("nan"), dtype=dtype)
    return pool, idx, n, dst, shift, out, freqs_for(D).float()


GRID = [(2, 1, 4, 8, 3, 2), (3, 3, 16, 64, 5, 4), (2, 8, 5, 128, 6, 5), (1, 2, 256, 64, 4, 3)]


@pytest.mark.parametrize("L,H,C,D,P,k", GRID)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("max_shift", [0, 64, 7000])
def test_reference_copies_values_exactly_and_rotates_keys(L, H, C, D, P, k, dtype, max_shift):
    gen = torch.Generator().manual_seed(L * 1000 + C * 10 + D + max_shift)
    pool, idx, n, dst, shift, out, freqs = case(gen, L, H, C, D, P, k, dtype, max_shift)
    gather_blocks_ref(pool, idx, n, dst, shift, out, freqs)
    for i in range(k):
        b, m, d, s = int(idx[i]), int(n[i]), int(dst[i]), int(shift[i])
        assert torch.equal(out[:, 1, :, d:d + m], pool[b, :, 1, :, :m])           # values: bytes
        if s == 0:
            assert torch.equal(out[:, 0, :, d:d + m], pool[b, :, 0, :, :m])       # zero shift: bytes
        else:   # independent check: rotating by s equals rotating by s/2 twice (composition)
            half = s // 2
            c1, s1 = shift_cos_sin(torch.tensor([half]), freqs)
            c2, s2 = shift_cos_sin(torch.tensor([s - half]), freqs)
            want = rotate(rotate(pool[b, :, 0, :, :m].double(), c1[0], s1[0]), c2[0], s2[0])
            torch.testing.assert_close(out[:, 0, :, d:d + m].double(), want, **{
                k_: v * (4 if dtype != torch.float32 else 1) for k_, v in TOL[dtype].items()})
    assert torch.isnan(out[:, :, :, :7]).all()                                   # untouched outside slots


def test_rotation_matches_rope_applied_at_the_new_position():
    """k rotated to p then shifted by s equals k rotated to p + s (what the model computes)."""
    gen = torch.Generator().manual_seed(3)
    D = 64
    freqs = freqs_for(D).float()
    k0 = torch.randn((2, 3, 10, D), generator=gen, dtype=torch.float64)
    for p, s in ((0, 64), (20, 1000), (300, 7000), (7000, -6990)):
        pos = torch.arange(p, p + 10)
        cos, sin = shift_cos_sin(pos, freqs)
        at_p = rotate(k0, cos, sin).float()
        cos2, sin2 = shift_cos_sin(pos + s, freqs)
        at_ps = rotate(k0, cos2, sin2).float()
        pool = torch.zeros((1, 2, 2, 3, 10, D))
        pool[0, :, 0] = at_p
        out = torch.zeros((2, 2, 3, 10, D))
        gather_blocks_ref(pool, torch.tensor([0]), torch.tensor([10]), torch.tensor([0]), torch.tensor([s]), out, freqs)
        torch.testing.assert_close(out[:, 0], at_ps, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("L,H,C,D,P,k", GRID)
def test_a_list_of_blocks_gathers_the_bytes_of_the_stacked_pool(L, H, C, D, P, k):
    """The pager's blocks unstacked (a list, no copy of them all first): the same output, byte
    for byte, as the stacked pool; a list of mismatched blocks is refused."""
    gen = torch.Generator().manual_seed(P * 100 + k)
    pool, idx, n, dst, shift, out, freqs = case(gen, L, H, C, D, P, k, torch.float32, 7000)
    want = gather_blocks_ref(pool, idx, n, dst, shift, out.clone(), freqs)
    got = gather_blocks(list(pool.unbind(0)), idx, n, dst, shift, out.clone(), freqs)
    assert torch.equal(torch.nan_to_num(got, nan=-1.0), torch.nan_to_num(want, nan=-1.0))
    with pytest.raises(ValueError, match="one shape"):
        gather_blocks_ref([pool[0], pool[1, :, :, :, :-1]], idx[:1] * 0, n[:1].clamp(max=C - 1), dst[:1],
                          shift[:1], out.clone(), freqs)


def test_bad_shapes_are_rejected():
    pool = torch.zeros((2, 1, 2, 1, 4, 8))
    out = torch.zeros((1, 2, 1, 4, 8))
    with pytest.raises(ValueError, match="fit"):
        gather_blocks_ref(pool, torch.tensor([0]), torch.tensor([4]), torch.tensor([2]), torch.tensor([0]), out,
                          freqs_for(8).float())
    with pytest.raises(ValueError, match="match"):
        gather_blocks_ref(pool, torch.tensor([0]), torch.tensor([4]), torch.tensor([0]), torch.tensor([0]),
                          torch.zeros((1, 2, 1, 4, 6)), freqs_for(8).float())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("L,H,C,D,P,k", GRID)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("max_shift", [0, 64, 7000])
def test_cuda_kernel_matches_reference(L, H, C, D, P, k, dtype, max_shift):
    from kvmemory.ops import cuda_ext
    if cuda_ext.load() is None:
        pytest.skip(f"CUDA extension not built: {cuda_ext.why_not()}")
    gen = torch.Generator().manual_seed(L + C + D + max_shift)
    pool, idx, n, dst, shift, out, freqs = case(gen, L, H, C, D, P, k, dtype, max_shift)
    want = gather_blocks_ref(pool, idx, n, dst, shift, out.clone(), freqs)
    got = gather_blocks(pool.cuda(), idx, n, dst, shift, out.cuda(), freqs.cuda()).cpu()
    for i in range(k):
        d, m = int(dst[i]), int(n[i])
        assert torch.equal(got[:, 1, :, d:d + m], want[:, 1, :, d:d + m])
        if int(shift[i]) == 0:
            assert torch.equal(got[:, 0, :, d:d + m], want[:, 0, :, d:d + m])
        else:
            torch.testing.assert_close(got[:, 0, :, d:d + m], want[:, 0, :, d:d + m], **TOL[dtype])
