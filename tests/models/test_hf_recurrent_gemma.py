"""Hugging Face ``recurrent_gemma`` (Griffin: RG-LRU blocks and local multi-query attention): a tiny random
transformers model, saved and loaded here, gives transformers' logits and greedy tokens, packed sequences and a
prefill continued token by token equal the full forward, and save_pretrained's folder loads back in
transformers; bad folders are refused by name."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")   # the `hf` extra installs it (make test requires it); the library never does

from subquad.models.hf import from_pretrained, save_pretrained  # noqa: E402
from tests.models.hf_harness import assert_refused, tiny  # noqa: E402

V = 96


def _hf(tmp_path, dtype=torch.float32, **over):
    """Four layers (recurrent, recurrent, attention, recurrent), multi-query attention with a window of 8 keys;
    non-trivial norms and biases (transformers starts them at zero), embeddings x 4: logits of a few units,
    which the soft cap (30) bends visibly."""
    return tiny(tmp_path, "recurrent_gemma", transformers.RecurrentGemmaConfig,
                transformers.RecurrentGemmaForCausalLM, {
                    "vocab_size": V, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 4,
                    "num_attention_heads": 4, "num_key_value_heads": 1, "attention_window_size": 8, **over},
                dtype, ("norm.weight", "bias"), tweak=lambda m: m.model.embed_tokens.weight.mul_(4))


def _ids(T=50):
    return torch.randint(0, V, (2, T), generator=torch.Generator().manual_seed(1))


def test_the_loaded_structure(tmp_path):
    _, folder = _hf(tmp_path)
    ours, _ = from_pretrained(folder)
    c = ours.config
    assert c.layers == ["rglru", "rglru", "swa", "rglru"]
    assert (c.mlp_hidden, c.mlp_kind, c.mlp_bias, c.logit_soft_cap, c.n_kv_heads) == (48, "geglu", True, 30.0, 1)
    assert c.embed_scale == 8.0                                   # sqrt(64), exact in bfloat16
    attn = ours.blocks[2].mixer
    assert (attn.window, attn.rotary_dim, attn.n_kv_heads) == (7, 8, 1)  # 8 keys with the query; half of 16 dims


# float64 cannot be tighter than ~1e-7: transformers' RecurrentGemma runs its norms and its scan in float32
def test_the_soft_cap_and_embedding_scale_are_applied(tmp_path):
    hf, folder = _hf(tmp_path)
    ours, _ = from_pretrained(folder)
    with torch.no_grad():
        logits = ours(_ids())
    assert logits.abs().max() < 30
    ours.config.logit_soft_cap = None                             # without the cap: transformers' logits no more
    with torch.no_grad():
        assert (ours(_ids()) - hf(_ids()).logits).abs().max() > 1e-2


def test_a_model_built_here_saves_as_recurrent_gemma(tmp_path):
    from subquad import LanguageModel, ModelConfig
    from subquad.models.hf.recurrent_gemma import embed_scale

    cfg = ModelConfig(vocab_size=V, d_model=32, n_layers=3, n_heads=2, n_kv_heads=1, pattern="rglru,swa,rglru",
                      mlp_size=40, mlp_kind="geglu", mlp_bias=True, embed_scale=embed_scale(32),
                      logit_soft_cap=10.0, mixer_options={"swa": {"window": 5, "o_bias": True, "rotary_fraction": 0.5}})
    model = LanguageModel(cfg).eval()
    save_pretrained(model, tmp_path / "mine")
    c = json.loads((tmp_path / "mine" / "config.json").read_text())
    assert (c["block_types"], c["attention_window_size"]) == (["recurrent", "attention", "recurrent"], 6)
    theirs = transformers.RecurrentGemmaForCausalLM.from_pretrained(tmp_path / "mine").eval()
    with torch.no_grad():
        torch.testing.assert_close(theirs(_ids()).logits, model(_ids()), rtol=0, atol=1e-5)


def test_refusals_name_the_problem(tmp_path):
    from safetensors.torch import load_file

    _, folder = _hf(tmp_path)
    cfg = json.loads((folder / "config.json").read_text())
    for field, value in (("hidden_activation", "gelu"), ("attention_bias", True), ("block_types", ["mlp"]),
                         ("head_dim", 8), ("logits_soft_cap", None)):
        assert_refused(folder, field, {**cfg, field: value})
    (folder / "config.json").write_text(json.dumps(cfg))
    weights = load_file(str(folder / "model.safetensors"))
    w = dict(weights)
    del w["model.layers.1.temporal_block.rg_lru.recurrent_param"]
    assert_refused(folder, "missing.*layers.1.temporal_block.rg_lru.recurrent_param", weights=w)


def test_the_loss_of_a_capped_model_is_the_cross_entropy_of_its_capped_logits(tmp_path):
    _, folder = _hf(tmp_path)
    ours, _ = from_pretrained(folder, dtype=torch.float64)
    ids = _ids()
    targets = ids.roll(-1, 1)
    targets[:, -1] = -100
    with torch.no_grad():
        want = torch.nn.functional.cross_entropy(ours(ids).flatten(0, 1), targets.flatten())
        torch.testing.assert_close(ours(ids, targets=targets), want, rtol=1e-12, atol=0)


def test_the_gemma_options_are_checked_and_no_other_format_drops_them(tmp_path):
    from subquad import LanguageModel, ModelConfig

    for field, value in (("mlp_kind", "relu"), ("mlp_bias", 1), ("embed_scale", -1.0), ("logit_soft_cap", 0.0),
                         ("logit_soft_cap", float("inf"))):
        with pytest.raises(ValueError, match=field):
            ModelConfig(**{field: value})
    jamba = dict(vocab_size=V, d_model=32, n_layers=2, n_heads=2, pattern="mamba,softmax", norm_eps=1e-6,
                 mixer_options={"mamba": {"bcdt_rms_eps": 1e-6, "bcdt_rms_weight": True}, "softmax": {"rotary": False}})
    save_pretrained(LanguageModel(ModelConfig(**jamba)), tmp_path / "plain")     # Jamba's structure saves ...
    for extra in ({"mlp_kind": "geglu"}, {"mlp_bias": True}, {"embed_scale": 2.0}, {"logit_soft_cap": 30.0},
                  {"mixer_options": {**jamba["mixer_options"], "softmax": {"rotary": False, "o_bias": True}}}):
        with pytest.raises(ValueError, match="no Hugging Face model type has this structure"):   # ... not these
            save_pretrained(LanguageModel(ModelConfig(**{**jamba, **extra})), tmp_path / "odd")
