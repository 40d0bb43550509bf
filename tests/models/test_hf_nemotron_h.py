"""Hugging Face NVIDIA Nemotron-H (``nemotron_h``): Mamba-2, attention without positions, ungated squared-ReLU
MLPs and mixtures of squared-ReLU experts (Nemotron 3's "E" layers: sigmoid grouped routing with the correction
bias, a shared expert, optionally latent experts) as separate layers chosen by a pattern string - each mixer
layer a subquad block, the MLP or MoE layer after it that block's MLP: tiny random transformers models give
transformers' logits and greedy tokens, come back through save_pretrained, multi-token-prediction tensors are
named as not loaded, and configs subquad cannot hold are refused by name."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")   # the `hf` extra installs it (make test requires it); the library never does

from subquad.models.hf import from_pretrained, save_pretrained  # noqa: E402
from tests.models.hf_harness import assert_logits_equal, assert_refused, buffers_by, tiny  # noqa: E402

V = 96
PATTERN = "M-M*-MM-"        # a Mamba layer without an MLP after it, as Nemotron Nano 2's "MM"
MOE_PATTERN = "ME*-MM*E"    # every layer kind: MoE after Mamba and attention, a dense MLP, a bare Mamba
MOE = {"n_routed_experts": 8, "moe_intermediate_size": 32, "moe_shared_expert_intermediate_size": 48,
       "num_experts_per_tok": 3, "n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5}


def _tweak(model):
    """Routing that depends on the token, and a correction bias of its own."""
    for name, p in model.named_parameters():
        if name.endswith("gate.weight"):
            p.mul_(5)
    buffers_by("e_score_correction_bias", lambda b: b.add_(torch.randn_like(b) * 0.1), model)


def _hf(tmp_path, dtype=torch.float32, **over):
    """A tiny random model: 8 layers of the pattern, attention with a head_dim of its own (4 x 24 != 64);
    non-trivial norms, D, dt, conv biases and routing."""
    return tiny(tmp_path, "nemotron_h", transformers.NemotronHConfig, transformers.NemotronHForCausalLM, {
        "vocab_size": V, "hidden_size": 64, "intermediate_size": 80, "hybrid_override_pattern": PATTERN,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 24, "mamba_num_heads": 8,
        "mamba_head_dim": 16, "ssm_state_size": 16, "n_groups": 2, "chunk_size": 16,
        "bos_token_id": None, "eos_token_id": None, "pad_token_id": None, **over},
        dtype, ("norm.weight", "norm_f.weight", ".D", "conv1d.bias", "dt_bias"), eager=True, tweak=_tweak)


def _ids(T=50):
    return torch.randint(0, V, (2, T), generator=torch.Generator().manual_seed(1))


# transformers' Nemotron-H reads lm_head even when tied
ROUND_TRIP = {"mlps": {}, "no-mlps-tie-ignored": {"tie_word_embeddings": True, "hybrid_override_pattern": "M*M"}}


def _saved(hf, ours, c, over, folder):
    """The round trip's folder (test_hf_parity.py): MLPs only where the pattern has them, the pattern kept."""
    assert ours.config.mlp == ("hybrid_override_pattern" not in over)
    assert c["hybrid_override_pattern"] == over.get("hybrid_override_pattern", PATTERN)


