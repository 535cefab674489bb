"""Embedding windows: the pieces of a block the text selectors see whole. Pure: no torch, no faiss.

A 256-token block is ~250-300 MiniLM word pieces, while MiniLM was trained on at most 128;
one mean-pooled vector of a whole block dilutes a one-sentence needle to ~5% of the pool.
So a block is cut into overlapping windows of at most `WINDOW_PIECES` word pieces (the
embedder sees each one whole: nothing is truncated), each window is embedded and indexed
for BM25, and a block scores as its best window. The first window of a block also carries
the last `LEAD_PIECES` word pieces of the block before it in the same document, so a
sentence cut by a block boundary is still seen whole once (by the later block, whose
segment-prefix expansion brings the earlier block along at ask time); a word the boundary
splits is whole there too.

Index ids: window w of block row r has id r * WINDOW_SLOTS + w.
"""

from __future__ import annotations

WINDOW_PIECES = 62       # + [CLS] + [SEP] = 64: short enough that a one-sentence needle is a fair part of the pool
STRIDE = 31              # half-overlapping windows: every run of <= 31 pieces is whole in one
LEAD_PIECES = 32
WINDOW_SLOTS = 4096      # room for a block's windows (prose: ~10 a block; a block of 256 tokens would need
                         # over 120,000 characters to reach this)


def window_id(row: int, w: int) -> int:
    return row * WINDOW_SLOTS + w


def row_of(wid: int) -> int:
    return wid // WINDOW_SLOTS


def spans(n_pieces: int, lead: int = 0) -> list[tuple[int, int]]:
    """[start, stop) spans over a block's pieces (the first `lead` of which belong to the block
    before it), each at most WINDOW_PIECES long, overlapping by WINDOW_PIECES - STRIDE."""
    if n_pieces <= lead:
        return [(0, n_pieces)] if n_pieces else []
    out, s = [], 0
    while True:
        e = min(s + WINDOW_PIECES, n_pieces)
        out.append((max(0, e - WINDOW_PIECES), e))    # the last window ends flush, full length
        if e == n_pieces:
            break
        s += STRIDE
    if len(out) > WINDOW_SLOTS:      # never drop a piece: refuse instead
        raise ValueError(f"a block of {n_pieces} word pieces needs {len(out)} windows; at most {WINDOW_SLOTS}")
    return out


def block_windows(pieces, texts: list[str], leads: list[str | None]) -> list[list[list[int]]]:
    """The windows (word-piece id lists) of each block. pieces(text) -> word-piece ids;
    leads[i] is the text of the block before block i in its document, or None.

    The lead is cut from the pieces of the joined text (lead + block), not from the lead's own
    pieces: a word split by the block boundary ("xkz" | "341") is then one word ("xkz341") in the
    block's first window, as BM25 and MiniLM must see it."""
    out = []
    for text, lead in zip(texts, leads):
        own = pieces(text)
        if lead is None:
            ids, n_lead = own, 0
        else:
            joined = pieces(lead + text)
            n_lead = max(0, len(joined) - len(own))
            start = max(0, n_lead - LEAD_PIECES)
            ids, n_lead = joined[start:], n_lead - start
        out.append([ids[s:e] for s, e in spans(len(ids), n_lead)])
    return out
