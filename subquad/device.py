"""Which device to run on: ``--device auto|cpu|cuda|mps`` (or ``cuda:1``) for every command.

Models are moved with ``model.to(device)``; batches, the sampler and autocast follow the model's
device (``device_of``). Data batches are drawn on the CPU from the run's seeded generator and
then moved, so a run resumes identically whatever device it continues on.
"""

from __future__ import annotations

import torch

DEVICES = ("auto", "cpu", "cuda", "mps")


def resolve_device(name: str | torch.device | None = "auto") -> torch.device:
    """'auto' picks CUDA, then MPS, then the CPU; a named device that is not there is a ValueError."""
    if name is None or name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        mps = getattr(torch.backends, "mps", None)
        if mps is not None and mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    try:
        dev = torch.device(name)
    except (RuntimeError, TypeError):
        raise ValueError(f"device must be one of {', '.join(DEVICES)} (or e.g. cuda:1), got {name!r}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r}: CUDA is not available on this machine (try --device cpu)")
    if dev.type == "mps" and not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
        raise ValueError(f"device {name!r}: MPS is not available on this machine (try --device cpu)")
    if dev.type not in ("cpu", "cuda", "mps", "xpu", "meta"):
        raise ValueError(f"device must be one of {', '.join(DEVICES)}, got {name!r}")
    return dev


def device_of(model: torch.nn.Module) -> torch.device:
    """The device of a model's first parameter (the CPU for a model without parameters)."""
    p = next(model.parameters(), None)
    return p.device if p is not None else torch.device("cpu")
