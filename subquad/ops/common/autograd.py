"""When a call needs autograd: the chunk forms take a faster, in-place route when it does not."""

from __future__ import annotations

import torch


def wants_grad(*tensors) -> bool:
    """True when gradients are enabled and any of ``tensors`` (None allowed) requires one."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def inference_path(*tensors) -> bool:
    """True when a call may take the no-gradient fast path: no gradient wanted, not inside torch.compile
    (the fast paths choose routes from tensor values and write into preallocated buffers), not on the
    meta device (no values to choose from) and not empty (a batch of 0: nothing to choose a route from).
    Otherwise the differentiable form runs, which is exact too."""
    from subquad.ops.common.precision import compiling

    if wants_grad(*tensors) or compiling():
        return False
    first = next((t for t in tensors if t is not None), None)
    return first is None or (first.device.type != "meta" and first.numel() > 0)
