"""Hugging Face Zyphra Zamba v1 (``zamba``): multi-head Mamba layers and one shared attention + MLP block over [h,
embeddings] at the hybrid layers, each use with its own projection and KV cache - the parity checks are rows of
test_hf_parity.py; here what is the type's alone: the structure loaded, the interleaved in_proj, aliases and
what is refused by name."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")   # the `hf` extra installs it (make test requires it); the library never does

from subquad.models.hf import from_pretrained, save_pretrained  # noqa: E402
from tests.models.hf_harness import assert_refused  # noqa: E402

V = 96
TYPES = ["mamba", "hybrid", "mamba", "hybrid", "mamba"]
# the other options: SiLU, an untied head (transformers then unties the shared block's copies), grouped kv heads
PLAIN = {"hidden_act": "silu", "tie_word_embeddings": False, "num_key_value_heads": 2}


def _hf(tmp_path, dtype=torch.float32, **over):
    """A tiny random model: 5 layers, two uses of the shared block (2 x 32 wide attention in 4 heads), Mamba of 2
    heads with a time-step rank of 3."""
    torch.manual_seed(0)
    cfg = transformers.ZambaConfig(**{
        "vocab_size": V, "hidden_size": 32, "num_hidden_layers": len(TYPES), "layers_block_type": TYPES,
        "mamba_d_state": 8, "n_mamba_heads": 2, "mamba_dt_rank": 3, "num_attention_heads": 4,
        "num_key_value_heads": 4, "intermediate_size": 40, "bos_token_id": None, "eos_token_id": None,
        "pad_token_id": None, **over})
    model = transformers.ZambaForCausalLM(cfg).to(dtype).eval()
    with torch.no_grad():                     # non-trivial norms, D, dt and conv biases
        for name, p in model.named_parameters():
            if name.endswith(("layernorm.weight", ".D", "conv1d.bias", "dt_proj_bias")):
                p.add_(torch.randn_like(p) * 0.3)
        layers = model.model.layers          # untied, the copies of the shared block made equal
        for i in [i for i, t in enumerate(cfg.layers_block_type) if t == "hybrid"][1:]:
            layers[i].shared_transf.load_state_dict(layers[1].shared_transf.state_dict())
    folder = tmp_path / "zamba"
    model.save_pretrained(folder)
    return model, folder


def _ids(T=40):
    return torch.randint(0, V, (2, T), generator=torch.Generator().manual_seed(1))


LOGITS = ROUND_TRIP = {"tied": {}, "plain-gqa-untied": PLAIN}


def _loaded(ours, over):
    """The logits cases of test_hf_parity.py: one shared block, two uses, two-head Mamba."""
    assert ours.config.shared["layers"] == [1, 3] and ours.config.shared["blocks"] == 1
    assert ours.blocks[0].mixer.heads == 2 and ours.blocks[1].use.q_adapter is None


def _saved(hf, ours, c, over, folder):
    """The round trip's folder (test_hf_parity.py) loads in transformers with nothing missing or unexpected."""
    _, info = transformers.ZambaForCausalLM.from_pretrained(folder, output_loading_info=True)
    assert not any(info.values())
    assert c["layers_block_type"] == TYPES and c["n_mamba_heads"] == 2


def test_the_loaded_structure_and_the_interleaved_in_proj(tmp_path):
    """One parameter per shared weight, a KV cache per use; in_proj's rows x0, z0, x1, z1, ... de-interleaved."""
    hf, folder = _hf(tmp_path)
    ours, _ = from_pretrained(folder)
    assert ours.config.layers == ["mamba"] * 5 and not ours.config.mlp
    assert ours.blocks[1].use.shared is ours.blocks[3].use.shared
    assert ours.blocks[1].use.proj.weight is not ours.blocks[3].use.proj.weight
    assert sum(k.startswith("shared.") for k in ours.state_dict()) == 9
    w = hf.model.layers[0].mamba.in_proj.weight
    torch.testing.assert_close(ours.blocks[0].mixer.in_proj.weight[:64], w[0::2], rtol=0, atol=0)
    with torch.no_grad():
        _, state = ours.prefill(_ids()[:, :7])
    assert set(state[1]) == {"ssm", "conv", "kv"} and "kv" not in state[0] and state[1]["kv"].seen == 7
    assert state[0]["ssm"].shape == (2, 64, 8)


def test_refusals_name_the_problem(tmp_path):
    from safetensors.torch import load_file

    _, folder = _hf(tmp_path)
    cfg = json.loads((folder / "config.json").read_text())
    for field, value in (("mamba_proj_bias", True), ("hidden_mamba_act", "gelu"), ("hidden_act", "relu"),
                         ("n_mamba_heads", 3), ("num_key_value_heads", 3), ("attention_head_dim", 8),
                         ("attention_hidden_size", 32), ("num_hidden_layers", 4),
                         ("layers_block_type", ["mamba", "attention"] * 2 + ["mamba"])):
        assert_refused(folder, field, {**cfg, field: value})
    (folder / "config.json").write_text(json.dumps(cfg))
    w = load_file(str(folder / "model.safetensors"))
    del w["model.layers.3.linear.weight"]
    assert_refused(folder, r"missing.*model\.layers\.3\.linear\.weight", weights=w)



def test_a_model_built_here_with_mamba_heads_saves_as_zamba(tmp_path):
    """Multi-head Mamba (``heads``) with a shared block saves as zamba, which transformers reads with our logits;
    without one no type holds it (transformers' Zamba needs a hybrid layer; with tied embeddings two), with one
    head it is a mamba folder."""
    from subquad import LanguageModel, ModelConfig

    def model(heads, shared):
        return LanguageModel(ModelConfig(
            vocab_size=V, d_model=32, n_layers=3, n_heads=4, pattern="mamba", mlp=False, norm_eps=1e-5,
            mixer_options={"mamba": {"heads": heads, "d_state": 8}},
            shared={"layers": [1, 2], "hidden": 48, "scale": 8 ** -0.5} if shared else None)).eval()

    mine = model(2, True)
    save_pretrained(mine, tmp_path / "zamba")
    assert json.loads((tmp_path / "zamba" / "config.json").read_text())["model_type"] == "zamba"
    theirs = transformers.ZambaForCausalLM.from_pretrained(tmp_path / "zamba").eval()
    with torch.no_grad():
        torch.testing.assert_close(theirs(_ids()).logits, mine(_ids()), rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="no Hugging Face model type"):
        save_pretrained(model(2, False), tmp_path / "none")
    save_pretrained(model(1, False), tmp_path / "mamba")
    assert json.loads((tmp_path / "mamba" / "config.json").read_text())["model_type"] == "mamba"