def test_the_loaded_structure(tmp_path):
    _, folder = _hf(tmp_path)
    ours, _ = from_pretrained(folder)
    assert ours.config.layers == ["mamba2", "mamba2", "softmax", "mamba2", "mamba2"]
    assert ours.config.mlp_layers == [0, 2, 4] and ours.config.mlp_kind == "relu2"
    assert [b.mlp is None for b in ours.blocks] == [False, True, False, True, False]
    attn = ours.blocks[2].mixer
    assert attn.head_dim == 24 and not attn.rotary and ours.blocks[0].mlp.w_up.weight.shape == (80, 64)


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
    from safetensors.torch import load_file

    _, folder = _hf(tmp_path)
    cfg = json.loads((folder / "config.json").read_text())
    cfg.pop("layers_block_type")
    for field, value in (("mlp_hidden_act", "silu"), ("mamba_hidden_act", "gelu"), ("use_bias", True),
                         ("attention_bias", True), ("sliding_window", 16), ("mamba_num_heads", 5)):
        assert_refused(folder, field, {**cfg, "hybrid_override_pattern": PATTERN, field: value})
    for pattern, why in (("M--M*-MM", "MLP layer 2 does not follow"), ("MEE", "MoE layer 2 does not follow"),
                         ("EM", "MoE layer 0 does not follow"), ("M-M*-MX-", "only M")):
        assert_refused(folder, f"hybrid_override_pattern.*{why}", {**cfg, "hybrid_override_pattern": pattern})
    (folder / "config.json").write_text(json.dumps({**cfg, "hybrid_override_pattern": PATTERN}))
    w = load_file(str(folder / "model.safetensors"))
    del w["backbone.layers.7.mixer.up_proj.weight"]
    assert_refused(folder, "missing.*backbone.layers.7.mixer.up_proj", weights=w)


def _hf_moe(tmp_path, dtype=torch.float32, **over):
    return _hf(tmp_path, dtype, **{"hybrid_override_pattern": MOE_PATTERN, **MOE, **over})


MOE_LOGITS = {"": {"moe_latent_size": None}}
MOE_LATENT_LOGITS = {"latent": {"moe_latent_size": 24}}                 # in float32 only
MOE_ROUND_TRIP = {"latent-no-renorm": {"moe_latent_size": 24, "norm_topk_prob": False}}


def _saved_moe(hf, ours, c, over, folder):
    """The MoE round trip's folder (test_hf_parity.py): the pattern, the latent size and the routing kept."""
    assert not ours.blocks[0].mlp.renormalize
    assert c["hybrid_override_pattern"] == MOE_PATTERN and c["moe_latent_size"] == 24
    assert {k: c[k] for k in MOE} == MOE and c["norm_topk_prob"] is False


def test_the_loaded_moe_structure(tmp_path):
    _, folder = _hf_moe(tmp_path, moe_latent_size=24)
    ours, _ = from_pretrained(folder)
    c = ours.config
    assert c.layers == ["mamba2", "softmax", "mamba2", "mamba2", "softmax"] and c.mlp_kind == "relu2"
    assert c.mlp_layers == [0, 1, 4] and c.moe_layers == [0, 4]
    m = ours.blocks[0].mlp
    assert (m.kind, m.router_kind, m.experts, m.top_k, m.groups, m.topk_groups, m.scale, m.renormalize) == \
        ("relu2", "sigmoid", 8, 3, 4, 2, 2.5, True)
    assert m.w_up.shape == (8, 32, 24) and m.latent_in.weight.shape == (24, 64) and m.shared_gate is None
    assert m.shared.w_up.weight.shape == (48, 64) and ours.blocks[1].mlp.w_up.weight.shape == (80, 64)


def test_multi_token_prediction_is_named_as_not_loaded(tmp_path):
    """A checkpoint with MTP layers (``mtp.*``, as Nemotron 3 writes them): transformers skips them, subquad too,
    saying so by name; a saved folder has none and says num_nextn_predict_layers 0."""
    from safetensors.torch import load_file, save_file

    hf, folder = _hf_moe(tmp_path)
    w = load_file(str(folder / "model.safetensors"))
    w["mtp.layers.0.enorm.weight"] = torch.ones(64)
    w["mtp.layers.0.eh_proj.weight"] = torch.zeros(64, 128)
    save_file(w, str(folder / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "num_nextn_predict_layers": 1}))
    with pytest.warns(UserWarning, match=r"not loaded.*multi-token-prediction layers \(num_nextn_predict_layers.*"
                                         r"mtp\.\*, 2 tensors"):
        ours, _ = from_pretrained(folder)
    assert_logits_equal(ours, hf, _ids(), torch.float32, 1e-4)
    save_pretrained(ours, tmp_path / "back")
    assert json.loads((tmp_path / "back" / "config.json").read_text())["num_nextn_predict_layers"] == 0
    from safetensors import safe_open

    with safe_open(str(tmp_path / "back" / "model.safetensors"), "pt") as f:
        assert not any(k.startswith("mtp.") for k in f.keys())


