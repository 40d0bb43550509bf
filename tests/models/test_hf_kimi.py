"""Hugging Face Kimi Linear - KDA layers, multi-head latent attention without positions, a DeepSeek-V3
mixture of experts (sigmoid router with its correction bias, grouped top-k, scaling, ungated shared expert):
tiny random transformers models give transformers' logits and greedy tokens, come back through
save_pretrained, and bad folders are refused by name."""

from __future__ import annotations

import json
from functools import partial

import pytest
import torch

transformers = pytest.importorskip("transformers")   # the `hf` extra installs it (make test requires it); the library never does

from subquad.models.hf import from_pretrained  # noqa: E402
from tests.models.hf_harness import assert_refused, buffers_by, tiny  # noqa: E402

V = 96


def _hf(tmp_path, dtype=torch.float32, **over):
    """Two KDA and two MLA layers, a dense MLP first then MoE layers (8 experts in 2 groups); non-trivial norms,
    time steps and routing bias."""
    return tiny(tmp_path, "kimi", transformers.KimiLinearConfig, transformers.KimiLinearForCausalLM, {
        "vocab_size": V, "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32,
        "num_hidden_layers": 4, "num_attention_heads": 4, "kv_lora_rank": 16, "qk_rope_head_dim": 8,
        "qk_nope_head_dim": 16, "v_head_dim": 12, "num_local_experts": 8, "num_experts_per_tok": 2, "n_group": 2,
        "topk_group": 1, "linear_head_dim": 16, "linear_num_heads": 4, "pad_token_id": None, "bos_token_id": None,
        "eos_token_id": None, "layer_types": ["linear_attention", "full_attention"] * 2, **over},
        dtype, ("norm.weight", "layernorm.weight", "dt_bias"), eager=True,
        tweak=partial(buffers_by, "e_score_correction_bias", lambda b: b.add_(torch.randn_like(b) * 0.1)))


def _ids(T=50):
    return torch.randint(0, V, (2, T), generator=torch.Generator().manual_seed(1))


LOGITS = {"q-full": {}, "q-low-rank": {"q_lora_rank": 24}}


def test_the_loaded_structure_and_its_latent_cache(tmp_path):
    _, folder = _hf(tmp_path)
    ours, _ = from_pretrained(folder)
    assert ours.config.layers == ["kda", "mla"] * 2 and ours.config.moe_layers == [1, 2, 3]
    kda, mla = ours.blocks[0].mixer, ours.blocks[1].mixer
    assert (kda.n_heads, kda.head_dim, mla.kv_rank, mla.rope_dim, mla.v_head_dim) == (4, 16, 16, 8, 12)
    assert not mla.rotary and ours.blocks[1].mlp.router_kind == "sigmoid" and ours.blocks[1].mlp.shared_gate is None
    with torch.no_grad():
        _, state = ours.prefill(_ids()[:1, :10])
    assert state[1]["kv"].k.shape == (1, 10, 1, 16) and state[1]["kv"].v.shape == (1, 10, 1, 8)   # latents


def test_released_checkpoint_config_layout(tmp_path):
    """The released config keeps the linear-attention fields in linear_attn_config (layers 1-indexed) and
    says first_k_dense_replace; the same model loads from it."""
    hf, folder = _hf(tmp_path, torch.float64)
    c = json.loads((folder / "config.json").read_text())
    for key in ("layer_types", "mlp_layer_types", "linear_num_heads", "linear_head_dim", "linear_conv_kernel_dim"):
        c.pop(key)
    c["linear_attn_config"] = {"num_heads": 4, "head_dim": 16, "short_conv_kernel_size": 4, "full_attn_layers": [2, 4],
                               "kda_layers": [1, 3]}
    c["first_k_dense_replace"] = 1
    (folder / "config.json").write_text(json.dumps(c))
    ours, _ = from_pretrained(folder, dtype=torch.float64)
    assert ours.config.layers == ["kda", "mla"] * 2 and ours.config.moe_layers == [1, 2, 3]
    with torch.no_grad():
        torch.testing.assert_close(ours(_ids()), hf(_ids()).logits, rtol=0, atol=1e-6)


def test_refusals_name_the_problem(tmp_path):
    from safetensors.torch import load_file

    _, folder = _hf(tmp_path)
    cfg = json.loads((folder / "config.json").read_text())
    for field, value in (("hidden_act", "gelu"), ("attention_bias", True), ("layer_types", ["kda"] * 4),
                         ("mlp_layer_types", ["dense", "moe", "sparse", "sparse"])):
        assert_refused(folder, field, {**cfg, field: value})
    (folder / "config.json").write_text(json.dumps(cfg))
    w = load_file(str(folder / "model.safetensors"))
    del w["model.layers.2.block_sparse_moe.gate.e_score_correction_bias"]
    assert_refused(folder, "missing.*layers.2.mlp.gate.e_score_correction_bias", weights=w)


def test_cli_generates_transformers_tokens_from_a_kimi_folder(tmp_path, capsys):
    from tokenizers import Tokenizer, models, pre_tokenizers

    from subquad.cli import main

    hf, folder = _hf(tmp_path, torch.float64)
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(V)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(folder / "tokenizer.json"))
    assert main(["generate", "--model", str(folder), "--prompt", "w1 w2 w3", "--max-new-tokens", "8",
                 "--temperature", "0", "--dtype", "float64"]) == 0
    want = hf.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=8, do_sample=False)[0, 3:].tolist()
    assert tok.decode(want) in capsys.readouterr().out
