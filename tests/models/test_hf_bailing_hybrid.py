"""Hugging Face inclusionAI Ling 3 (``bailing_hybrid``): KDA with full-rank gates and the bounded forget gate, MLA
with DeepSeek's interleaved rotary and a gate per head, DeepSeek-V3 experts with grouped routing - the parity
checks are rows of test_hf_parity.py; here what is the type's alone: the rotary rows, an incomplete MTP layer left
out, what is refused by name (the MTP head: test_mtp_bailing.py)."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")   # the `hf` extra installs it (make test requires it); the library never does

from subquad.models.hf import from_pretrained  # noqa: E402
from tests.models.hf_harness import assert_refused  # noqa: E402

V = 96
# the other options: a low-rank query (q_a_proj, q_b_proj), Kimi's softplus forget gate, a tied head
OTHER = {"q_lora_rank": 12, "kda_safe_gate": False, "tie_word_embeddings": True}


def _hf(tmp_path, dtype=torch.float32, **over):
    """A tiny random model: KDA, KDA, MLA (layer_group_size 3), the first layer dense, then 8 experts in 4 groups
    (top 2 groups, top 2 experts) beside a shared one; KDA heads of 8 dims (= the MLA's rotary dims: transformers
    writes head_dim as qk_rope_head_dim and reads it back as KDA's), the released bounded forget gate."""
    torch.manual_seed(0)
    cfg = transformers.BailingHybridConfig(**{
        "vocab_size": V, "hidden_size": 32, "intermediate_size": 48, "moe_intermediate_size": 16,
        "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 8,
        "kv_lora_rank": 16, "q_lora_rank": None, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 8,
        "num_local_experts": 8, "num_experts_per_tok": 2, "n_group": 4, "topk_group": 2, "first_k_dense_replace": 1,
        "layer_group_size": 3, "rope_parameters": {"rope_type": "default", "rope_theta": 5000.0},
        "bos_token_id": None, "eos_token_id": None, "pad_token_id": None, **over})
    cfg._experts_implementation = "eager"                     # the grouped-matmul default has no float64
    model = transformers.BailingHybridForCausalLM(cfg).to(dtype).eval()
    with torch.no_grad():                     # non-trivial norms, decays and router biases
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(("dt_bias", "A_log")):
                p.add_(torch.randn_like(p) * 0.3)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0, 0.1)
    folder = tmp_path / "bailing_hybrid"
    model.save_pretrained(folder)
    return model, folder


LOGITS = ROUND_TRIP = {"released": {}, "q-lora-softplus-gate-tied": OTHER}


def _loaded(ours, over):
    """The logits cases of test_hf_parity.py: KDA's gates as each config asks, MLA gated and rotating."""
    assert ours.config.layers == ["kda", "kda", "mla"] and ours.config.moe_layers == [1, 2]
    kda, mla = ours.blocks[0].mixer, ours.blocks[2].mixer
    assert kda.full_gates and kda.gate_bound == (None if over else -5.0)
    assert mla.rotary and mla.g_proj is not None and (mla.q_rank == over.get("q_lora_rank"))
    assert ours.config.moe["groups"] == 4 and ours.config.moe["topk_groups"] == 2


def _saved(hf, ours, c, over, folder):
    """The round trip's folder (test_hf_parity.py) holds the released names and loads in transformers with
    nothing missing or unexpected."""
    from safetensors.torch import load_file

    names = set(load_file(str(folder / "model.safetensors")))
    assert "model.word_embeddings.weight" in names and "model.layers.0.attention.q_conv1d.weight" in names
    assert "model.layers.1.mlp.gate.expert_bias" in names and "model.layers.2.attention.dense.weight" in names
    _, info = transformers.BailingHybridForCausalLM.from_pretrained(folder, output_loading_info=True)
    assert not any(info.values())


def test_the_rotary_rows_come_evens_then_odds_and_mtp_layers_are_left_out(tmp_path):
    """MLA's q rows per head: 8 nope dims, then the rotary ones 0, 2, 4, 6, 1, 3, 5, 7; a folder with a decoder
    layer after the decoder layers but not the MTP head's own tensors (enorm, hnorm, eh_proj, final_layernorm;
    test_mtp_bailing.py loads a whole one) loads the same model with a warning naming it."""
    from safetensors.torch import load_file, save_file

    hf, folder = _hf(tmp_path)
    ours, _ = from_pretrained(folder)
    order = torch.tensor([0, 2, 4, 6, 1, 3, 5, 7]) + 8
    want = hf.model.layers[2].self_attn.q_proj.weight.unflatten(0, (4, 16))[:, torch.cat([torch.arange(8), order])]
    torch.testing.assert_close(ours.blocks[2].mixer.q_proj.weight, want.flatten(0, 1), rtol=0, atol=0)
    w = load_file(str(folder / "model.safetensors"))
    w.update({k.replace("layers.2.", "layers.3."): v.clone() for k, v in w.items() if k.startswith("model.layers.2.")})
    save_file(w, str(folder / "model.safetensors"))
    with pytest.warns(UserWarning, match=r"not loaded: the multi-token-prediction head \(model\.layers\.3\.\*.*"
                                         r"missing from the checkpoint: model\.layers\.3\.eh_proj"):
        again, _ = from_pretrained(folder)
    ids = torch.randint(0, V, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(again(ids), ours(ids), rtol=0, atol=0)


def test_refusals_name_the_problem(tmp_path):
    _, folder = _hf(tmp_path)
    cfg = json.loads((folder / "config.json").read_text())
    for field, value in (("hidden_act", "gelu"), ("attention_bias", True), ("layer_types", ["mamba"] * 3),
                         ("mlp_layer_types", ["dense", "moe", "sparse"]), ("kda_lower_bound", 1.0),
                         ("num_expert_group", 3), ("rope_parameters.rope_type",
                                                   {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0})):
        assert_refused(folder, field.replace("num_expert_group", "n_group"), {**cfg, field.split(".")[0]: value})


def test_kda_heads_other_than_the_rotary_dims_as_the_released_configs_have_them(tmp_path):
    """Released configs hold head_dim (KDA's, 128) beside qk_rope_head_dim (64); transformers writes head_dim as the
    rotary size and the KDA head size as linear_head_dim: its own save loads as it is, and with head_dim put back
    (the released form, no linear_* fields) - in transformers and here alike."""
    hf, folder = _hf(tmp_path, head_dim=16)
    c = json.loads((folder / "config.json").read_text())
    assert c["head_dim"] == 8 and c["linear_head_dim"] == 16 and hf.config.linear_head_dim == 16
    ids = torch.randint(0, V, (2, 30), generator=torch.Generator().manual_seed(1))
    released = {k: v for k, v in c.items() if not k.startswith("linear_")}
    for config in (c, {**released, "head_dim": 16}):
        (folder / "config.json").write_text(json.dumps(config))
        theirs = transformers.BailingHybridForCausalLM.from_pretrained(folder, experts_implementation="eager").eval()
        ours, _ = from_pretrained(folder)
        assert ours.blocks[0].mixer.head_dim == 16 and ours.blocks[2].mixer.rope_dim == 8
        with torch.no_grad():
            ref = theirs(ids).logits
            torch.testing.assert_close(ours(ids), ref, rtol=0, atol=1e-4 * ref.abs().max().item())
