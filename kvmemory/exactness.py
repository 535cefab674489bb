"""Measures for the exactness contract: KL divergence and largest logit difference."""

from __future__ import annotations

import torch


def kl_divergence(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    """KL(P || Q) over the last axis, in float64, summed over rows. Exactly 0.0 for equal logits."""
    p = torch.log_softmax(p_logits.double(), dim=-1)
    q = torch.log_softmax(q_logits.double(), dim=-1)
    return float((p.exp() * (p - q)).sum(dim=-1).sum())


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max()) if a.numel() else 0.0
