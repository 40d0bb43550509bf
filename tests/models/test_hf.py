"""Hugging Face checkpoints: a tiny random transformers model, saved and loaded here, gives the same logits,
the same greedy tokens, and comes back through save_pretrained; bad folders are refused by name."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")   # the `hf` extra installs it (make test requires it); the library never does

from subquad.models.hf import from_pretrained, save_pretrained  # noqa: E402


KINDS = ["mamba", "falcon_mamba", "mamba2"]


def _hf_mamba(tmp_path, dtype=torch.float32, falcon=False, **over):
    """A tiny random model of ``falcon`` (False: mamba; True: falcon_mamba; or a name of KINDS)."""
    torch.manual_seed(0)
    kind = falcon if isinstance(falcon, str) else ("falcon_mamba" if falcon else "mamba")
    if kind == "mamba2":                                   # two groups of two heads, the gated norm per group
        cfg = transformers.Mamba2Config(**{"vocab_size": 64, "hidden_size": 32, "num_heads": 4, "head_dim": 16,
                                           "n_groups": 2, "state_size": 8, "num_hidden_layers": 3, "conv_kernel": 4,
                                           "chunk_size": 8, **over})
        model = transformers.Mamba2ForCausalLM(cfg)
    else:
        Config, Model = ((transformers.FalconMambaConfig, transformers.FalconMambaForCausalLM) if kind == "falcon_mamba"
                         else (transformers.MambaConfig, transformers.MambaForCausalLM))
        cfg = Config(**{"vocab_size": 64, "hidden_size": 32, "state_size": 8, "num_hidden_layers": 3, "expand": 2,
                        "conv_kernel": 4, "time_step_rank": 4, **over})
        model = Model(cfg)
    model = model.to(dtype).eval()
    with torch.no_grad():                                  # non-trivial norms, D, dt and conv biases
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", "norm_f.weight", ".D", "conv1d.bias", "dt_bias")):
                p.add_(torch.randn_like(p) * 0.3)
    folder = tmp_path / "hf"
    model.save_pretrained(folder)
    return model, folder


def _ids():
    return torch.randint(0, 64, (2, 50), generator=torch.Generator().manual_seed(1))


def _hf_logits(hf, ids):
    """transformers' logits in the model's own dtype (its forward casts them to float32)."""
    return hf.lm_head(hf.backbone(ids).last_hidden_state)


def assert_prefill_then_decode_equals_forward(ours, ids, split=12):
    """Prefill ``split`` tokens, then decode the rest one at a time: the full forward's logits (1e-10)."""
    with torch.no_grad():
        full = ours(ids)
        logits, state = ours.prefill(ids[:, :split])
        steps = [logits]
        for t in range(split, ids.shape[1]):
            lt, state = ours.prefill(ids[:, t:t + 1], state)
            steps.append(lt)
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=0, atol=1e-10)


def assert_logits_equal(ours, hf, ids, dtype, tol):
    """Our logits over ``ids`` are in ``dtype`` and equal transformers' within ``tol`` of their largest."""
    with torch.no_grad():
        ref = hf(ids).logits.to(dtype)
        got = ours(ids)
    assert got.dtype == dtype
    assert ((got - ref).abs().max() / ref.abs().max()).item() <= tol


def assert_packed_equals_separate(ours, two):
    """Rows 0 and 1 of ``two`` packed in one row (13 + 20 tokens; positions restart) give each one's logits."""
    with torch.no_grad():
        cu = torch.tensor([0, 13, 33])
        packed = ours(torch.cat([two[0, :13], two[1, :20]]).view(1, -1), cu_seqlens=cu)
        torch.testing.assert_close(packed[0, :13], ours(two[:1, :13])[0], rtol=0, atol=1e-10)
        torch.testing.assert_close(packed[0, 13:], ours(two[1:, :20])[0], rtol=0, atol=1e-10)


def assert_round_trip(hf, ours, Model, folder, ids, model_type):
    """``save_pretrained(ours)`` is a ``model_type`` folder that transformers' ``Model`` loads with hf's logits
    (1e-5) and that subquad loads back unchanged."""
    save_pretrained(ours, folder)
    again = Model.from_pretrained(folder, experts_implementation="eager").eval()
    assert json.loads((folder / "config.json").read_text())["model_type"] == model_type
    ours2, _ = from_pretrained(folder)
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits, hf(ids).logits, rtol=0, atol=1e-5)
        torch.testing.assert_close(ours2(ids), ours(ids), rtol=0, atol=0)


