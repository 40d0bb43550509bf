"""The fused (Gated) DeltaNet decoding step (ops.delta.fused_step, kernels/delta_step.c) against its math written
out in float64 here, and inside the layer against the layer's own PyTorch step: shared key heads, both l2 norms,
negative eigenvalues, a gate with and without bias, odd sizes, batch > 1, strong decays, states left alone."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from subquad.ops.delta import fused_step
from tests.ops.fused_harness import assert_steps_agree, models

pytestmark = pytest.mark.skipif(not fused_step.KERNEL.available(), reason="no C compiler: the kernel cannot be built")


def reference(q, k, v, conv_state, conv_w, b, a, A_log, dt_bias, gate, gate_bias, S, norm_w, neg, qk_eps, scale,
              norm_eps, gate_sigmoid=False):
    """The module doc's step, op by op in float64."""
    Bz, H, K, V = S.shape
    Hk = q.shape[-1] // K
    d = [None if t is None else t.double() for t in (q, k, v, conv_state, conv_w, b, a, A_log, dt_bias, gate,
                                                     gate_bias, S, norm_w)]
    q, k, v, conv_state, conv_w, b, a, A_log, dt_bias, gate, gate_bias, S, norm_w = d
    window = torch.cat([conv_state, torch.cat([q, k, v], -1)[:, None]], 1)
    q, k, v = F.silu((window * conv_w.t()[None]).sum(1)).split([Hk * K, Hk * K, H * V], -1)

    def l2(x):
        x = x.view(Bz, Hk, K)
        if qk_eps is None:
            return x / x.norm(dim=-1, keepdim=True).clamp_min(1e-12)
        return x / (x.pow(2).sum(-1, keepdim=True) + qk_eps).sqrt()

    q, k = (l2(t).repeat_interleave(H // Hk, 1) for t in (q, k))           # (B, H, K)
    v = v.view(Bz, H, V)
    beta = torch.sigmoid(b) * (2 if neg else 1)
    decay = torch.ones(Bz, H, dtype=torch.float64) if a is None else \
        torch.exp(-A_log.exp() * F.softplus(a + dt_bias))
    S = decay[..., None, None] * S
    u = beta[..., None] * (v - torch.einsum("bhk,bhkv->bhv", k, S))
    S = S + k[..., None] * u[..., None, :]
    o = scale * torch.einsum("bhk,bhkv->bhv", q, S)
    o = o / (o.pow(2).mean(-1, keepdim=True) + norm_eps).sqrt() * norm_w
    if gate is not None:
        act = torch.sigmoid if gate_sigmoid else F.silu
        o = o * act(gate.view(Bz, H, V) + (0 if gate_bias is None else gate_bias.view(H, V)))
    return o.reshape(Bz, H * V), window[:, 1:], S


@pytest.mark.parametrize("B,H,Hk,K,V,W,gated,gate_bias,neg,qk_eps,strong,sigmoid", [
    (1, 4, 4, 16, 16, 4, True, True, False, None, False, False),
    (3, 6, 2, 7, 5, 4, True, False, False, 1e-6, True, False),     # shared key heads, odd K and V, strong decays
    (2, 3, 3, 8, 12, 2, False, False, True, None, False, False),   # DeltaNet (no gate, no decay), 2 sigmoid, W = 2
    (2, 4, 2, 8, 8, 4, True, True, False, 1e-6, False, True),      # Qwen4-Exp's sigmoid output gate
])
def test_the_step_equals_its_math_in_float64(B, H, Hk, K, V, W, gated, gate_bias, neg, qk_eps, strong, sigmoid):
    g = torch.Generator().manual_seed(B * 100 + H * 10 + K)

    def r(*s, scale=1.0):
        return torch.randn(*s, generator=g) * scale

    C = 2 * Hk * K + H * V
    args = [r(B, Hk * K), r(B, Hk * K), r(B, H * V), r(B, W - 1, C), r(C, W, scale=0.5), r(B, H),
            r(B, H) + (3.0 if strong else 0.0) if gated else None, r(H).abs() + (2.0 if strong else 0.0) if gated
            else None, r(H) if gated else None, r(B, H * V) if gated else None, r(H * V) if gate_bias else None,
            r(B, H, K, V), r(V).abs() + 0.5, neg, qk_eps, K ** -0.5, 1e-6, sigmoid]
    before = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    got = fused_step.delta_step(*args)
    want = reference(*args)
    for a, b in zip(got, want):
        assert a.dtype == torch.float32 and a.shape == b.shape
        assert (a.double() - b).abs().max() <= 2e-6 * b.abs().max() + 1e-30
    for a, b in zip(args, before):
        assert not isinstance(a, torch.Tensor) or torch.equal(a, b)      # the states passed in unchanged


@pytest.mark.parametrize("pattern,options", [("gated_deltanet", {"n_key_heads": 2, "qk_eps": 1e-6}),
                                             ("gated_deltanet", {"output_gate": "sigmoid"}),
                                             ("deltanet", {"allow_neg_eigval": True})])
def test_the_layer_takes_it_and_agrees_with_its_own_step(monkeypatch, pattern, options):
    """Decoding steps of a DeltaNet + attention model (batch 3): the kernel's logits within float32 rounding of
    the layer's PyTorch step and of a float64 copy; the kernel was called."""
    m, m64 = models(d_model=64, n_layers=2, n_heads=4, pattern=f"{pattern},softmax",
                    mixer_options={pattern: options})
    assert assert_steps_agree(monkeypatch, fused_step, m, m64, 3) == 3
