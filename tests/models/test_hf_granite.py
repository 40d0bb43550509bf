"""Hugging Face IBM Granite 4 (``granitemoehybrid``): Mamba-2 and attention without positions (or rotary),
a mixture of experts beside an ungated shared expert, and Granite's four multipliers folded into the
weights - tiny random transformers models give transformers' logits, greedy tokens and router loss,
come back through save_pretrained, and bad folders are refused by name."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")   # the `hf` extra installs it (make test requires it); the library never does

from subquad.models.hf import from_pretrained, save_pretrained  # noqa: E402
from tests.models.test_hf import (  # noqa: E402
    assert_logits_equal, assert_packed_equals_separate, assert_prefill_then_decode_equals_forward, greedy_agreement)

V = 96
# multipliers far from 1 (the released models': 12, 0.22, 1/128 and 8 at their widths), so a missed one shows
MULT = {"embedding_multiplier": 3.0, "residual_multiplier": 0.5, "attention_multiplier": 0.1, "logits_scaling": 2.0}


def _hf(tmp_path, dtype=torch.float32, **over):
    """A tiny random model: Mamba-2, attention, Mamba-2 (the released configs' legacy layer names), MoE layers
    of 4 experts beside a shared expert."""
    torch.manual_seed(0)
    cfg = transformers.GraniteMoeHybridConfig(**{
        "vocab_size": V, "hidden_size": 64, "intermediate_size": 40, "shared_intermediate_size": 48,
        "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
        "layer_types": ["mamba", "attention", "mamba"], "num_local_experts": 4, "num_experts_per_tok": 2,
        "mamba_n_heads": 8, "mamba_d_state": 16, "mamba_n_groups": 2, "mamba_chunk_size": 16,
        "position_embedding_type": "nope", "bos_token_id": None, "eos_token_id": None, "pad_token_id": None,
        **MULT, **over})
    cfg._experts_implementation = "eager"                  # its grouped-matmul default has no float64
    model = transformers.GraniteMoeHybridForCausalLM(cfg).to(dtype).eval()
    with torch.no_grad():                                  # non-trivial norms, D, dt and conv biases
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", ".D", "conv1d.bias", "dt_bias")):
                p.add_(torch.randn_like(p) * 0.3)
    folder = tmp_path / "granite"
    model.save_pretrained(folder)
    return model, folder


def _ids(T=50):
    return torch.randint(0, V, (2, T), generator=torch.Generator().manual_seed(1))


def test_the_loaded_structure(tmp_path):
    _, folder = _hf(tmp_path)
    ours, _ = from_pretrained(folder)
    assert ours.config.layers == ["mamba2", "softmax", "mamba2"] and ours.config.moe_layers == [0, 1, 2]
    mlp = ours.blocks[0].mlp
    assert mlp.w_gate.shape == (4, 40, 64) and mlp.shared.w_up.weight.shape == (48, 64) and mlp.shared_gate is None
    assert not ours.blocks[1].mixer.rotary


@pytest.mark.parametrize("over", [{}, {"position_embedding_type": "rope", "tie_word_embeddings": True},
                                  {"num_local_experts": 0}], ids=["moe-nope", "rope-tied", "dense"])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.float64, 1e-6)])
def test_logits_equal_transformers(tmp_path, over, dtype, tol):
    hf, folder = _hf(tmp_path, dtype, **over)
    ours, _ = from_pretrained(folder, dtype=dtype)
    assert ours.blocks[1].mixer.rotary == ("position_embedding_type" in over)
    assert (ours.config.moe is None) == ("num_local_experts" in over)
    assert_logits_equal(ours, hf, _ids(), dtype, tol)


def test_router_loss_equals_transformers(tmp_path):
    hf, folder = _hf(tmp_path, torch.float64)
    ours, _ = from_pretrained(folder, dtype=torch.float64)
    with torch.no_grad():
        want = hf(_ids(), output_router_logits=True).aux_loss
        ours(_ids())
    torch.testing.assert_close(ours.aux_loss(), want.to(torch.float64), rtol=1e-6, atol=0)


def test_prefill_decode_packed_and_greedy_equal_transformers(tmp_path):
    hf, folder = _hf(tmp_path, torch.float64)
    ours, _ = from_pretrained(folder, dtype=torch.float64)
    ids = _ids()[:1, :20]
    assert_prefill_then_decode_equals_forward(ours, ids)
    assert_packed_equals_separate(ours, _ids())
    assert greedy_agreement(ours, hf, ids, lambda x: hf(x).logits) == 32


@pytest.mark.parametrize("over", [{}, {"tie_word_embeddings": True}], ids=["untied", "tied"])
def test_save_pretrained_round_trip_loads_in_transformers(tmp_path, over):
    """The folded weights are written with multipliers of 1: transformers' logits, subquad's unchanged."""
    hf, folder = _hf(tmp_path, **over)
    ours, _ = from_pretrained(folder)
    save_pretrained(ours, tmp_path / "back")
    c = json.loads((tmp_path / "back" / "config.json").read_text())
    assert c["model_type"] == "granitemoehybrid" and c["embedding_multiplier"] == c["logits_scaling"] == 1.0
    again = transformers.GraniteMoeHybridForCausalLM.from_pretrained(tmp_path / "back",
                                                                      experts_implementation="eager").eval()
    ours2, _ = from_pretrained(tmp_path / "back")
    with torch.no_grad():
        torch.testing.assert_close(again(_ids()).logits, hf(_ids()).logits, rtol=0, atol=1e-5)
        torch.testing.assert_close(ours2(_ids()), ours(_ids()), rtol=0, atol=1e-6)


def test_refusals_name_the_problem(tmp_path):
    from safetensors.torch import load_file, save_file

    _, folder = _hf(tmp_path)
    cfg = json.loads((folder / "config.json").read_text())
    for field, value in (("position_embedding_type", "alibi"), ("mamba_proj_bias", True), ("hidden_act", "gelu"),
                         ("attention_bias", True), ("layer_types", ["mamba", "cross_attention", "mamba"]),
                         ("head_dim", 8)):
        (folder / "config.json").write_text(json.dumps({**cfg, field: value}))
        with pytest.raises(ValueError, match=field):
            from_pretrained(folder)
    rope = {"rope_type": "yarn", "factor": 2.0, "rope_theta": 10000.0}
    (folder / "config.json").write_text(json.dumps({**cfg, "position_embedding_type": "rope", "rope_parameters": rope}))
    with pytest.raises(ValueError, match="rope_type"):
        from_pretrained(folder)
    (folder / "config.json").write_text(json.dumps(cfg))
    w = load_file(str(folder / "model.safetensors"))
    del w["model.layers.2.shared_mlp.input_linear.weight"]
    save_file(w, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match="missing.*layers.2.shared_mlp.input_linear"):
        from_pretrained(folder)
