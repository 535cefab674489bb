"""kvmemory.graft, the one place a window is assembled: pieces of stored chains, blocks entered
mid-way, the pager and the gather's re-rotation, held to the reference rotation byte for byte."""

from __future__ import annotations

import pytest
import torch

from kvmemory.config import StoreConfig
from kvmemory.graft import Piece, after, assemble, chain_pieces
from kvmemory.rope import rotate, shift_cos_sin


def test_chain_pieces_cut_a_chain_at_a_token():
    # blocks of 4 tokens, the last one partial; from token 6 on, placed at window offset 20
    got = chain_pieces([10, 11, 12], [4, 4, 2], 4, start=6, at=20)
    assert got == [Piece(11, 2, 20, 14, skip=2), Piece(12, 2, 22, 14)]
    # from the start at offset 0: every block whole, a byte copy
    assert chain_pieces([10, 11, 12], [4, 4, 2], 4, start=0, at=0) == [
        Piece(10, 4, 0, 0), Piece(11, 4, 4, 0), Piece(12, 2, 8, 0)]


@pytest.fixture
def small(make_memory):
    return make_memory(store_config=StoreConfig(block_tokens=16))


@pytest.mark.parametrize("start,at", [(0, 0), (5, 3), (16, 40), (21, 0)])
def test_assemble_equals_the_reference_rotation(small, rng, start, at):
    """A state's tokens from `start` on, grafted at window offset `at` behind a head: values are the
    stored bytes, keys the stored ones rotated by at - start (kvmemory.rope, float64, rounded once)."""
    st = small.save([rng.randrange(200, 5000) for _ in range(45)])
    store = small.require_store()
    rows = store.chain(store.manifest.states[st.id].last_row)
    n = [int(x) for x in store.block_meta(rows)["n_tokens"]]
    g = small.geometry
    head = torch.randn((g.layers, 2, g.kv_heads, at, g.head_dim)).to(small.kv_dtype)
    kv, fetch = assemble(small.rt, head, chain_pieces(rows, n, 16, start, at))
    tail = st.kv[:, :, :, start:]
    assert kv.shape[3] == at + tail.shape[3] and fetch.blocks == len(chain_pieces(rows, n, 16, start, at))
    assert torch.equal(kv[:, :, :, :at], head)
    assert torch.equal(kv[:, 1, :, at:], tail[:, 1])
    cos, sin = shift_cos_sin(torch.tensor([at - start]), small.rt.freqs)
    want = tail[:, 0] if at == start else rotate(tail[:, 0], cos[0], sin[0])
    assert torch.equal(kv[:, 0, :, at:], want)


def test_after_grafts_blocks_behind_a_prefix_from_their_verified_positions(small, rng):
    a = small.save([rng.randrange(200, 5000) for _ in range(32)])
    store = small.require_store()
    rows = store.chain(store.manifest.states[a.id].last_row)
    prefix = a.kv[:, :, :, :7]
    kv, grafted, rerotated = after(small.rt, prefix, rows)
    assert grafted == 32 and rerotated == 32 and kv.shape[3] == 39
    cos, sin = shift_cos_sin(torch.tensor([7]), small.rt.freqs)
    assert torch.equal(kv[:, 0, :, 7:], rotate(a.kv[:, 0], cos[0], sin[0]))
    assert after(small.rt, prefix, []) == (prefix, 0, 0)
    # the second time the blocks come from the pager's host tier, the same bytes
    again, _, _ = after(small.rt, prefix, rows)
    assert torch.equal(again, kv) and small.pager.host.stats.hits >= len(rows)