def greedy_agreement(ours, hf, ids, hf_logits, n=32):
    """Our n greedy tokens after ``ids`` (1, T): each must be transformers' greedy choice under its own
    forward (``hf_logits``); returns how many equal its ``generate`` before that leaves its own forward."""
    T = ids.shape[1]
    want = hf.generate(ids, max_new_tokens=n, do_sample=False)[0, T:].tolist()
    got, _ = ours.generate(ids[0].tolist(), n, temperature=0)
    with torch.no_grad():
        hl = hf_logits(torch.tensor([ids[0].tolist() + got]))[0, T - 1:-1]
    agree = 0
    for t, token in enumerate(got):
        assert hl[t, token] >= hl[t].max() - 1e-6 * hl[t].abs().max(), f"step {t}: not transformers' greedy token"
        if want[t] != token:       # transformers' cached decoding left its own forward, not us
            assert hl[t, want[t]] < hl[t].max(), f"step {t}: transformers' generate and forward agree, we do not"
            break
        agree += 1
    return agree


# float64 cannot be tighter than ~1e-7: transformers' Mamba computes A = -exp(A_log.float()) in float32
@pytest.mark.parametrize("falcon", KINDS)
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.float64, 1e-6)])
def test_mamba_logits_equal_transformers(tmp_path, dtype, tol, falcon):
    hf, folder = _hf_mamba(tmp_path, dtype, falcon)
    ours, tok = from_pretrained(folder, dtype=dtype)
    assert tok is None and ours.config.pattern == ("mamba2" if falcon == "mamba2" else "mamba")
    assert not ours.config.mlp
    with torch.no_grad():
        ref = _hf_logits(hf, _ids())
        got = ours(_ids())
    assert got.dtype == ref.dtype == dtype
    assert ((got - ref).abs().max() / ref.abs().max()).item() <= tol


@pytest.mark.parametrize("falcon", KINDS)
def test_mamba_prefill_then_decode_equals_forward_and_greedy_equals_generate(tmp_path, falcon):
    hf, folder = _hf_mamba(tmp_path, torch.float64, falcon)
    ours, _ = from_pretrained(folder, dtype=torch.float64)
    ids = _ids()[:1, :20]
    assert_prefill_then_decode_equals_forward(ours, ids)
    # Every token is transformers' greedy choice under its own full forward over the sequence so far. Its
    # cached decoding can depart from that forward: for mamba2 here (float64) it picked token 30 where its
    # forward has 53 ahead by 2e-4 - so `generate` is compared up to where it leaves its own forward.
    agree = greedy_agreement(ours, hf, ids, lambda x: _hf_logits(hf, x))
    assert agree >= (29 if falcon == "mamba2" else 32)


@pytest.mark.parametrize("falcon", KINDS)
def test_save_pretrained_round_trip_loads_in_transformers(tmp_path, falcon):
    hf, folder = _hf_mamba(tmp_path, falcon=falcon)
    ours, _ = from_pretrained(folder)
    save_pretrained(ours, tmp_path / "back")
    Model = {"mamba": transformers.MambaForCausalLM, "falcon_mamba": transformers.FalconMambaForCausalLM,
             "mamba2": transformers.Mamba2ForCausalLM}[falcon]
    again = Model.from_pretrained(tmp_path / "back").eval()
    assert json.loads((tmp_path / "back" / "config.json").read_text())["model_type"] == type(hf).config_class.model_type
    ours2, _ = from_pretrained(tmp_path / "back")
    with torch.no_grad():
        ref = hf(_ids()).logits
        torch.testing.assert_close(again(_ids()).logits, ref, rtol=0, atol=1e-6)
        torch.testing.assert_close(ours2(_ids()), ours(_ids()), rtol=0, atol=0)


def test_untied_head_and_no_conv_bias(tmp_path):
    hf, folder = _hf_mamba(tmp_path, torch.float64, tie_word_embeddings=False, use_conv_bias=False)
    ours, _ = from_pretrained(folder, dtype=torch.float64)
    assert ours.head is not None
    with torch.no_grad():
        torch.testing.assert_close(ours(_ids()), _hf_logits(hf, _ids()), rtol=0, atol=1e-6)


def test_refusals_name_the_problem(tmp_path):
    from safetensors.torch import load_file, save_file

    _, folder = _hf_mamba(tmp_path)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "hidden_act": "gelu"}))
    with pytest.raises(ValueError, match="hidden_act"):
        from_pretrained(folder)
    (folder / "config.json").write_text(json.dumps({**cfg, "model_type": "gpt2"}))
    with pytest.raises(ValueError, match="model_type 'gpt2' is not supported"):
        from_pretrained(folder)
    (folder / "config.json").write_text(json.dumps(cfg))
    weights = load_file(str(folder / "model.safetensors"))
    w = dict(weights)
    del w["backbone.layers.1.mixer.x_proj.weight"]
    save_file(w, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match="missing.*layers.1.mixer.x_proj"):
        from_pretrained(folder)
    w = dict(weights)
    w["backbone.layers.0.mixer.A_log"] = torch.zeros(3, 3)
    save_file(w, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match=r"A_log has shape \(3, 3\)"):
        from_pretrained(folder)
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
