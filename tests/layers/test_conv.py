"""ShortConv: the causal depthwise convolution equals torch's conv1d, carries its state, and differentiates."""

import pytest
import torch
import torch.nn.functional as F

from subquad.layers.conv import ShortConv
from tests.ops.harness import assert_close


def reference(conv, x, state):
    """conv1d over [state, x] in the (B, D, T) layout: y_t = sum_i w_i x_{t-W+1+i} + b."""
    xs = torch.cat([state, x], 1).transpose(1, 2)
    return F.conv1d(xs, conv.weight, conv.bias, groups=x.shape[-1]).transpose(1, 2)


@pytest.mark.parametrize("W,bias", [(1, True), (2, False), (4, True)])
@pytest.mark.parametrize("T", [1, 3, 17])
def test_short_conv_equals_conv1d_with_state_and_gradients(W, bias, T):
    torch.manual_seed(W * 100 + T)
    conv = ShortConv(6, W, bias=bias).double()
    if bias:
        torch.nn.init.normal_(conv.bias)
    x = torch.randn(2, T, 6, dtype=torch.float64, requires_grad=True)
    state = torch.randn(2, W - 1, 6, dtype=torch.float64)
    y, new_state = conv(x, state)
    y_ref = reference(conv, x, state)
    assert_close(y, y_ref, 1e-12, "y")
    assert_close(new_state, torch.cat([state, x], 1)[:, -(W - 1):] if W > 1 else new_state, 1e-12, "state")
    g = torch.randn_like(y)
    params = [x] + list(conv.parameters())
    for a, b in zip(torch.autograd.grad((y * g).sum(), params), torch.autograd.grad((y_ref * g).sum(), params)):
        assert_close(a, b, 1e-12, "gradient")


def test_short_conv_in_two_calls_equals_one():
    torch.manual_seed(0)
    conv = ShortConv(5, 4).double()
    x = torch.randn(1, 20, 5, dtype=torch.float64)
    y, _ = conv(x)
    y1, s = conv(x[:, :7])
    y2, _ = conv(x[:, 7:], s)
    assert_close(torch.cat([y1, y2], 1), y, 1e-12, "split")
