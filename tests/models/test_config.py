import pytest

from subquad.models import ModelConfig, jamba, micro, parse_pattern, preset, small


def test_patterns_expand():
    assert parse_pattern("softmax", 3) == ["softmax"] * 3
    assert parse_pattern("mamba2*3,softmax,mamba2*4", 8) == ["mamba2"] * 3 + ["softmax"] + ["mamba2"] * 4
    assert parse_pattern(" linear , swa ", 2) == ["linear", "swa"]
    assert parse_pattern("gla*2", 2) == ["gla", "gla"]


@pytest.mark.parametrize("pattern, n, match", [
    ("mamba9", 2, "unknown mixer 'mamba9'"),
    ("softmax*3,linear", 3, "describes 4 layers but n_layers=3"),
    ("softmax*0", 1, "positive integer"),
    ("softmax*x", 1, "positive integer"),
    ("softmax,,linear", 3, "empty item"),
    ("", 1, "non-empty"),
])
def test_bad_patterns_are_refused_clearly(pattern, n, match):
    with pytest.raises(ValueError, match=match):
        parse_pattern(pattern, n)


def test_presets_and_config_checks():
    assert micro().d_model // micro().n_heads == 32 and micro().context_length == 256
    assert small().n_layers == 6
    assert jamba().layers.count("softmax") == 1 and len(jamba().layers) == 8
    assert preset("micro", pattern="linear").layers == ["linear"] * 4
    with pytest.raises(ValueError, match="unknown preset"):
        preset("huge")
    with pytest.raises(ValueError, match="must divide"):
        ModelConfig(d_model=100, n_heads=3)
    with pytest.raises(ValueError, match="unknown ModelConfig fields"):
        ModelConfig.from_dict({"d_model": 64, "colour": "red"})
    cfg = micro(pattern="swa", mixer_options={"swa": {"window": 8}})
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg


def test_mlp_kind_and_mlp_layers():
    """relu2: an ungated squared-ReLU MLP; mlp_layers: the layers that have one, the rest the mixer alone."""
    import torch

    from subquad import LanguageModel

    cfg = ModelConfig(vocab_size=32, d_model=16, n_layers=3, n_heads=2, mlp_size=24, mlp_kind="relu2", mlp_layers=[2, 0])
    assert cfg.mlp_layers == [0, 2] and ModelConfig.from_dict(cfg.to_dict()) == cfg
    model = LanguageModel(cfg)
    assert [b.mlp is None and b.norm2 is None for b in model.blocks] == [False, True, False]
    mlp, x = model.blocks[0].mlp, torch.randn(5, 16)
    torch.testing.assert_close(mlp(x), torch.relu(x @ mlp.w_up.weight.T).square() @ mlp.w_down.weight.T)
    for bad, match in (({"mlp_kind": "gelu"}, "mlp_kind"), ({"mlp_layers": [3]}, "mlp_layers"),
                       ({"mlp_kind": "geglu", "moe": {"experts": 2}}, "moe: its experts are MLPs of mlp_kind"),
                       ({"mlp_kind": "relu2", "mlp_layers": [0], "moe": {"experts": 2}}, "must be among mlp_layers")):
        with pytest.raises(ValueError, match=match):
            ModelConfig(vocab_size=32, d_model=16, n_layers=3, n_heads=2, **bad)
