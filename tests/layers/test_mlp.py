"""The feed-forward layers (``subquad.layers.mlp``): SwiGLU's no-gradient path, which writes the gate's product
in place, against the written-out math in float64 and against its own gradient path."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from subquad.layers.mlp import SwiGLU


@pytest.mark.parametrize("act", ["silu", "gelu_tanh", "gelu"])
@pytest.mark.parametrize("bias", [False, True])
def test_swiglu_without_a_gradient_equals_its_math_and_its_gradient_path(act, bias):
    torch.manual_seed(0)
    m = SwiGLU(13, 37, act, bias)
    x = torch.randn(3, 5, 13)
    x0 = x.clone()
    f = {"silu": F.silu, "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"), "gelu": F.gelu}[act]
    d = {k: v.double() for k, v in m.state_dict().items()}
    xd = x.double()
    lin = (lambda name, t: F.linear(t, d[f"{name}.weight"], d.get(f"{name}.bias")))
    want = lin("w_down", f(lin("w_gate", xd)) * lin("w_up", xd))
    with torch.no_grad():
        got = m(x)
    assert torch.equal(x, x0)                                      # the input is not written
    assert (got.double() - want).abs().max() <= 1e-5 * want.abs().max()
    with_grad = m(x)
    assert with_grad.requires_grad and torch.allclose(got, with_grad.detach(), rtol=0, atol=1e-6)
    with_grad.sum().backward()
    assert m.w_gate.weight.grad is not None and m.w_up.weight.grad is not None