def test_float32_routers_beside_bfloat16_weights_load_and_run(tmp_path):
    """A checkpoint that keeps the routers in float32 (transformers' ``_keep_in_fp32_modules_strict``) and the
    rest in bfloat16, read in its own dtypes: the routers stay float32 and route in it."""
    from safetensors.torch import load_file, save_file

    hf, folder = _hf_moe(tmp_path)
    w = {k: v if ".gate." in k else v.to(torch.bfloat16) for k, v in load_file(str(folder / "model.safetensors")).items()}
    save_file(w, str(folder / "model.safetensors"), metadata={"format": "pt"})
    ours, _ = from_pretrained(folder)
    assert ours.blocks[0].mlp.router.weight.dtype == torch.float32 and ours.embed.weight.dtype == torch.bfloat16
    with torch.no_grad():
        got, ref = ours(_ids()), hf.to(torch.bfloat16)(_ids()).logits
    assert got.dtype == torch.bfloat16 and ((got - ref).abs().max() / ref.abs().max()).item() < 0.05


def test_moe_refusals_name_the_field(tmp_path):
    _, folder = _hf_moe(tmp_path)
    cfg = json.loads((folder / "config.json").read_text())
    for over, field in (({"num_experts_per_tok": 9}, "num_experts_per_tok"), ({"n_group": 3}, "n_group"),
                        ({"topk_group": 5}, "topk_group"), ({"topk_group": 1, "num_experts_per_tok": 3}, "topk_group"),
                        ({"moe_latent_size": "24"}, "moe_latent_size"),
                        ({"routed_scaling_factor": 0}, "routed_scaling_factor"),
                        ({"n_routed_experts": 1}, "n_routed_experts"), ({"mlp_bias": True}, "mlp_bias")):
        assert_refused(folder, field, {**cfg, **over})


def test_models_built_here_with_relu2_or_latent_experts_save_only_as_nemotron_h(tmp_path):
    """relu2 experts (and the latent ones) exist only in nemotron_h: a model built here saves as it, and a
    SwiGLU-expert model with latent experts has no Hugging Face type."""
    from subquad import LanguageModel, ModelConfig

    moe = {"experts": 4, "top_k": 2, "hidden": 24, "shared": 40, "shared_gate": False, "router": "sigmoid",
           "renormalize": True, "layers": [1], "latent": 16}
    common = dict(vocab_size=V, d_model=32, n_layers=3, n_heads=2, pattern="mamba2,softmax,mamba2", mlp_size=48,
                  norm_eps=1e-5, mixer_options={"softmax": {"rotary": False},
                                                "mamba2": {"norm_eps": 1e-5, "n_groups": 2}})
    model = LanguageModel(ModelConfig(**common, mlp_kind="relu2", mlp_layers=[0, 1], moe=moe)).eval()
    save_pretrained(model, tmp_path / "mine")
    c = json.loads((tmp_path / "mine" / "config.json").read_text())
    assert c["model_type"] == "nemotron_h" and c["hybrid_override_pattern"] == "M-*EM"
    theirs = transformers.NemotronHForCausalLM.from_pretrained(tmp_path / "mine", experts_implementation="eager")
    with torch.no_grad():
        torch.testing.assert_close(theirs.eval()(_ids()).logits, model(_ids()), rtol=0, atol=1e-5)
    swiglu = LanguageModel(ModelConfig(**common, moe={**moe, "layers": [0, 1, 2]})).eval()
    with pytest.raises(ValueError, match="no Hugging Face model type has this structure"):
        save_pretrained(swiglu, tmp_path / "no")
    with pytest.raises(ValueError, match="moe layers \\[1\\] must be among mlp_layers"):
        ModelConfig(**common, mlp_kind="relu2", mlp_layers=[0], moe=moe)
