"""ShortConv: the causal depthwise convolution equals torch's conv1d, carries its state, and differentiates."""

import copy

import pytest
import torch
import torch.nn.functional as F

from subquad.layers.conv import ShortConv
from tests.ops.harness import assert_close, count_calls


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


def _kernel_calls(monkeypatch):
    """The convolution kernel's calls."""
    from subquad.layers import conv as conv_module

    return count_calls(monkeypatch, conv_module.KERNEL)


@pytest.mark.parametrize("W,bias", [(1, True), (3, False), (4, True)])
@pytest.mark.parametrize("activation", [None, "silu"])
def test_the_c_call_equals_conv1d_packed_strided_and_short(monkeypatch, W, bias, activation):
    """A float32 prompt without gradients runs in one C call (``kernels/short_conv.c``), against conv1d in float64:
    rows read through in_proj's strides, 300 channels (a block and a tail), prompts shorter than the reach, a
    packed row of prompts of 1, 2 and 40 tokens from their own tails (one call), silu after; inputs untouched."""
    from subquad.layers import conv as conv_module

    if not conv_module.KERNEL.available():
        pytest.skip("no C compiler: the kernel cannot be built")
    calls = _kernel_calls(monkeypatch)
    torch.manual_seed(W)
    conv = ShortConv(300, W, bias=bias)
    if bias:
        torch.nn.init.normal_(conv.bias)
    act = (lambda t: t) if activation is None else F.silu
    ref = copy.deepcopy(conv).double()
    for B, T in ((2, 33), (3, 1), (1, 2)):
        x = torch.randn(B, T, 700)[..., 100:400]                             # token stride 700
        state = torch.randn(B, W - 1, 300)
        before = (x.clone(), state.clone())
        with torch.no_grad():
            y, new = conv(x, state, activation=activation)
        want = act(reference(ref, x.double(), state.double()))
        assert_close(y.double(), want, 1e-5, "y")
        assert torch.equal(new, torch.cat([state, x], 1)[:, T:]) and new.shape == (B, W - 1, 300)
        assert torch.equal(x, before[0]) and torch.equal(state, before[1])
    assert len(calls) == 3
    lengths = [1, 2, 40]
    x = torch.randn(1, sum(lengths), 300)
    state = torch.randn(3, W - 1, 300)
    with torch.no_grad():
        y, new = conv(x, state, cu_seqlens=torch.tensor([0, 1, 3, 43]), activation=activation)
    assert len(calls) == 4 and new.shape == (3, W - 1, 300)
    for i, (a, b) in enumerate(((0, 1), (1, 3), (3, 43))):
        want = act(reference(ref, x[:, a:b].double(), state[i:i + 1].double()))
        assert_close(y[:, a:b].double(), want, 1e-5, f"prompt {i}")
        assert torch.equal(new[i:i + 1], torch.cat([state[i:i + 1], x[:, a:b]], 1)[:, b - a:])
    with pytest.raises(ValueError, match="state must be"):
        conv(x, state[:2], cu_seqlens=torch.tensor([0, 1, 3, 43]))
    with pytest.raises(ValueError, match="activation"):
        conv(x, activation="gelu")
    with torch.no_grad():                          # shapes the C call would read past: refused, not read
        with pytest.raises(ValueError, match="channels=300"):
            conv(torch.randn(1, 5, 4096))
        if W > 1:
            with pytest.raises(ValueError, match="state must be"):
                conv(torch.randn(1, 5, 300), torch.randn(1, 1, 8))


def test_gradients_and_float64_keep_the_torch_form(monkeypatch):
    calls = _kernel_calls(monkeypatch)
    conv = ShortConv(8, 4)
    x = torch.randn(2, 9, 8, requires_grad=True)
    y, _ = conv(x, activation="silu")
    y.sum().backward()
    assert x.grad is not None
    conv.double()(x.detach().double())
    assert calls == []
