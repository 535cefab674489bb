"""The one device policy. Tensors the model consumes (token ids, restored KV, caches) go to the
model's device; what is stored, hashed, indexed or returned to the caller comes back to the CPU.
Every module places tensors through these functions, none decides on its own."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def device_of(model) -> torch.device:
    """The device the model's weights live on."""
    try:
        return next(model.parameters()).device
    except StopIteration:
        return torch.device("cpu")


def ids_tensor(ids: Sequence[int], model) -> torch.Tensor:
    """[1, T] int64 token ids on the model's device."""
    return torch.tensor([list(ids)], dtype=torch.long, device=device_of(model))


def to_model(t: torch.Tensor, model) -> torch.Tensor:
    """t on the model's device (the same tensor when it is already there)."""
    dev = device_of(model)
    return t if t.device == dev else t.to(dev, non_blocking=t.is_pinned())


def to_host(t: torch.Tensor) -> torch.Tensor:
    """t detached on the CPU (the same tensor when it is already there)."""
    t = t.detach()
    return t if t.device.type == "cpu" else t.cpu()
