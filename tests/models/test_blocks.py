"""The four residual schemes of ``models.lm``: the config picks the block class, every class holds the same
parameter names (the names the checkpoint formats map), and each computes its scheme."""

from __future__ import annotations

import pytest
import torch

from subquad.models import LanguageModel, ModelConfig
from subquad.models.lm import ParallelBlock, PostNormBlock, PreNormBlock, ScaledResidualBlock


def _model(**over):
    torch.manual_seed(0)
    cfg = ModelConfig(**{"vocab_size": 32, "d_model": 16, "n_layers": 2, "n_heads": 2, "pattern": "softmax,mamba2",
                         "mixer_options": {"mamba2": {"head_dim": 8, "d_state": 4}}, **over})
    return LanguageModel(cfg).double()


def test_the_config_picks_the_block_class_and_the_names_stay():
    pre, post = _model(), _model(post_norm=["softmax"])
    scaled = _model(scaled_residual={"softmax": [1.5, 0.5], "mlp": [1.0, 2.0]})
    assert [type(b) for b in pre.blocks] == [PreNormBlock, PreNormBlock]
    assert [type(b) for b in post.blocks] == [PostNormBlock, PreNormBlock]
    assert [type(b) for b in scaled.blocks] == [ScaledResidualBlock, ScaledResidualBlock]
    assert scaled.blocks[0].mixer_factors == (1.5, 0.5) and scaled.blocks[1].mixer_factors == (1.0, 1.0)
    assert scaled.blocks[1].mlp_factors == (1.0, 2.0)
    keys = list(pre.state_dict())
    assert list(post.state_dict()) == keys and list(scaled.state_dict()) == keys


@pytest.mark.parametrize("scheme", ["pre", "post", "scaled", "parallel"])
def test_each_block_computes_its_scheme(scheme):
    over = {"pre": {}, "post": {"post_norm": ["softmax"]},
            "scaled": {"scaled_residual": {"softmax": [1.5, 0.5], "mlp": [0.75, 2.0]}},
            "parallel": {"parallel": {"softmax": "mamba2"}}}[scheme]
    b = _model(**over).blocks[0]
    h = torch.randn(2, 7, 16, dtype=torch.float64)
    got, _ = b(h)
    with torch.no_grad():
        if scheme == "pre":
            h1 = h + b.mixer(b.norm1(h))[0]
            want = h1 + b.mlp(b.norm2(h1))
        elif scheme == "parallel":
            x = b.norm1(h)
            h1 = h + b.mixer(x)[0] + b.beside(x)[0]
            want = h1 + b.mlp(b.norm2(h1))
        elif scheme == "post":
            h1 = h + b.norm1(b.mixer(h)[0])
            want = h1 + b.norm2(b.mlp(h1))
        else:
            x = b.norm1(h)
            h1 = 1.5 * x + 0.5 * b.mixer(x)[0]
            x = b.norm2(h1)
            want = 0.75 * x + 2.0 * b.mlp(x)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_a_parallel_block_decodes_packs_and_refuses_what_it_cannot_hold():
    """Mamba-2 beside attention (Falcon-H1's block): one state dict holding both mixers' entries; prefill then
    token-by-token decoding, and a packed row, equal the full forward."""
    from tests.models.test_hf import assert_packed_equals_separate, assert_prefill_then_decode_equals_forward

    model = _model(pattern="mamba2", parallel={"mamba2": "softmax"}).eval()
    assert [type(b) for b in model.blocks] == [ParallelBlock, ParallelBlock]
    assert set(model.empty_state(2)[0]) == {"ssm", "conv", "kv"}
    ids = torch.randint(0, 32, (2, 25), generator=torch.Generator().manual_seed(3))
    assert_prefill_then_decode_equals_forward(model, ids[:1, :20])
    assert_packed_equals_separate(model, ids)
    n = sum(p.numel() for p in model.parameters())
    assert n > sum(p.numel() for p in _model(pattern="mamba2").parameters())      # the attention beside, its own
    for bad in ({"mamba2": "mamba2"}, {"mamba2": "nope"}, {"softmax": 1}):
        with pytest.raises(ValueError, match="parallel must be"):
            _model(parallel=bad)
    with pytest.raises(ValueError, match="parallel blocks are pre-norm"):
        _model(parallel={"softmax": "mamba2"}, post_norm=["softmax"])
