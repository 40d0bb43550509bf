"""Hugging Face Gated DeltaNet hybrids - Qwen3-Next (key heads shared by value heads, fused projections,
gated attention, MoE with a shared expert) and OLMo-Hybrid (negative eigenvalues, post-norm attention with
q/k norms over all heads, rotary or none): tiny random transformers models give transformers' logits,
greedy tokens and router loss, come back through save_pretrained, and bad folders are refused by name."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")   # the `hf` extra installs it (make test requires it); the library never does

from subquad.models.hf import from_pretrained, save_pretrained  # noqa: E402
from tests.models.hf_harness import assert_refused, tiny  # noqa: E402

KINDS = ["qwen3_next", "olmo_hybrid"]
V = 96


def _hf(tmp_path, kind, dtype=torch.float32, **over):
    """A tiny random model: Gated DeltaNet and attention layers (Qwen3-Next: 2 key heads for 4 value heads,
    K != V, MoE layers at every second layer and dense ones between)."""
    noisy = ("norm.weight", "layernorm.weight", "layer_norm.weight", "dt_bias")     # non-trivial norms, time steps
    if kind == "qwen3_next":
        return tiny(tmp_path, kind, transformers.Qwen3NextConfig, transformers.Qwen3NextForCausalLM, {
            "vocab_size": V, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 4,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "linear_num_key_heads": 2,
            "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 24, "num_experts": 4,
            "num_experts_per_tok": 2, "moe_intermediate_size": 40, "shared_expert_intermediate_size": 48,
            "decoder_sparse_step": 2, "full_attention_interval": 2, "output_router_logits": False, **over},
            dtype, noisy, eager=True)
    return tiny(tmp_path, kind, transformers.OlmoHybridConfig, transformers.OlmoHybridForCausalLM, {
        "vocab_size": V, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 2, "linear_num_key_heads": 2, "linear_num_value_heads": 2, "linear_key_head_dim": 16,
        "linear_value_head_dim": 32, "pad_token_id": None, "bos_token_id": None, "eos_token_id": None, **over},
        dtype, noisy)


def _ids(T=50):
    return torch.randint(0, V, (2, T), generator=torch.Generator().manual_seed(1))


def test_the_loaded_structure(tmp_path):
    _, folder = _hf(tmp_path, "qwen3_next")
    ours, _ = from_pretrained(folder)
    assert ours.config.layers == ["gated_deltanet", "softmax"] * 2 and ours.config.moe_layers == [1, 3]
    gdn, attn = ours.blocks[0].mixer, ours.blocks[1].mixer
    assert (gdn.n_heads, gdn.n_key_heads, gdn.head_dim, gdn.value_head_dim) == (4, 2, 16, 24)
    assert attn.head_dim == 32 and attn.rotary_dim == 8 and attn.output_gate and attn.qk_norm == "head"
    assert ours.blocks[1].mlp.shared is not None and ours.blocks[0].mlp.w_up.weight.shape == (96, 64)
    _, folder = _hf(tmp_path, "olmo_hybrid")
    ours, _ = from_pretrained(folder)
    assert ours.config.layers == ["gated_deltanet"] * 3 + ["softmax"] and ours.config.post_norm == ["softmax"]
    assert ours.blocks[0].mixer.allow_neg_eigval and ours.blocks[3].mixer.qk_norm == "all"


@pytest.mark.parametrize("over", [{"rope_parameters": {"rope_type": "default", "rope_theta": None}},
                                  {"linear_allow_neg_eigval": False}],
                         ids=["nope", "positive-eigenvalues"])
def test_olmo_variants_equal_transformers(tmp_path, over):
    hf, folder = _hf(tmp_path, "olmo_hybrid", torch.float64, **over)
    ours, _ = from_pretrained(folder, dtype=torch.float64)
    attn, gdn = ours.blocks[3].mixer, ours.blocks[0].mixer
    assert attn.rotary == ("rope_parameters" not in over) and gdn.allow_neg_eigval == ("rope_parameters" in over)
    with torch.no_grad():
        ref = hf(_ids()).logits
        assert ((ours(_ids()) - ref).abs().max() / ref.abs().max()).item() <= 1e-6


def test_qwen3_next_dense_and_a_model_built_here(tmp_path):
    """num_experts=0 (dense MLPs everywhere) loads; a subquad model of Qwen3-Next's structure saves as it."""
    from subquad import LanguageModel, ModelConfig

    hf, folder = _hf(tmp_path, "qwen3_next", torch.float64, num_experts=0, tie_word_embeddings=True)
    ours, _ = from_pretrained(folder, dtype=torch.float64)
    assert ours.config.moe is None and ours.head is None
    with torch.no_grad():
        torch.testing.assert_close(ours(_ids()), hf(_ids()).logits, rtol=0, atol=1e-6)
    gdn = {"n_heads": 4, "n_key_heads": 1, "head_dim": 8, "value_head_dim": 8, "open_gate": False, "qk_eps": 1e-6,
           "norm_eps": 1e-6}
    cfg = ModelConfig(vocab_size=V, d_model=32, n_layers=3, n_heads=2, pattern="gated_deltanet,gated_deltanet,softmax",
                      mlp_size=48, norm_eps=1e-6, moe={"experts": 3, "top_k": 2, "hidden": 16, "shared": 24,
                                                        "renormalize": True},
                      mixer_options={"gated_deltanet": gdn, "softmax": {"head_dim": 8, "qk_norm": "head",
                                                                        "output_gate": True, "rotary_fraction": 0.5}})
    model = LanguageModel(cfg).eval()
    save_pretrained(model, tmp_path / "mine")
    c = json.loads((tmp_path / "mine" / "config.json").read_text())
    assert c["model_type"] == "qwen3_next" and c["layer_types"][2] == "full_attention"
    theirs = transformers.Qwen3NextForCausalLM.from_pretrained(tmp_path / "mine", experts_implementation="eager")
    with torch.no_grad():
        torch.testing.assert_close(theirs.eval()(_ids()).logits, model(_ids()), rtol=0, atol=1e-5)


def test_refusals_name_the_problem(tmp_path):
    from safetensors.torch import load_file

    _, folder = _hf(tmp_path, "qwen3_next")
    cfg = json.loads((folder / "config.json").read_text())
    rope = {**cfg["rope_parameters"], "rope_type": "yarn", "factor": 2.0}
    for field, value in (("mlp_only_layers", [1]), ("hidden_act", "gelu"), ("attention_bias", True),
                         ("rope_parameters", rope), ("layer_types", ["full_attention", "mamba"] * 2)):
        assert_refused(folder, field if field != "rope_parameters" else "rope_type", {**cfg, field: value})
    (folder / "config.json").write_text(json.dumps(cfg))
    weights = load_file(str(folder / "model.safetensors"))
    w = dict(weights)
    del w["model.layers.1.mlp.shared_expert_gate.weight"]
    assert_refused(folder, "missing.*layers.1.mlp.shared_expert_gate", weights=w)
    _, folder = _hf(tmp_path, "olmo_hybrid")
    cfg = json.loads((folder / "config.json").read_text())
    assert_refused(folder, "head_dim=8", {**cfg, "head_dim": 8})
    (folder / "config.json").write_text(json.dumps(cfg))
    w = load_file(str(folder / "model.safetensors"))
    w["model.layers.0.linear_attn.o_norm.weight"] = torch.ones(5)
    assert_refused(folder, r"o_norm.weight has shape \(5,\)", weights=w)
