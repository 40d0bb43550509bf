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
from tests.models.test_hf import (  # noqa: E402
    assert_logits_equal, assert_packed_equals_separate, assert_prefill_then_decode_equals_forward, assert_round_trip,
    greedy_agreement)

KINDS = ["qwen3_next", "olmo_hybrid"]
V = 96


def _hf(tmp_path, kind, dtype=torch.float32, **over):
    """A tiny random model: Gated DeltaNet and attention layers (Qwen3-Next: 2 key heads for 4 value heads,
    K != V, MoE layers at every second layer and dense ones between)."""
    torch.manual_seed(0)
    if kind == "qwen3_next":
        cfg = transformers.Qwen3NextConfig(**{
            "vocab_size": V, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 4,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "linear_num_key_heads": 2,
            "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 24, "num_experts": 4,
            "num_experts_per_tok": 2, "moe_intermediate_size": 40, "shared_expert_intermediate_size": 48,
            "decoder_sparse_step": 2, "full_attention_interval": 2, "output_router_logits": False, **over})
        cfg._experts_implementation = "eager"              # its grouped-matmul default has no float64
        model = transformers.Qwen3NextForCausalLM(cfg)
    else:
        cfg = transformers.OlmoHybridConfig(**{
            "vocab_size": V, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 4,
            "num_attention_heads": 4, "num_key_value_heads": 2, "linear_num_key_heads": 2,
            "linear_num_value_heads": 2, "linear_key_head_dim": 16, "linear_value_head_dim": 32,
            "pad_token_id": None, "bos_token_id": None, "eos_token_id": None, **over})
        model = transformers.OlmoHybridForCausalLM(cfg)
    model = model.to(dtype).eval()
    with torch.no_grad():                                  # non-trivial norms and time steps
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", "layernorm.weight", "layer_norm.weight", "dt_bias")):
                p.add_(torch.randn_like(p) * 0.3)
    folder = tmp_path / kind
    model.save_pretrained(folder)
    return model, folder


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


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.float64, 1e-6)])
def test_logits_equal_transformers(tmp_path, kind, dtype, tol):
    # float64 is bounded by transformers' delta rule, which computes in float32 inside
    hf, folder = _hf(tmp_path, kind, dtype)
    ours, _ = from_pretrained(folder, dtype=dtype)
    assert_logits_equal(ours, hf, _ids(), dtype, tol)


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


def test_qwen3_next_router_loss_equals_transformers(tmp_path):
    hf, folder = _hf(tmp_path, "qwen3_next", torch.float64)
    ours, _ = from_pretrained(folder, dtype=torch.float64)
    with torch.no_grad():
        want = hf(_ids(), output_router_logits=True).aux_loss
        ours(_ids())
    torch.testing.assert_close(ours.aux_loss(), want.to(torch.float64), rtol=1e-6, atol=0)


@pytest.mark.parametrize("kind", KINDS)
def test_prefill_decode_packed_and_greedy_equal_transformers(tmp_path, kind):
    hf, folder = _hf(tmp_path, kind, torch.float64)
    ours, _ = from_pretrained(folder, dtype=torch.float64)
    ids = _ids()[:1, :20]
    assert_prefill_then_decode_equals_forward(ours, ids)
    assert_packed_equals_separate(ours, _ids())
    assert greedy_agreement(ours, hf, ids, lambda x: hf(x).logits) == 32


@pytest.mark.parametrize("kind", KINDS)
def test_save_pretrained_round_trip_loads_in_transformers(tmp_path, kind):
    hf, folder = _hf(tmp_path, kind)
    ours, _ = from_pretrained(folder)
    Model = {"qwen3_next": transformers.Qwen3NextForCausalLM, "olmo_hybrid": transformers.OlmoHybridForCausalLM}[kind]
    assert_round_trip(hf, ours, Model, tmp_path / "back", _ids(), kind)


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
    from safetensors.torch import load_file, save_file

    _, folder = _hf(tmp_path, "qwen3_next")
    cfg = json.loads((folder / "config.json").read_text())
    rope = {**cfg["rope_parameters"], "rope_type": "yarn", "factor": 2.0}
    for field, value in (("mlp_only_layers", [1]), ("hidden_act", "gelu"), ("attention_bias", True),
                         ("rope_parameters", rope), ("layer_types", ["full_attention", "mamba"] * 2)):
        (folder / "config.json").write_text(json.dumps({**cfg, field: value}))
        with pytest.raises(ValueError, match=field if field != "rope_parameters" else "rope_type"):
            from_pretrained(folder)
    (folder / "config.json").write_text(json.dumps(cfg))
    weights = load_file(str(folder / "model.safetensors"))
    w = dict(weights)
    del w["model.layers.1.mlp.shared_expert_gate.weight"]
    save_file(w, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match="missing.*layers.1.mlp.shared_expert_gate"):
        from_pretrained(folder)
    _, folder = _hf(tmp_path, "olmo_hybrid")
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "head_dim": 8}))
    with pytest.raises(ValueError, match="head_dim=8"):
        from_pretrained(folder)
    (folder / "config.json").write_text(json.dumps(cfg))
    w = load_file(str(folder / "model.safetensors"))
    w["model.layers.0.linear_attn.o_norm.weight"] = torch.ones(5)
    save_file(w, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match=r"o_norm.weight has shape \(5,\)"):
        from_pretrained(folder)
