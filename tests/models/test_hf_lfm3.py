"""Hugging Face Liquid LFM3 (``lfm3``): gated short convolutions, sliding-window and full attention with per-head
q/k norms and a sigmoid gate per head, sandwich norms, rotary per attention kind (proportional on the full
attention layers) - the parity checks are rows of test_hf_parity.py; here what is the type's alone."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")   # the `hf` extra installs it (make test requires it); the library never does

from subquad.models.hf import from_pretrained, save_pretrained  # noqa: E402
from tests.models.hf_harness import assert_refused  # noqa: E402

V = 96
TYPES = ["conv", "sliding_attention", "full_attention", "conv", "sliding_attention"]
# the other options off: no sandwich norms, no attention gate, conv biases, an untied head; rotary "default" on
# the full attention layers, another window
PLAIN = {"use_sandwich_norm": False, "use_attention_gate": False, "conv_bias": True, "tie_word_embeddings": False,
         "sliding_window": 13, "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                                                     "full_attention": {"rope_type": "default", "rope_theta": 5e5}}}


def _hf(tmp_path, dtype=torch.float32, **over):
    """A tiny random model: 5 layers (conv, sliding, full, conv, sliding), a window of 8 keys (the tests run 40 and
    50 tokens), heads of 16 dims (not hidden / heads = 8) in 2 kv groups, the released rotary (default on the
    sliding layers, proportional with factor 0.5 on the full one), sandwich norms and the attention gate."""
    torch.manual_seed(0)
    cfg = transformers.Lfm3Config(**{
        "vocab_size": V, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": len(TYPES),
        "layer_types": TYPES, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "sliding_window": 8, "conv_L_cache": 3, "bos_token_id": None, "eos_token_id": None, "pad_token_id": None,
        **over})
    model = transformers.Lfm3ForCausalLM(cfg).to(dtype).eval()
    with torch.no_grad():                     # non-trivial norms and biases
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                p.add_(torch.randn_like(p) * 0.3)
    folder = tmp_path / "lfm3"
    model.save_pretrained(folder)
    return model, folder


LOGITS = ROUND_TRIP = {"released": {}, "plain": PLAIN}


def _loaded(ours, over):
    """The logits cases of test_hf_parity.py: the blocks and attention options each config asks for."""
    assert ours.config.layers == ["gated_conv", "swa", "softmax", "gated_conv", "swa"]
    assert ours.config.sandwich_norm == (not over)
    swa, full = ours.blocks[1].mixer, ours.blocks[2].mixer
    assert (swa.g_proj is None) == bool(over) and swa.window == (12 if over else 7)
    assert full.rotary_dim == (16 if over else 8)


def _saved(hf, ours, c, over, folder):
    """The round trip's folder (test_hf_parity.py) loads in transformers with nothing missing or unexpected, its
    rotary written back as the folder had it."""
    _, info = transformers.Lfm3ForCausalLM.from_pretrained(folder, output_loading_info=True)
    assert not any(info.values())
    assert c["rope_parameters"] == hf.config.rope_parameters and c["sliding_window"] == hf.config.sliding_window


def test_proportional_rotary_reorders_each_heads_dims(tmp_path):
    """The full attention layer's q rows come in heads of [0, 4) + [8, 12) + [4, 8) + [12, 16), its rotary base
    theta^(8 / 16); the sliding layers' are as the file holds them."""
    hf, folder = _hf(tmp_path)
    ours, _ = from_pretrained(folder)
    full, swa = ours.blocks[2].mixer, ours.blocks[1].mixer
    order = torch.cat([torch.arange(4), torch.arange(8, 12), torch.arange(4, 8), torch.arange(12, 16)])
    want = hf.model.layers[2].self_attn.q_proj.weight.unflatten(0, (4, 16))[:, order].flatten(0, 1)
    torch.testing.assert_close(full.q_proj.weight, want, rtol=0, atol=0)
    torch.testing.assert_close(full.k_norm.weight, hf.model.layers[2].self_attn.k_norm.weight[order], rtol=0, atol=0)
    assert full.rotary_base == pytest.approx(1e6 ** 0.5, rel=1e-12)
    torch.testing.assert_close(swa.q_proj.weight, hf.model.layers[1].self_attn.q_proj.weight, rtol=0, atol=0)


def test_a_model_built_here_saves_as_lfm3_and_lfm2_refuses_it(tmp_path):
    from subquad import LanguageModel, ModelConfig

    attn = {"head_dim": 8, "qk_norm": "head", "qk_norm_eps": 1e-5, "head_gate": True}
    cfg = ModelConfig(vocab_size=V, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, pattern="gated_conv,swa,softmax",
                      mlp_size=48, norm_eps=1e-5, sandwich_norm=True,
                      mixer_options={"gated_conv": {"conv_size": 3}, "swa": {**attn, "window": 5}, "softmax": attn})
    model = LanguageModel(cfg).eval()
    save_pretrained(model, tmp_path / "mine")
    c = json.loads((tmp_path / "mine" / "config.json").read_text())
    assert c["model_type"] == "lfm3" and c["sliding_window"] == 6 and c["use_sandwich_norm"]
    theirs = transformers.Lfm3ForCausalLM.from_pretrained(tmp_path / "mine").eval()
    ids = torch.randint(0, V, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(theirs(ids).logits, model(ids), rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="cannot be written as model_type 'lfm2'"):
        save_pretrained(model, tmp_path / "m", model_type="lfm2")


def test_refusals_name_the_problem(tmp_path):
    _, folder = _hf(tmp_path)
    cfg = json.loads((folder / "config.json").read_text())
    rope = cfg["rope_parameters"]
    for field, value in (("attention_bias", True), ("layer_types", ["conv", "mamba"] + TYPES[2:]),
                         ("num_hidden_layers", 4), ("conv_L_cache", 0), ("sliding_window", 0),
                         ("rope_parameters.full_attention.rope_type",
                          {**rope, "full_attention": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 2.0}}),
                         ("rope_parameters.full_attention.factor",
                          {**rope, "full_attention": {**rope["full_attention"], "factor": 2.0}}),
                         ("rope_parameters.sliding_attention", {"full_attention": rope["full_attention"]})):
        assert_refused(folder, field, {**cfg, field.split(".")[0]: value})
