"""Hugging Face checkpoints: a tiny random transformers model, saved and loaded here, gives the same logits,
the same greedy tokens, and comes back through save_pretrained; bad folders are refused by name."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")   # the `hf` extra installs it (make test requires it); the library never does

from subquad.models.hf import from_pretrained  # noqa: E402
from tests.models.hf_harness import assert_refused, tiny  # noqa: E402


KINDS = ["mamba", "falcon_mamba", "mamba2"]


def _hf_mamba(tmp_path, dtype=torch.float32, falcon=False, **over):
    """A tiny random model of ``falcon`` (False: mamba; True: falcon_mamba; or a name of KINDS)."""
    kind = falcon if isinstance(falcon, str) else ("falcon_mamba" if falcon else "mamba")
    if kind == "mamba2":                                   # two groups of two heads, the gated norm per group
        Config, Model = transformers.Mamba2Config, transformers.Mamba2ForCausalLM
        cfg = {"vocab_size": 64, "hidden_size": 32, "num_heads": 4, "head_dim": 16, "n_groups": 2, "state_size": 8,
               "num_hidden_layers": 3, "conv_kernel": 4, "chunk_size": 8}
    else:
        Config, Model = ((transformers.FalconMambaConfig, transformers.FalconMambaForCausalLM) if kind == "falcon_mamba"
                         else (transformers.MambaConfig, transformers.MambaForCausalLM))
        cfg = {"vocab_size": 64, "hidden_size": 32, "state_size": 8, "num_hidden_layers": 3, "expand": 2,
               "conv_kernel": 4, "time_step_rank": 4}
    return tiny(tmp_path, "hf", Config, Model, {**cfg, **over}, dtype,
                noisy=("norm.weight", "norm_f.weight", ".D", "conv1d.bias", "dt_bias"))


def _ids():
    return torch.randint(0, 64, (2, 50), generator=torch.Generator().manual_seed(1))


def _hf_logits(hf, ids):
    """transformers' logits in the model's own dtype (its forward casts them to float32)."""
    return hf.lm_head(hf.backbone(ids).last_hidden_state)


def _loaded(kind):
    """What a mamba folder loads as (the logits cases of test_hf_parity.py)."""
    def check(ours, over):
        assert ours.config.pattern == ("mamba2" if kind == "mamba2" else "mamba")
        assert not ours.config.mlp
    return check


def test_untied_head_and_no_conv_bias(tmp_path):
    hf, folder = _hf_mamba(tmp_path, torch.float64, tie_word_embeddings=False, use_conv_bias=False)
    ours, _ = from_pretrained(folder, dtype=torch.float64)
    assert ours.head is not None
    with torch.no_grad():
        torch.testing.assert_close(ours(_ids()), _hf_logits(hf, _ids()), rtol=0, atol=1e-6)


def test_refusals_name_the_problem(tmp_path):
    from safetensors.torch import load_file

    _, folder = _hf_mamba(tmp_path)
    cfg = json.loads((folder / "config.json").read_text())
    assert_refused(folder, "hidden_act", {**cfg, "hidden_act": "gelu"})
    assert_refused(folder, "model_type 'gpt2' is not supported", {**cfg, "model_type": "gpt2"})
    (folder / "config.json").write_text(json.dumps(cfg))
    weights = load_file(str(folder / "model.safetensors"))
    w = dict(weights)
    del w["backbone.layers.1.mixer.x_proj.weight"]
    assert_refused(folder, "missing.*layers.1.mixer.x_proj", weights=w)
    w = dict(weights)
    w["backbone.layers.0.mixer.A_log"] = torch.zeros(3, 3)
    assert_refused(folder, r"A_log has shape \(3, 3\)", weights=w)
    with pytest.raises(ValueError, match="not a model folder: no such folder"):
        from_pretrained(tmp_path / "nowhere")


def test_cli_generates_from_a_model_folder(tmp_path, capsys):
    from tokenizers import Tokenizer, models, pre_tokenizers

    from subquad.cli import main

    hf, folder = _hf_mamba(tmp_path)
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(64)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(folder / "tokenizer.json"))
    assert main(["generate", "--model", str(folder), "--prompt", "w1 w2 w3", "--max-new-tokens", "8",
                 "--temperature", "0"]) == 0
    out = capsys.readouterr().out
    want = hf.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=8, do_sample=False)[0, 3:].tolist()
    assert tok.decode(want) in out
    assert main(["generate", "--model", str(tmp_path / "none"), "--prompt", "w1"]) == 2
    assert main(["generate", "--prompt", "w1"]) == 2


def test_cli_eval_perplexity_of_a_text_equals_one_forward(tmp_path, capsys):
    import math

    from tokenizers import Tokenizer, models, pre_tokenizers

    from subquad.cli import main

    hf, folder = _hf_mamba(tmp_path)
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(64)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(folder / "tokenizer.json"))
    ids = torch.randint(0, 64, (1, 90), generator=torch.Generator().manual_seed(5))
    text = tmp_path / "t.txt"
    text.write_text(" ".join(f"w{i}" for i in ids[0].tolist()))
    assert main(["eval", "--model", str(folder), "--data", str(text), "--piece", "16"]) == 0
    out = capsys.readouterr().out
    with torch.no_grad():                         # independently: transformers' own forward over the whole text
        nll = torch.nn.functional.cross_entropy(hf(ids).logits[0, :-1], ids[0, 1:]).item()
    import re

    got = float(re.search(r"([0-9.]+) nats/token", out).group(1))
    ppl = float(re.search(r"perplexity ([0-9.]+)", out).group(1))
    assert abs(got - nll) <= 2e-4 and abs(ppl - math.exp(nll)) <= 2e-3 * math.exp(nll)
    assert main(["eval", "--model", str(folder), "--data", str(tmp_path / "missing.txt")]) == 2
