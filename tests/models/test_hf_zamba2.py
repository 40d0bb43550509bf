"""Hugging Face Zyphra Zamba2 (``zamba2``): Mamba-2 layers and shared attention + MLP blocks over [h,
embeddings] used round-robin at the hybrid layers, each use with its own LoRA adapters, projection and KV
cache (``models.shared``) - tiny random transformers models give transformers' logits and greedy tokens, the
shared weights are one parameter each, come back through save_pretrained under every name transformers
gives them, and what subquad cannot hold is refused by name."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")   # the `hf` extra installs it (make test requires it); the library never does

from subquad.models.hf import from_pretrained, save_pretrained  # noqa: E402
from tests.models.hf_harness import assert_refused  # noqa: E402

V = 96
TYPES = ["mamba", "hybrid", "mamba", "hybrid", "hybrid", "mamba"]      # uses 0, 1, 2 of blocks 0, 1, 0
# the other options: no rotary, no attention adapters, one block, SiLU, an untied head, grouped kv heads
PLAIN = {"use_mem_rope": False, "use_shared_attention_adapter": False, "num_mem_blocks": 1, "hidden_act": "silu",
         "tie_word_embeddings": False, "num_key_value_heads": 2}


def _hf(tmp_path, dtype=torch.float32, **over):
    """A tiny random model: 6 layers, 2 shared blocks, adapters of rank 4 on q, k, v and the MLP, rotary; Mamba-2
    of 4 heads in 2 groups."""
    torch.manual_seed(0)
    cfg = transformers.Zamba2Config(**{
        "vocab_size": V, "hidden_size": 32, "num_hidden_layers": len(TYPES), "layers_block_type": TYPES,
        "mamba_d_state": 8, "n_mamba_heads": 4, "mamba_ngroups": 2, "num_attention_heads": 4, "num_mem_blocks": 2,
        "adapter_rank": 4, "use_shared_attention_adapter": True, "use_mem_rope": True, "intermediate_size": 40,
        "rope_parameters": {"rope_type": "default", "rope_theta": 5000.0}, "chunk_size": 16,
        "bos_token_id": None, "eos_token_id": None, "pad_token_id": None, **over})
    model = transformers.Zamba2ForCausalLM(cfg).to(dtype).eval()
    with torch.no_grad():                     # non-trivial norms, D, dt and conv biases; adapters that matter
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", "layernorm.weight", ".D", "conv1d.bias", "dt_bias")):
                p.add_(torch.randn_like(p) * 0.3)
            elif "adapter_list" in name:
                p.normal_(0, 0.2)
        layers, blocks = model.model.layers, cfg.num_mem_blocks     # transformers ties the uses' blocks only with a
        hybrid = [i for i, t in enumerate(cfg.layers_block_type) if t == "hybrid"]   # tied head: untied, their
        # copies made equal
        for j, i in enumerate(hybrid[blocks:], blocks):
            layers[i].shared_transformer.load_state_dict(layers[hybrid[j % blocks]].shared_transformer.state_dict())
    folder = tmp_path / "zamba2"
    model.save_pretrained(folder)
    return model, folder


def _ids(T=40):
    return torch.randint(0, V, (2, T), generator=torch.Generator().manual_seed(1))


LOGITS = ROUND_TRIP = {"rotary-adapters-2-blocks": {}, "plain-gqa-untied": PLAIN}


def _loaded(ours, over):
    """The logits cases of test_hf_parity.py: attention adapters only without PLAIN."""
    assert (ours.blocks[1].use.q_adapter is None) == bool(over)


def _saved(hf, ours, c, over, folder):
    """The round trip's folder (test_hf_parity.py) holds every name of transformers' state dict - each shared
    weight and adapter under every hybrid layer that uses its block - and loads in transformers with nothing
    missing or unexpected."""
    from safetensors.torch import load_file

    written = set(load_file(str(folder / "model.safetensors")))
    assert written == set(hf.state_dict()) - ({"lm_head.weight"} if not over else set())
    _, info = transformers.Zamba2ForCausalLM.from_pretrained(folder, output_loading_info=True)
    assert not any(info.values())
    assert c["layers_block_type"] == TYPES and c["chunk_size"] == 16          # a field subquad does not use, kept


def test_the_loaded_structure_shares_one_parameter_per_weight(tmp_path):
    _, folder = _hf(tmp_path)
    ours, _ = from_pretrained(folder)
    s = ours.config.shared
    assert ours.config.layers == ["mamba2"] * 6 and not ours.config.mlp
    assert s["layers"] == [1, 3, 4] and s["blocks"] == 2 and s["act"] == "gelu" and s["rotary"]
    assert s["scale"] == (16 / 2) ** -0.5                     # heads of 2 x 32 / 4 = 16 dims
    b1, b3, b4 = ours.blocks[1].use, ours.blocks[3].use, ours.blocks[4].use
    assert b1.shared is ours.shared[0] and b3.shared is ours.shared[1] and b4.shared is ours.shared[0]
    assert b1.shared.attn.q_proj.weight is b4.shared.attn.q_proj.weight          # one object, not copies
    assert b1.q_adapter[0].weight is not b4.q_adapter[0].weight                   # the adapters: each use's own
    assert sum(k.startswith("shared.") for k in ours.state_dict()) == 2 * 9       # each shared weight named once
    assert not hasattr(ours.blocks[0], "use")
    with torch.no_grad():
        _, state = ours.prefill(_ids()[:, :7])
    kv = [state[i]["kv"] for i in (1, 3, 4)]                 # a KV cache per use, not per block
    assert set(state[1]) == {"ssm", "conv", "kv"} and "kv" not in state[0]
    assert len({id(c) for c in kv}) == 3 and all(c.seen == 7 for c in kv)
    assert not torch.equal(kv[0].k, kv[2].k)                  # block 0's two uses: their own adapters, inputs


def test_a_state_is_reused_unchanged_and_bfloat16_trains(tmp_path):
    """Two continuations from one state agree and leave it as it was (each use's KV cache forks); in bfloat16
    the logits are float32's within its rounding, and a backward pass reaches every weight, shared ones once."""
    _, folder = _hf(tmp_path)
    ours, _ = from_pretrained(folder)
    ids = _ids()
    with torch.no_grad():
        _, state = ours.prefill(ids[:, :10])
        kept = [{k: (v.k.clone(), v.seen) if k == "kv" else v.clone() for k, v in s.items()} for s in state]
        a, _ = ours.prefill(ids[:, 10:14], state)
        b, _ = ours.prefill(ids[:, 10:14], state)
        ref = ours(ids)
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    for s, k in zip(state, kept):
        for key, v in s.items():
            if key == "kv":
                assert v.seen == k[key][1] and torch.equal(v.k, k[key][0])
            else:
                assert torch.equal(v, k[key])
    b16, _ = from_pretrained(folder, dtype="bfloat16")
    got = b16(ids)
    assert got.dtype == torch.bfloat16 and ((got.float() - ref).abs().max() / ref.abs().max()).item() < 0.05
    b16.train()
    b16(ids, targets=ids).backward()
    grads = {n: p.grad for n, p in b16.named_parameters()}
    assert all(g is not None and bool(torch.isfinite(g).all()) for g in grads.values())
    assert len(grads) == len(b16.state_dict())                 # each shared weight one parameter


def test_aliases_load_once_and_copies_that_differ_are_refused(tmp_path):
    """transformers writes a shared block under its first layer only; a folder with every alias (as
    save_pretrained writes) loads the same; an alias unlike its original is no shared weight."""
    from safetensors.torch import load_file, save_file

    hf, folder = _hf(tmp_path)
    ours, _ = from_pretrained(folder)
    w = load_file(str(folder / "model.safetensors"))
    assert not any(k.startswith("model.layers.4.shared_transformer") for k in w)
    full = {k: v.clone() for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    save_file(full, str(folder / "model.safetensors"))
    again, _ = from_pretrained(folder)
    with torch.no_grad():
        torch.testing.assert_close(again(_ids()), ours(_ids()), rtol=0, atol=0)
    name = "model.layers.4.shared_transformer.self_attn.linear_q_adapter_list.2.1.weight"
    full[name] = full[name] + 1
    assert_refused(folder, f"{name} differs from model.layers.1.shared_transformer", weights=full)


def test_a_model_built_here_saves_as_zamba2_and_others_do_not(tmp_path):
    """Shared blocks: only zamba2 holds them (mamba2's structure otherwise); transformers reads the folder."""
    from subquad import LanguageModel, ModelConfig

    cfg = ModelConfig(vocab_size=V, d_model=32, n_layers=3, n_heads=4, pattern="mamba2", mlp=False, norm_eps=1e-5,
                      mixer_options={"mamba2": {"norm_eps": 1e-5, "head_dim": 16, "d_state": 8,
                                                "dt_limit": (1e-3, float("inf"))}},
                      shared={"layers": [0, 2], "hidden": 48, "adapter_rank": 2, "scale": (32 / 4) ** -0.5})
    model = LanguageModel(cfg).eval()
    save_pretrained(model, tmp_path / "mine")
    c = json.loads((tmp_path / "mine" / "config.json").read_text())
    assert c["model_type"] == "zamba2" and c["layers_block_type"] == ["hybrid", "mamba", "hybrid"]
    theirs = transformers.Zamba2ForCausalLM.from_pretrained(tmp_path / "mine").eval()
    with torch.no_grad():
        torch.testing.assert_close(theirs(_ids()).logits, model(_ids()), rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="cannot be written as model_type 'mamba2'"):
        save_pretrained(model, tmp_path / "m", model_type="mamba2")


def test_cli_generates_transformers_tokens(tmp_path, capsys):
    """``subquad generate --model`` on the folder gives transformers' greedy tokens (the compiled decode step:
    tests/models/test_decode.py)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from subquad.cli import main

    hf, folder = _hf(tmp_path)
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(V)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(folder / "tokenizer.json"))
    assert main(["generate", "--model", str(folder), "--prompt", "w1 w2 w3", "--max-new-tokens", "8",
                 "--temperature", "0"]) == 0
    want = hf.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=8, do_sample=False)[0, 3:].tolist()
    assert tok.decode(want) in capsys.readouterr().out


def test_refusals_name_the_problem(tmp_path):
    from safetensors.torch import load_file

    _, folder = _hf(tmp_path)
    cfg = json.loads((folder / "config.json").read_text())
    for field, value in (("add_bias_linear", True), ("hidden_act", "relu"), ("n_mamba_heads", 5),
                         ("mamba_ngroups", 3), ("num_key_value_heads", 2), ("adapter_rank", 0),
                         ("num_hidden_layers", 5), ("layers_block_type", ["mamba", "attention"] * 3),
                         ("rope_parameters.rope_type", {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4})):
        key = field.split(".")[0]
        assert_refused(folder, field, {**cfg, key: value})
    (folder / "config.json").write_text(json.dumps(cfg))
    w = load_file(str(folder / "model.safetensors"))
    del w["model.layers.3.linear.weight"]
    assert_refused(folder, r"missing.*model\.layers\.3\.linear\.weight", weights=w)
