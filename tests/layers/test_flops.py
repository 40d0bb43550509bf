"""FLOP counts per token, exactly: every mixer's ``flops_per_token`` equals the matmuls its projections run
(measured with torch's FlopCounterMode), plus its short convolutions and its sequence mixing, both counted by
hand here from the layer's configuration.

The convention (``Mixer.flops_per_token``): 2 FLOPs per multiply-add; elementwise work (activations, gates,
norms, decays) is not counted; the mixing is what the recurrent or exact form must compute per token."""

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from subquad.layers import MIXERS, build_mixer
from subquad.models import LanguageModel, ModelConfig

D, H = 64, 2                  # every mixer below: build_mixer(name, 64, 2), head dim 32 unless its options say


def causal(T):
    """Keys a causal query sees, on average over T queries: (1 + ... + T) / T."""
    return (T + 1) / 2


def windowed(T, W):
    """Keys seen with a window W (a query sees itself and the W before it), on average over T queries."""
    return sum(min(t + 1, W + 1) for t in range(T)) / T


def indexed(T, budget=16, c=4, Hi=2, D=32):
    """QSA (index_head_dim 32, qsa's other defaults): the query at p attends to the budget / c best of its
    (p + 1) // c complete blocks,
    every token of them, and the p + 1 - c ((p + 1) // c) tokens after them; its indexer scores those blocks."""
    total = 0
    for p in range(T):
        complete = (p + 1) // c
        attended = min(budget // c, complete) * c + (p + 1) % c
        total += H * (2 * 32 + 2 * 32) * attended + 2 * Hi * D * complete
    return total / T


# name -> (build options, the mixing's FLOPs per token at length T), counted from the configuration:
# a state write k v^T and a read q S cost 2 K V each per head; the delta rule's prediction S^T k another 2 K V.
MIX = {
    "softmax": ({}, lambda T: H * (2 * 32 + 2 * 32) * causal(T)),               # q k^T over K, p v over V
    "swa": ({"window": 16}, lambda T: H * (2 * 32 + 2 * 32) * windowed(T, 16)),
    "mla": ({}, lambda T: H * (2 * (32 + 16) + 2 * 32) * causal(T)),
    "qsa": ({"index_head_dim": 32}, indexed),           # K = nope 32 + rope 16, V 32
    "linear": ({}, lambda T: H * 4 * 32 * (32 + 1)),                           # F = K = 32; z is a column of ones
    "performer": ({}, lambda T: H * (4 * 64 * (32 + 1) + 2 * (2 * 32 * 64))),   # F = 64 features: q, k projected
    "taylor": ({}, lambda T: H * 4 * (1 + 16 + 16 * 16) * (32 + 1)),           # F = 1 + d + d^2 on qk_dim 16
    "retention": ({}, lambda T: H * 4 * 32 * 64),                             # K 32, V = 2 K
    "gla": ({}, lambda T: H * 4 * 16 * 32),                                   # K = D / 2 / H, V = D / H
    "lightning": ({}, lambda T: H * 4 * 32 * 32),
    "deltanet": ({}, lambda T: H * 6 * 32 * 32),
    "gated_deltanet": ({}, lambda T: H * 6 * 32 * 32),
    "kda": ({}, lambda T: H * 6 * 32 * 32),
    "mamba": ({}, lambda T: 4 * 128 * 16),                                     # d_inner 128 channels, N 16 each
    "mamba2": ({}, lambda T: 4 * 16 * 32 * 4),                                 # 4 heads of P 32, N 16
    "rglru": ({}, lambda T: 2 * 2 * 64 * 32 + 2 * 64),      # two block-diagonal gates (2 x 32 x 32), a h + u per channel
    "gated_conv": ({}, lambda T: 2 * 64),
    "mlstm": ({}, lambda T: H * 4 * 16 * (32 + 1)),                            # K = D / 2 / H, V = D / H; n a column
    # the decay (K V), a^T S (2 K V), its rank-one correction b (a^T S)^T (2 K V), the write k v^T and the read
    # r S (2 K V each) per head; plus the value-residual LoRA (64 -> 32 -> 64), which a layer alone - the first
    # RWKV-7 layer of its model - skips but flops_per_token counts, as for every later layer
    "rwkv7": ({}, lambda T: H * 9 * 32 * 32 + 2 * (2 * 64 * 32)),
    # E K and F V project T keys and values to k rows (k D each), then q K'^T and p V' over k keys (k D each)
    "linformer": ({"max_len": 64, "k": 16}, lambda T: 8 * 16 * 64),                   # b * x and c * conv(.): one multiply per channel each
}
VARIANTS = {                  # options that change the count: GQA, a short convolution, groups, no normaliser
    "softmax-gqa": ("softmax", {"n_kv_heads": 1}, MIX["softmax"][1]),
    "linear-conv-unnormalised": ("linear", {"conv_size": 4, "normalize": False}, lambda T: H * 4 * 32 * 32),
    "gla-conv": ("gla", {"conv_size": 3}, MIX["gla"][1]),
    "mamba2-groups": ("mamba2", {"n_groups": 2}, MIX["mamba2"][1]),
}
CASES = {name: (name, opts, mix) for name, (opts, mix) in MIX.items()} | VARIANTS


def projection_flops(layer, T):
    """FLOPs per token of the nn.Linear modules over one forward of (1, T, D), as FlopCounterMode counts the
    matmuls they run. (One row of T <= D tokens: with more, Mamba-2 folds its norm's weight into out_proj's
    and calls F.linear outside the module, where the counter cannot attribute it.)"""
    assert T <= D
    linears = {f"{type(layer).__name__}.{n}" for n, m in layer.named_modules() if isinstance(m, nn.Linear)}
    with FlopCounterMode(display=False) as counter:
        layer(torch.randn(1, T, D))
    return sum(sum(ops.values()) for name, ops in counter.get_flop_counts().items() if name in linears) / T


def conv_flops(layer):
    """A short causal convolution: one multiply-add per channel and tap."""
    return sum(2 * m.channels * m.kernel_size for m in layer.modules() if type(m).__name__ == "ShortConv")


def test_every_mixer_is_counted_here():
    assert set(MIX) == set(MIXERS)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("T", [1, 17, 37])
def test_every_mixer_counts_its_flops_exactly(case, T):
    name, options, mix = CASES[case]
    torch.manual_seed(0)
    layer = build_mixer(name, D, H, **options)
    want = projection_flops(layer, T) + conv_flops(layer) + mix(T)
    assert layer.flops_per_token(T) == pytest.approx(want, rel=1e-12), case


def test_long_lengths_follow_the_formulas():
    """At lengths not run: attention grows with T (a window's stops growing), the fixed-state mixers do not."""
    for T in (1024, 4096):
        for name in ("softmax", "swa", "mla", "gla", "mamba2"):
            layer = build_mixer(name, D, H, **MIX[name][0])
            fixed = layer.flops_per_token(1) - MIX[name][1](1)
            assert layer.flops_per_token(T) == pytest.approx(fixed + MIX[name][1](T), rel=1e-12), (name, T)


def test_softmax_attention_by_hand():
    # 4 projections of 64 x 64 (2 FLOPs per weight) + causal q k^T and p v: 2 heads of 32, (T + 1) / 2 keys;
    # a window of 16 at T = 127: (17 * 18 / 2 + 110 * 17) / 127 keys
    layer = build_mixer("softmax", 64, 2)
    assert layer.flops_per_token(127) == 2 * 4 * 64 * 64 + 2 * 2 * 2 * 32 * 64
    swa = build_mixer("swa", 64, 2, window=16)
    assert swa.flops_per_token(127) == pytest.approx(2 * 4 * 64 * 64 + 2 * 2 * 2 * 32 * (153 + 1870) / 127)


def test_mamba2_model_by_hand():
    # Mamba-2, d_model 64, expand 2, head_dim 16 (8 heads), d_state 16, 1 group, conv 4:
    # in_proj 64 x (2*128 + 2*16 + 8) = 64 x 296, conv (128 + 32) x 4, out_proj 128 x 64,
    # SSD: 4 * 8 heads * 16 states * 16 head dims; one layer, no MLP, head 64 x 100; training = 3x
    cfg = ModelConfig(vocab_size=100, d_model=64, n_layers=1, n_heads=4, pattern="mamba2", mlp=False,
                      mixer_options={"mamba2": {"head_dim": 16, "d_state": 16}})
    model = LanguageModel(cfg)
    fwd = 2 * (64 * 296 + 160 * 4 + 128 * 64) + 4 * 8 * 16 * 16 + 2 * 64 * 100
    assert model.flops_per_token(256, training=False) == fwd
    assert model.flops_per_token(256) == 3 * fwd
