"""The name tables of ``models.hf.common.Format``: patterns in order, a wildcard for the rest of a name, one
checkpoint tensor per expert, and refusals for a name no pattern matches or two names mapped to one."""

from __future__ import annotations

import pytest

from subquad.models import ModelConfig
from subquad.models.hf.common import Format, experts, swiglu


class Toy(Format):
    model_type = "toy"
    layers = {"mamba": {"mixer.conv.{p}": "mamba.conv1d.{p}",
                        "mixer.{p}": "mamba.{p}"},
              "softmax": {"norm1.weight": "post_attention_layernorm.weight",
                          "mixer.{p}": "self_attn.{p}"},
              "*": {"norm1.weight": "input_layernorm.weight", **swiglu("mlp.", "mlp."),
                    **experts("mlp.", "feed_forward.", "router.weight")}}


CFG = ModelConfig(vocab_size=8, d_model=4, n_layers=2, n_heads=1, pattern="mamba,softmax")


def test_names_follow_the_tables():
    shapes = {"embed.weight": (8, 4), "head.weight": (8, 4), "blocks.0.norm1.weight": (4,),
              "blocks.0.mixer.conv.bias": (8,), "blocks.0.mixer.A_log": (8, 2), "blocks.1.norm1.weight": (4,),
              "blocks.1.mixer.q_proj.weight": (4, 4), "blocks.0.mlp.w_gate.weight": (6, 4),
              "blocks.1.mlp.router.weight": (3, 4), "blocks.1.mlp.w_up": (3, 6, 4)}
    assert Toy.names(CFG, shapes) == {
        "embed.weight": "model.embed_tokens.weight", "head.weight": "lm_head.weight",
        "blocks.0.norm1.weight": "model.layers.0.input_layernorm.weight",          # "*" after the mixer's table
        "blocks.0.mixer.conv.bias": "model.layers.0.mamba.conv1d.bias",             # the first match wins
        "blocks.0.mixer.A_log": "model.layers.0.mamba.A_log",
        "blocks.1.norm1.weight": "model.layers.1.post_attention_layernorm.weight",  # the mixer's table first
        "blocks.1.mixer.q_proj.weight": "model.layers.1.self_attn.q_proj.weight",
        "blocks.0.mlp.w_gate.weight": "model.layers.0.mlp.gate_proj.weight",
        "blocks.1.mlp.router.weight": "model.layers.1.feed_forward.router.weight",
        "blocks.1.mlp.w_up": tuple(f"model.layers.1.feed_forward.experts.{e}.up_proj.weight" for e in range(3))}


def test_names_refuse_what_no_pattern_holds_or_two_names_share():
    with pytest.raises(ValueError, match="no checkpoint name for subquad's pos_embed.weight"):
        Toy.names(CFG, {"pos_embed.weight": (16, 4)})
    with pytest.raises(ValueError, match="no checkpoint name for subquad's blocks.1.mlp.shared.w_up.weight"):
        Toy.names(CFG, {"blocks.1.mlp.shared.w_up.weight": (6, 4)})

    class Twice(Toy):
        top = {"embed.weight": "model.embed_tokens.weight", "head.weight": "model.embed_tokens.weight"}

    with pytest.raises(ValueError, match="several subquad tensors map to one checkpoint name"):
        Twice.names(CFG, {"embed.weight": (8, 4), "head.weight": (8, 4)})


def test_the_nearest_type_lists_only_fields_that_differ():
    """A model no Hugging Face type holds is refused naming the nearest type and what it would need: not a pattern
    that spells the same layers ('gated_deltanet,gated_deltanet' for two gated_deltanet layers), nor a KV head
    count of None, which is the head count (a new user's trial)."""
    from subquad.models import LanguageModel, ModelConfig
    from subquad.models.hf.saver import _format_for

    model = LanguageModel(ModelConfig(vocab_size=64, d_model=64, n_layers=2, n_heads=2, pattern="gated_deltanet"))
    with pytest.raises(ValueError, match="nearest: qwen3_5_text, which needs gated_deltanet.open_gate") as e:
        _format_for(model, None)
    assert "pattern=" not in str(e.value) and "n_kv_heads=" not in str(e.value)
