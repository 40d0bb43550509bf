"""When a call needs autograd: the chunk forms take a faster, in-place route when it does not."""

from __future__ import annotations

import torch


def wants_grad(*tensors) -> bool:
    """True when gradients are enabled and any of ``tensors`` (None allowed) requires one."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)
