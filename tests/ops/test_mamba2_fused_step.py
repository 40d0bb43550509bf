"""The fused Mamba-2 decoding step (ops.decay.fused_step, kernels/mamba2_step.c) against its math written out in
float64 here, and inside the layer against the layer's own PyTorch step: groups of heads, norm groups, no norm,
a dt limit, odd sizes, batch > 1, strong decays, states left as they were."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from subquad.ops.decay import fused_step
from tests.ops.fused_harness import assert_steps_agree, models

pytestmark = pytest.mark.skipif(not fused_step.KERNEL.available(), reason="no C compiler: the kernel cannot be built")


def reference(zxbcdt, conv_state, conv_w, conv_b, dt_bias, A_log, Dp, S, norm_w, G, group_size, eps, lo, hi):
    """The module doc's step, op by op in float64."""
    Bz, H, N, P = S.shape
    Dn = H * P
    t = [None if v is None else v.double() for v in (zxbcdt, conv_state, conv_w, conv_b, dt_bias, A_log, Dp, S,
                                                     norm_w)]
    zxbcdt, conv_state, conv_w, conv_b, dt_bias, A_log, Dp, S, norm_w = t
    z, xBC, dt = zxbcdt.split([Dn, Dn + 2 * G * N, H], -1)
    window = torch.cat([conv_state, xBC[:, None]], 1)
    xBC = F.silu((window * conv_w.t()[None]).sum(1) + (0 if conv_b is None else conv_b))
    x, Bm, Cm = xBC.split([Dn, G * N, G * N], -1)
    x, Bm, Cm = x.view(Bz, H, P), Bm.view(Bz, G, N), Cm.view(Bz, G, N)
    group = torch.arange(H) // (H // G)
    Bh, Ch = Bm[:, group], Cm[:, group]                                  # (B, H, N)
    dt = F.softplus(dt + dt_bias).clamp(lo, hi)                          # (B, H)
    dA = torch.exp(-dt * A_log.exp())
    S = dA[..., None, None] * S + (dt[..., None] * Bh)[..., None] * x[:, :, None]
    y = (Ch[..., None] * S).sum(2) + Dp[:, None] * x                    # (B, H, P)
    g = y.reshape(Bz, Dn) * F.silu(z)
    if norm_w is not None:
        gg = g.view(Bz, -1, group_size)
        g = (gg / (gg.pow(2).mean(-1, keepdim=True) + eps).sqrt()).reshape(Bz, Dn) * norm_w
    return g, window[:, 1:], S


@pytest.mark.parametrize("B,H,P,N,G,K,norm_groups,bias,strong,limit", [
    (1, 4, 16, 16, 1, 4, 1, True, False, (0.0, float("inf"))),
    (3, 6, 5, 7, 3, 4, 2, True, True, (0.0, float("inf"))),       # odd P and N, 3 groups of 2 heads, 2 norm groups
    (2, 4, 8, 16, 2, 2, 0, False, False, (0.01, 0.3)),            # no norm, no bias, a dt limit, K = 2
    (3, 2, 64, 19, 1, 4, 1, True, True, (0.0, float("inf"))),     # mamba2-130m's head (64 columns in registers,
    (2, 2, 80, 16, 2, 4, 2, True, False, (0.0, float("inf"))),    # the state streamed), and 16 columns past them
    (5, 3, 16, 16, 1, 4, 1, True, True, (0.0, float("inf"))),     # 5 rows: the convolution's taps by column
])
def test_the_step_equals_its_math_in_float64(B, H, P, N, G, K, norm_groups, bias, strong, limit):
    g = torch.Generator().manual_seed(B * 100 + H * 10 + P)

    def r(*s, scale=1.0):
        return torch.randn(*s, generator=g) * scale

    Dn, C = H * P, H * P + 2 * G * N
    args = [r(B, 2 * Dn + 2 * G * N + H), r(B, K - 1, C), r(C, K, scale=0.5), r(C) if bias else None,
            r(H) + (3.0 if strong else -2.0), r(H).abs() + (4.0 if strong else 0.0), r(H), r(B, H, N, P),
            r(Dn).abs() + 0.5 if norm_groups else None, G, Dn // max(norm_groups, 1), 1e-5, *limit]
    before = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    out, inv, conv, S = fused_step.mamba2_step(*args[:11], args[11], args[12:])
    got, want = (out, conv, S), reference(*args)
    if norm_groups:                                # deferred: g * w, and the rows' 1 / rms apart
        deferred, inv2, _, _ = fused_step.mamba2_step(*args[:11], args[11], args[12:], defer=True)
        assert torch.equal(inv2, inv) and inv.shape == (B, norm_groups)
        scaled = (deferred.view(B, norm_groups, -1) * inv[..., None]).view(B, -1)
        assert (scaled.double() - want[0]).abs().max() <= 2e-6 * want[0].abs().max()
    for a, b in zip(got, want):
        assert a.dtype == torch.float32 and a.shape == b.shape
        assert (a.double() - b).abs().max() <= 2e-6 * b.abs().max() + 1e-30
    for a, b in zip(args, before):
        assert not isinstance(a, torch.Tensor) or torch.equal(a, b)      # the states passed in unchanged


@pytest.mark.parametrize("options", [{"n_groups": 2, "d_state": 16, "head_dim": 8},
                                     {"gated_norm": False, "dt_limit": (0.01, 0.2)}])
def test_the_layer_takes_it_and_agrees_with_its_own_step(monkeypatch, options):
    """Decoding steps of a Mamba-2 + attention model (batch 3): the kernel's logits within float32 rounding of
    the layer's PyTorch step and of a float64 copy; the kernel was called. (Norms with a bias: elsewhere the
    block's kernel runs the mixer's half, test_mamba2_fused_block.py.)"""
    m, m64 = models(d_model=64, n_layers=2, pattern="mamba2,softmax",
                    mixer_options={"mamba2": options}, mlp=True, norm_bias=True)
    assert assert_steps_agree(monkeypatch, fused_step, m, m64, 3) == 3
