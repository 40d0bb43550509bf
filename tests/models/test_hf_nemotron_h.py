"""Hugging Face NVIDIA Nemotron-H (``nemotron_h``): Mamba-2, attention without positions, ungated squared-ReLU
MLPs and mixtures of squared-ReLU experts (Nemotron 3's "E" layers: sigmoid grouped routing with the correction
bias, a shared expert, optionally latent experts) as separate layers chosen by a pattern string - each mixer
layer a subquad block, the MLP or MoE layer after it that block's MLP: tiny random transformers models give
transformers' logits and greedy tokens, come back through save_pretrained, multi-token-prediction tensors are
load as the model's drafter (models.mtp), and configs subquad cannot hold are refused by name."""

from __future__ import annotations

import json

import pytest
import torch

# the `hf` extra installs it (make test requires it); the library never does
transformers = pytest.importorskip("transformers")

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


def _with_mtp(tmp_path):
    """(transformers' float64 MoE model, a reference ``mtp(h, tokens)`` -> (logits, u), the folder) with an MTP head
    as Nemotron 3 writes one: "mtp.layers.0." a perturbed copy of attention layer 6 with random ``enorm``,
    ``hnorm`` and ``eh_proj``, "mtp.layers.1." a perturbed copy of MoE layer 7 with a random ``final_layernorm``.
    The reference is the layout (vLLM's nemotron_h_mtp.py) written out around transformers' own Nemotron-H blocks
    holding those weights (transformers has no MTP forward)."""
    from tests.models.mtp_harness import causal, first, graft, random_head, reference

    hf, folder = _hf_moe(tmp_path, torch.float64)
    attn, moe = graft(hf, tmp_path, folder, [(lambda t: t.model.layers[6], "backbone.layers.6.", "mtp.layers.0."),
                                             (lambda t: t.model.layers[7], "backbone.layers.7.", "mtp.layers.1.")])
    assert (attn.block_type, moe.block_type) == ("full_attention", "moe")
    RMS = transformers.models.nemotron_h.modeling_nemotron_h.NemotronHRMSNorm
    names = {"embed": "mtp.layers.0.enorm.weight", "hidden": "mtp.layers.0.hnorm.weight",
             "final": "mtp.layers.1.final_layernorm.weight"}
    norms, eh = random_head(folder, RMS, 64, hf.config.layer_norm_epsilon, names, "mtp.layers.0.eh_proj.weight",
                            torch.float64, centre=1.0)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "num_nextn_predict_layers": 1,
                                                    "mtp_layers_block_type": ["full_attention", "moe"]}))

    def run(z, T):
        return first(moe(first(attn(z, attention_mask=causal(T, z.dtype), position_ids=torch.arange(T)[None]))))

    return hf, reference(hf.model.embeddings, hf.lm_head, norms, eh, run), folder


def test_the_mtp_head_equals_the_layout_written_out_and_drafts_greedily(tmp_path):
    """Nemotron 3's MTP layers load as ``model.mtp``: every pair's logits within 1e-6 of the reference (all at once
    and in two pieces from the head's state); a saved folder keeps the head, declares it, and transformers still
    loads it with the same logits; greedy decoding with speculative="mtp" is plain greedy decoding."""
    from safetensors.torch import load_file

    from tests.models.mtp_harness import assert_head_equals

    hf, mtp, folder = _with_mtp(tmp_path)
    ours, _ = from_pretrained(folder, dtype=torch.float64)
    assert ours.mtp is not None and ours.mtp.block.mlp.__class__.__name__ == "MoE"
    ids = _ids(21)
    with torch.no_grad():
        mine, got = assert_head_equals(ours, hf.model(ids).last_hidden_state, ids, mtp)
    save_pretrained(ours, tmp_path / "back")
    c = json.loads((tmp_path / "back" / "config.json").read_text())
    assert c["num_nextn_predict_layers"] == 1 and c["mtp_layers_block_type"] == ["full_attention", "moe"]
    assert set(load_file(str(tmp_path / "back" / "model.safetensors"))) == set(
        load_file(str(folder / "model.safetensors")))
    back, _ = from_pretrained(tmp_path / "back", dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(back.mtp(back, mine[:, :-1], ids[:, 1:])[0], got, rtol=0, atol=0)
    again = transformers.NemotronHForCausalLM.from_pretrained(tmp_path / "back", dtype=torch.float64,
                                                              experts_implementation="eager").eval()
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits, hf(ids).logits, rtol=0, atol=1e-9)
    prompt = ids[0, :9].tolist()
    plain = ours.generate(prompt, 14, temperature=0)[0]
    assert ours.generate(prompt, 14, temperature=0, speculative="mtp", draft_tokens=2)[0] == plain
    assert ours.speculation_stats.verifications > 0


def test_an_mtp_head_of_two_blocks_is_named_as_not_loaded(tmp_path):
    """Two MTP steps (mtp.layers.0-3): not supported, said by name; the language model loads whole."""
    from safetensors.torch import load_file, save_file

    hf, folder = _hf_moe(tmp_path)
    w = load_file(str(folder / "model.safetensors"))
    for j in range(4):
        w[f"mtp.layers.{j}.norm.weight"] = torch.ones(64)
    save_file(w, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.warns(UserWarning, match=r"not loaded.*multi-token-prediction head \(mtp\.\*, 4 tensors\).*"
                                         r"one block \(layers \['0', '1'\]\)"):
        ours, _ = from_pretrained(folder)
    assert getattr(ours, "mtp", None) is None
    assert_logits_equal(ours, hf, _ids(), torch.float32, 1e-4)
    save_pretrained(ours, tmp_path / "back")
    assert json.loads((tmp_path / "back" / "config.json").read_text())["num_nextn_predict_layers"] == 0


def test_float32_routers_beside_bfloat16_weights_load_and_run(tmp_path):
    """A checkpoint that keeps the routers in float32 (transformers' ``_keep_in_fp32_modules_strict``) and the
    rest in bfloat16, read in its own dtypes: the routers stay float32 and route in it."""
    from safetensors.torch import load_file, save_file

    hf, folder = _hf_moe(tmp_path)
    w = {k: v if ".gate." in k else v.to(torch.bfloat16)
         for k, v in load_file(str(folder / "model.safetensors")).items()}
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
