"""Hugging Face Qwen3.5 - dense (``qwen3_5``) and MoE (``qwen3_5_moe``), multimodal folders whose language
model subquad loads (the vision tower named and left out): tiny random transformers models give
transformers' logits, greedy tokens and router loss, come back through save_pretrained as their text-only
types, and bad folders are refused by name."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")   # the `hf` extra installs it (make test requires it); the library never does

from subquad.models.hf import from_pretrained, save_pretrained  # noqa: E402
from tests.models.hf_harness import assert_logits_equal, assert_refused  # noqa: E402

KINDS = ["qwen3_5", "qwen3_5_moe"]
V = 96
TEXT = {"vocab_size": V, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 32, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
        "linear_key_head_dim": 16, "linear_value_head_dim": 24, "full_attention_interval": 2,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                            "mrope_section": [2, 1, 1], "mrope_interleaved": True}}
MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 40, "shared_expert_intermediate_size": 48}
VISION = {"depth": 1, "hidden_size": 32, "intermediate_size": 48, "num_heads": 2, "out_hidden_size": 64,
          "patch_size": 4, "num_position_embeddings": 16}


def _hf(tmp_path, kind, dtype=torch.float32, **over):
    """A tiny random multimodal model: Gated DeltaNet and gated attention layers alternating (2 key heads for 4
    value heads, K != V), MoE in every layer for qwen3_5_moe, a one-block vision tower."""
    torch.manual_seed(0)
    moe = kind == "qwen3_5_moe"
    Config = transformers.Qwen3_5MoeConfig if moe else transformers.Qwen3_5Config
    Model = transformers.Qwen3_5MoeForConditionalGeneration if moe else transformers.Qwen3_5ForConditionalGeneration
    cfg = Config(text_config={**TEXT, **(MOE if moe else {}), **over}, vision_config=VISION)
    cfg.text_config._experts_implementation = "eager"      # its grouped-matmul default has no float64
    model = Model(cfg).to(dtype).eval()
    with torch.no_grad():                                  # non-trivial norms, gates and time steps
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", "dt_bias", "gate.weight")):
                p.add_(torch.randn_like(p) * 0.3)
    folder = tmp_path / kind
    model.save_pretrained(folder)
    return model, folder


def _ids(T=50):
    return torch.randint(0, V, (2, T), generator=torch.Generator().manual_seed(1))


def _saved(hf, ours, c, over, folder):
    """The round trip (test_hf_parity.py) writes the text-only type, never the multimodal one without the
    vision tower."""
    kind = c["model_type"].removesuffix("_text")
    with pytest.raises(ValueError, match=f"cannot be written as model_type '{kind}'"):
        save_pretrained(ours, folder.parent / "mm", model_type=kind)


def test_the_loaded_structure_and_what_is_left_out(tmp_path):
    _, folder = _hf(tmp_path, "qwen3_5_moe")
    with pytest.warns(UserWarning, match=r"not loaded.*the vision tower \(model\.visual\.\*, \d+ tensors\)"):
        ours, _ = from_pretrained(folder)
    assert ours.config.layers == ["gated_deltanet", "softmax"] * 2 and ours.config.moe_layers == [0, 1, 2, 3]
    gdn, attn = ours.blocks[0].mixer, ours.blocks[1].mixer
    assert (gdn.n_heads, gdn.n_key_heads, gdn.head_dim, gdn.value_head_dim) == (4, 2, 16, 24)
    assert attn.head_dim == 32 and attn.rotary_dim == 8 and attn.output_gate and attn.qk_norm == "head"
    assert ours.blocks[0].mlp.shared is not None and ours.blocks[0].mlp.w_up.shape == (4, 40, 64)


@pytest.mark.filterwarnings("ignore:qwen3_5")
def test_refusals_name_the_problem(tmp_path):
    from safetensors.torch import load_file

    _, folder = _hf(tmp_path, "qwen3_5")
    cfg = json.loads((folder / "config.json").read_text())
    t = cfg["text_config"]
    rope = {**t["rope_parameters"], "rope_type": "yarn", "factor": 2.0}
    for field, value in (("hidden_act", "gelu"), ("attention_bias", True), ("attn_output_gate", False),
                         ("rope_parameters", rope), ("layer_types", ["full_attention", "mamba"] * 2)):
        assert_refused(folder, field if field != "rope_parameters" else "rope_type", {**cfg, "text_config": {**t, field: value}})
    assert_refused(folder, "text_config", {**cfg, "text_config": None})
    (folder / "config.json").write_text(json.dumps(cfg))
    w = load_file(str(folder / "model.safetensors"))
    del w["model.language_model.layers.0.linear_attn.in_proj_z.weight"]
    assert_refused(folder, "missing.*layers.0.linear_attn.in_proj_z", weights=w)


def test_fused_experts_and_an_mtp_head_as_released_checkpoints_hold_them(tmp_path):
    """Experts stacked as ``experts.gate_up_proj`` (E, 2I, d) and ``experts.down_proj`` load as one per expert;
    an incomplete ``mtp.*`` head is left out and named (a whole one loads: test_mtp.py)."""
    from safetensors.torch import load_file, save_file

    hf, folder = _hf(tmp_path, "qwen3_5_moe")
    w = load_file(str(folder / "model.safetensors"))
    for i in range(TEXT["num_hidden_layers"]):
        p = f"model.language_model.layers.{i}.mlp.experts."
        E = range(MOE["num_experts"])
        w[p + "gate_up_proj"] = torch.stack([torch.cat([w.pop(f"{p}{e}.gate_proj.weight"),
                                                        w.pop(f"{p}{e}.up_proj.weight")]) for e in E])
        w[p + "down_proj"] = torch.stack([w.pop(f"{p}{e}.down_proj.weight") for e in E])
    w["mtp.fc.weight"] = torch.zeros(64, 128)
    save_file(w, str(folder / "model.safetensors"))
    with pytest.warns(UserWarning, match=r"the multi-token-prediction head \(mtp\.\*, 1 tensors\)"):
        ours, _ = from_pretrained(folder)
    assert_logits_equal(ours, hf, _ids(), torch.float32, 1e-4)
