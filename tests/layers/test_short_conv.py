"""The gated short convolution (LFM2's, ``subquad.layers.short_conv``): the generic battery, context
parallelism included (its halo crosses ranks), and its equation written out with ``torch.nn.functional.conv1d``."""

import torch
import torch.nn.functional as F

from subquad.layers.registry import build_mixer
from subquad.testing import check_mixer


def test_the_battery_with_context_parallelism():
    check_mixer("gated_conv", context_parallel=True)


def test_equals_its_equation_with_and_without_bias():
    for bias in (False, True):
        torch.manual_seed(0)
        layer = build_mixer("gated_conv", 12, 2, conv_size=3, bias=bias).double()
        x = torch.randn(2, 17, 12, dtype=torch.float64)
        b, c, xs = F.linear(x, layer.in_proj.weight, layer.in_proj.bias).chunk(3, -1)
        conv = F.conv1d((b * xs).transpose(1, 2), layer.conv.weight, layer.conv.bias, padding=2, groups=12)
        want = layer.out_proj(c * conv[..., :17].transpose(1, 2))
        y, state = layer(x)
        torch.testing.assert_close(y, want, rtol=0, atol=1e-12)
        torch.testing.assert_close(state["conv"], (b * xs)[:, -2:], rtol=0, atol=0)
        assert (layer.in_proj.bias is None) == (not bias) and layer.state_bytes(state) == 2 * 2 * 12 * 8
