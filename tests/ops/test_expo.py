"""exp of log-decays without the underflow slow path: equal to exp up to the smallest normal number, NaN
kept, gradients equal where they are representable, and the decayed causal mask still exactly 0 above
the diagonal."""

import math

import pytest
import torch

from subquad.ops.common.chunking import decay_mask
from subquad.ops.common.expo import FLOOR, exp_decay, exp_decay_


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_exp_decay_equals_exp_to_the_smallest_normal(dtype):
    x = torch.cat([torch.linspace(-900, 0, 5001, dtype=dtype), torch.tensor([-math.inf, 3.0], dtype=dtype)])
    got, want = exp_decay(x), torch.exp(x)
    tiny = torch.finfo(dtype).tiny
    assert (got - want).abs().max().item() <= 2 * tiny
    assert torch.equal(got[x > FLOOR[dtype]], want[x > FLOOR[dtype]])        # above the floor: exp itself
    assert (got >= tiny).all()                                              # never subnormal
    assert torch.isnan(exp_decay(torch.tensor([math.nan], dtype=dtype))).all()
    y = x.clone()
    assert torch.equal(exp_decay_(y), got) and torch.equal(y, got)          # in place, same values


def test_gradient_equals_exp_above_the_floor():
    x = torch.tensor([-1.0, -50.0, -700.0, -800.0], dtype=torch.float64, requires_grad=True)
    exp_decay(x).sum().backward()
    assert torch.equal(x.grad[:3], torch.exp(x.detach()[:3])) and x.grad[3] == 0
    assert exp_decay(torch.tensor([-1.0], dtype=torch.bfloat16)).dtype == torch.bfloat16   # other dtypes as exp


def test_decay_mask_is_zero_above_the_diagonal_whatever_the_decays():
    b = torch.cumsum(-torch.rand(3, 9, dtype=torch.float64) * 200, -1)     # strong decays: exponents far below
    want = torch.exp(b.unsqueeze(-1) - b.unsqueeze(-2)).tril()
    for out in (None, torch.empty(3, 9, 9, dtype=torch.float64)):
        got = decay_mask(b, out=out)
        assert (got.triu(1) == 0).all()
        assert (got - want).abs().max().item() <= 1e-300
