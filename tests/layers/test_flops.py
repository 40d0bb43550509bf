"""FLOP counts per token: every pattern mixer states one, and two configurations counted by hand agree."""

import pytest

from subquad.layers import MIXERS, build_mixer
from subquad.models import LanguageModel, ModelConfig


@pytest.mark.parametrize("name", sorted(MIXERS))
def test_every_mixer_counts_its_flops(name):
    layer = build_mixer(name, 64, 2)
    f = layer.flops_per_token(128)
    assert f > 2 * 64 * 64                     # at least one projection's worth
    assert layer.flops_per_token(1024) >= f    # never cheaper per token at a longer length


def test_softmax_attention_by_hand():
    # 4 projections of 64 x 64 (2 FLOPs per weight) + causal q k^T and p v: 2 heads of 32, (T + 1) / 2 keys
    layer = build_mixer("softmax", 64, 2)
    assert layer.flops_per_token(127) == 2 * 4 * 64 * 64 + 2 * 2 * 2 * 32 * 64
    assert build_mixer("swa", 64, 2, window=16).flops_per_token(127) == 2 * 4 * 64 * 64 + 2 * 2 * 2 * 32 * 17


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
