"""exp of log-decays (arguments <= 0) without the CPU's slow underflow path.

    exp_decay(x) = exp(max(x, floor)),   floor = log(smallest normal) + 0.5:  -86.8 (float32), -707.9 (float64)

exp(x) for x below log(smallest normal) (-87.3 in float32) returns a subnormal or 0, and the vectorised
exp on x86 takes a slow path there, an order of magnitude slower (benchmarks/RESULTS.md, "Decays that
underflow"). Strong decays hit it all the time: Mamba's dt A reaches -100 and below. A factor that small leaves nothing a float32
sum can resolve, so the argument is raised to the floor first: the result differs from exp(x) by less
than 2e-38 (float32) or 4e-308 (float64), and its gradient below the floor is 0 instead of less than
that. Other dtypes are exponentiated as they are. Never for masked (-inf) entries: they must stay 0 -
``decay_mask`` exponentiates first and masks after.
"""

from __future__ import annotations

import math

import torch

FLOOR = {dt: math.log(torch.finfo(dt).tiny) + 0.5 for dt in (torch.float32, torch.float64)}


def exp_decay(x: torch.Tensor) -> torch.Tensor:
    """exp(x) with x raised to ``FLOOR[x.dtype]`` (module doc); autograd-safe."""
    lo = FLOOR.get(x.dtype)
    return torch.exp(x if lo is None else x.clamp_min(lo))


def exp_decay_(x: torch.Tensor) -> torch.Tensor:
    """In place: x <- exp_decay(x) (a buffer no autograd graph holds)."""
    lo = FLOOR.get(x.dtype)
    return (x if lo is None else x.clamp_min_(lo)).exp_()
