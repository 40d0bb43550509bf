"""Hugging Face Liquid LFM2-MoE (``lfm2_moe``): LFM2's layers, dense MLPs first, then sigmoid-routed experts
chosen with an expert bias and renormalised as transformers does (w / (sum w + 1e-6)) - tiny random
transformers models give transformers' logits and greedy tokens and come back through save_pretrained."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")   # the `hf` extra installs it (make test requires it); the library never does

from subquad.models.hf import from_pretrained  # noqa: E402
from tests.models.test_hf import (  # noqa: E402
    assert_logits_equal, assert_packed_equals_separate, assert_prefill_then_decode_equals_forward, assert_round_trip,
    greedy_agreement)

V = 96


def _hf(tmp_path, dtype=torch.float32, **over):
    """conv, attention, conv: the first layer's MLP dense, the others 6 experts of which 3 per token."""
    torch.manual_seed(0)
    cfg = transformers.Lfm2MoeConfig(**{
        "vocab_size": V, "hidden_size": 64, "intermediate_size": 80, "moe_intermediate_size": 32,
        "num_hidden_layers": 3, "num_dense_layers": 1, "num_experts": 6, "num_experts_per_tok": 3,
        "routed_scaling_factor": 1.5, "num_attention_heads": 4, "num_key_value_heads": 2,
        "layer_types": ["conv", "full_attention", "conv"], "tie_word_embeddings": False,
        "bos_token_id": None, "eos_token_id": None, "pad_token_id": None, **over})
    cfg._experts_implementation = "eager"                  # its grouped-matmul default has no float64
    model = transformers.Lfm2MoeForCausalLM(cfg).to(dtype).eval()
    with torch.no_grad():                                  # non-trivial norms and expert biases
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", "layernorm.weight")):
                p.add_(torch.randn_like(p) * 0.3)
        for name, b in model.named_buffers():
            if name.endswith("expert_bias"):
                b.copy_(torch.randn_like(b) * 0.1)
    folder = tmp_path / "lfm2_moe"
    model.save_pretrained(folder)
    return model, folder


def _ids(T=50):
    return torch.randint(0, V, (2, T), generator=torch.Generator().manual_seed(1))


def test_the_loaded_structure(tmp_path):
    _, folder = _hf(tmp_path)
    ours, _ = from_pretrained(folder)
    assert ours.config.moe_layers == [1, 2] and ours.config.moe["router"] == "sigmoid"
    assert ours.blocks[0].mlp.w_gate.weight.shape == (80, 64) and ours.blocks[1].mlp.w_gate.shape == (6, 32, 64)
    assert ours.blocks[1].mlp.score_bias.abs().sum() > 0


@pytest.mark.parametrize("over", [{}, {"use_expert_bias": False, "norm_topk_prob": False}],
                         ids=["bias-renorm", "plain"])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.float64, 1e-6)])
def test_logits_equal_transformers(tmp_path, over, dtype, tol):
    hf, folder = _hf(tmp_path, dtype, **over)
    ours, _ = from_pretrained(folder, dtype=dtype)
    assert_logits_equal(ours, hf, _ids(), dtype, tol)


def test_prefill_decode_packed_and_greedy_equal_transformers(tmp_path):
    hf, folder = _hf(tmp_path, torch.float64)
    ours, _ = from_pretrained(folder, dtype=torch.float64)
    ids = _ids()[:1, :20]
    assert_prefill_then_decode_equals_forward(ours, ids)
    assert_packed_equals_separate(ours, _ids())
    assert greedy_agreement(ours, hf, ids, lambda x: hf(x).logits) == 32


def test_save_pretrained_round_trip_loads_in_transformers(tmp_path):
    hf, folder = _hf(tmp_path)
    ours, _ = from_pretrained(folder)
    assert_round_trip(hf, ours, transformers.Lfm2MoeForCausalLM, tmp_path / "back", _ids(), "lfm2_moe")
    c = json.loads((tmp_path / "back" / "config.json").read_text())
    assert c["num_dense_layers"] == 1 and c["num_experts"] == 6 and c["routed_scaling_factor"] == 1.5


def test_refusals_name_the_problem(tmp_path):
    _, folder = _hf(tmp_path)
    cfg = json.loads((folder / "config.json").read_text())
    for field, value in (("norm_topk_prob", 1), ("use_expert_bias", "yes"), ("routed_scaling_factor", "2"),
                         ("layer_types", ["conv", "moe", "conv"])):
        (folder / "config.json").write_text(json.dumps({**cfg, field: value}))
        with pytest.raises(ValueError, match=field):
            from_pretrained(folder)
