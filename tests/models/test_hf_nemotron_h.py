"""Hugging Face NVIDIA Nemotron-H (``nemotron_h``): Mamba-2, attention without positions and ungated
squared-ReLU MLPs as separate layers chosen by a pattern string - each mixer layer a subquad block, the MLP
layer after it that block's MLP: tiny random transformers models give transformers' logits and greedy
tokens, come back through save_pretrained, and patterns subquad cannot hold are refused by name."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")   # the `hf` extra installs it (make test requires it); the library never does

from subquad.models.hf import from_pretrained, save_pretrained  # noqa: E402
from tests.models.test_hf import (  # noqa: E402
    assert_logits_equal, assert_packed_equals_separate, assert_prefill_then_decode_equals_forward, assert_round_trip,
    greedy_agreement)

V = 96
PATTERN = "M-M*-MM-"        # a Mamba layer without an MLP after it, as Nemotron Nano 2's "MM"


def _hf(tmp_path, dtype=torch.float32, **over):
    """A tiny random model: 8 layers of the pattern, attention with a head_dim of its own (4 x 24 != 64)."""
    torch.manual_seed(0)
    cfg = transformers.NemotronHConfig(**{
        "vocab_size": V, "hidden_size": 64, "intermediate_size": 80, "hybrid_override_pattern": PATTERN,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 24, "mamba_num_heads": 8,
        "mamba_head_dim": 16, "ssm_state_size": 16, "n_groups": 2, "chunk_size": 16,
        "bos_token_id": None, "eos_token_id": None, "pad_token_id": None, **over})
    model = transformers.NemotronHForCausalLM(cfg).to(dtype).eval()
    with torch.no_grad():                                  # non-trivial norms, D, dt and conv biases
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", "norm_f.weight", ".D", "conv1d.bias", "dt_bias")):
                p.add_(torch.randn_like(p) * 0.3)
    folder = tmp_path / "nemotron_h"
    model.save_pretrained(folder)
    return model, folder


def _ids(T=50):
    return torch.randint(0, V, (2, T), generator=torch.Generator().manual_seed(1))


def test_the_loaded_structure(tmp_path):
    _, folder = _hf(tmp_path)
    ours, _ = from_pretrained(folder)
    assert ours.config.layers == ["mamba2", "mamba2", "softmax", "mamba2", "mamba2"]
    assert ours.config.mlp_layers == [0, 2, 4] and ours.config.mlp_kind == "relu2"
    assert [b.mlp is None for b in ours.blocks] == [False, True, False, True, False]
    attn = ours.blocks[2].mixer
    assert attn.head_dim == 24 and not attn.rotary and ours.blocks[0].mlp.w_up.weight.shape == (80, 64)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.float64, 1e-6)])
def test_logits_equal_transformers(tmp_path, dtype, tol):
    hf, folder = _hf(tmp_path, dtype)
    ours, _ = from_pretrained(folder, dtype=dtype)
    assert_logits_equal(ours, hf, _ids(), dtype, tol)


def test_prefill_decode_packed_and_greedy_equal_transformers(tmp_path):
    hf, folder = _hf(tmp_path, torch.float64)
    ours, _ = from_pretrained(folder, dtype=torch.float64)
    ids = _ids()[:1, :20]
    assert_prefill_then_decode_equals_forward(ours, ids)
    assert_packed_equals_separate(ours, _ids())
    assert greedy_agreement(ours, hf, ids, lambda x: hf(x).logits) == 32


@pytest.mark.parametrize("over", [{}, {"tie_word_embeddings": True, "hybrid_override_pattern": "M*M"}],
                         ids=["mlps", "no-mlps-tie-ignored"])     # transformers' Nemotron-H reads lm_head anyway
def test_save_pretrained_round_trip_loads_in_transformers(tmp_path, over):
    hf, folder = _hf(tmp_path, **over)
    ours, _ = from_pretrained(folder)
    assert ours.config.mlp == ("hybrid_override_pattern" not in over)
    assert_round_trip(hf, ours, transformers.NemotronHForCausalLM, tmp_path / "back", _ids(), "nemotron_h")
    c = json.loads((tmp_path / "back" / "config.json").read_text())
    assert c["hybrid_override_pattern"] == over.get("hybrid_override_pattern", PATTERN)


def test_a_model_built_here_saves_as_nemotron_h_and_others_do_not(tmp_path):
    """relu2 MLPs at some layers: only nemotron_h holds them (granitemoehybrid's structure otherwise); its tied
    head is written out."""
    from subquad import LanguageModel, ModelConfig

    cfg = ModelConfig(vocab_size=V, d_model=32, n_layers=3, n_heads=2, pattern="mamba2,softmax,mamba2",
                      mlp_size=48, mlp_kind="relu2", mlp_layers=[1], norm_eps=1e-5,
                      mixer_options={"softmax": {"rotary": False}, "mamba2": {"norm_eps": 1e-5, "n_groups": 2}})
    model = LanguageModel(cfg).eval()
    save_pretrained(model, tmp_path / "mine")
    c = json.loads((tmp_path / "mine" / "config.json").read_text())
    assert c["model_type"] == "nemotron_h" and c["hybrid_override_pattern"] == "M*-M"
    theirs = transformers.NemotronHForCausalLM.from_pretrained(tmp_path / "mine").eval()
    with torch.no_grad():
        torch.testing.assert_close(theirs(_ids()).logits, model(_ids()), rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="cannot be written as model_type 'granitemoehybrid'"):
        save_pretrained(model, tmp_path / "g", model_type="granitemoehybrid")


def test_refusals_name_the_problem(tmp_path):
    from safetensors.torch import load_file, save_file

    _, folder = _hf(tmp_path)
    cfg = json.loads((folder / "config.json").read_text())
    cfg.pop("layers_block_type")
    for field, value in (("mlp_hidden_act", "silu"), ("mamba_hidden_act", "gelu"), ("use_bias", True),
                         ("attention_bias", True), ("sliding_window", 16), ("mamba_num_heads", 5)):
        (folder / "config.json").write_text(json.dumps({**cfg, "hybrid_override_pattern": PATTERN, field: value}))
        with pytest.raises(ValueError, match=field):
            from_pretrained(folder)
    for pattern, why in (("M--M*-MM", "MLP layer 2 does not follow"), ("ME-M*-MM", "layer 1 is 'moe'"),
                         ("M-M*-MX-", "only M")):
        (folder / "config.json").write_text(json.dumps({**cfg, "hybrid_override_pattern": pattern}))
        with pytest.raises(ValueError, match=f"hybrid_override_pattern.*{why}"):
            from_pretrained(folder)
    (folder / "config.json").write_text(json.dumps({**cfg, "hybrid_override_pattern": PATTERN}))
    w = load_file(str(folder / "model.safetensors"))
    del w["backbone.layers.7.mixer.up_proj.weight"]
    save_file(w, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match="missing.*backbone.layers.7.mixer.up_proj"):
        from_pretrained(folder)
