"""The checkpoint user's path: a saved folder is complete (tokenizer, generation config, every config field
kept) and runs the same in subquad and transformers; wrong config types, broken files, dtype names, hub ids
and non-finite weights each get one line naming the field or file."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")   # the `hf` extra installs it (make test requires it)

from safetensors.torch import load_file, save_file  # noqa: E402

from subquad.models.hf import from_pretrained  # noqa: E402
from tests.models.test_hf import _hf_mamba  # noqa: E402
from tests.models.test_hf_hybrid import _hf as _hf_hybrid  # noqa: E402


def _tokenizer_files(folder, eos: int):
    """A word-level tokenizer over w00..w63 with a chat template and a generation config naming ``eos``. The words
    have one length: transformers splits the special tokens out of any word they begin, as added tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"w{i:02d}": i for i in range(64)}, unk_token="w00"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["w00", "w01", f"w{eos:02d}"])          # as a real tokenizer.json declares them
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": f"w{eos:02d}", "bos_token": "w01", "pad_token": "w00",
        "chat_template": "{% for m in messages %}{{ m['content'] }} {% endfor %}"}))
    (folder / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": eos,
                                                              "pad_token_id": 0}))
    return tok


def test_a_saved_folder_is_complete_and_generates_as_transformers(tmp_path, capsys):
    from subquad.cli import main

    hf, folder = _hf_mamba(tmp_path, falcon="mamba2")
    prompt = [5, 9, 3]
    free = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)[0, 3:].tolist()
    eos = next(t for i, t in enumerate(free) if i > 1 and t not in free[:i])      # stops after a few tokens
    _tokenizer_files(folder, eos)
    source = json.loads((folder / "config.json").read_text())
    model, tok = from_pretrained(folder)
    out = tmp_path / "saved"
    model.save_pretrained(out)

    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "config.json",
                 "model.safetensors"):
        assert (out / name).is_file(), name
    assert json.loads((out / "tokenizer_config.json").read_text())["chat_template"].startswith("{% for")
    saved = json.loads((out / "config.json").read_text())
    for key in ("max_position_embeddings", "chunk_size", "bos_token_id", "pad_token_id", "time_step_limit"):
        if key in source:
            assert saved[key] == source[key], key
    assert saved["eos_token_id"] == eos

    # both stop at the same end-of-text token: transformers on the saved folder, `subquad generate` on it
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    want = theirs.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)[0, 3:].tolist()
    assert want[-1] == eos and len(want) < 12
    ours, _ = from_pretrained(out)
    got, _ = ours.generate(prompt, 12, temperature=0)
    assert got == want
    assert main(["generate", "--model", str(out), "--prompt", "w05 w09 w03", "--max-new-tokens", "12",
                 "--temperature", "0"]) == 0
    assert tok.decode(want) in capsys.readouterr().out


def test_a_model_trained_here_saves_its_tokenizer(tmp_path):
    from tokenizers import Tokenizer

    from subquad.models import LanguageModel, ModelConfig

    tok = _tokenizer_files(tmp_path, 7)
    model = LanguageModel(ModelConfig(vocab_size=64, d_model=32, n_layers=2, pattern="mamba2", mlp=False,
                                      n_heads=2, tie_embeddings=False, eos_token_ids=[7]))
    model.save_pretrained(tmp_path / "out", tokenizer=tok)
    back = Tokenizer.from_file(str(tmp_path / "out" / "tokenizer.json"))
    assert back.encode("w03 w09").ids == [3, 9]
    assert json.loads((tmp_path / "out" / "generation_config.json").read_text())["eos_token_id"] == 7


@pytest.mark.parametrize("field, value, says", [
    ("hidden_size", "32", "field hidden_size must be an int, got '32'"),
    ("hidden_size", None, "field hidden_size is null"),
    ("num_hidden_layers", 2.5, "field num_hidden_layers must be an int"),
    ("layer_norm_epsilon", "1e-5", "field layer_norm_epsilon must be a number, got '1e-5'"),
    ("tie_word_embeddings", "false", "field tie_word_embeddings must be a bool"),
    ("vocab_size", True, "field vocab_size must be an int, got True"),
])
def test_config_fields_of_the_wrong_type_are_named(tmp_path, field, value, says):
    _, folder = _hf_mamba(tmp_path, falcon="mamba2")
    c = json.loads((folder / "config.json").read_text())
    c[field] = value
    (folder / "config.json").write_text(json.dumps(c))
    with pytest.raises(ValueError, match=says.replace("(", r"\(")):
        from_pretrained(folder)


def test_a_list_field_given_as_a_string_is_named(tmp_path):
    _, folder = _hf_hybrid(tmp_path, "bamba")
    c = json.loads((folder / "config.json").read_text())
    c["attn_layer_indices"] = "1"
    (folder / "config.json").write_text(json.dumps(c))
    with pytest.raises(ValueError, match="field attn_layer_indices must be a list of ints, got '1'"):
        from_pretrained(folder)
    c["attn_layer_indices"] = [1]
    c["rope_parameters"] = {"rope_theta": "10000", "rope_type": "default"}
    (folder / "config.json").write_text(json.dumps(c))
    with pytest.raises(ValueError, match="field rope_parameters.rope_theta must be a number"):
        from_pretrained(folder)


def test_broken_files_are_named(tmp_path):
    _, folder = _hf_mamba(tmp_path, falcon="mamba2")
    weights = folder / "model.safetensors"
    whole = weights.read_bytes()
    weights.write_bytes(whole[: len(whole) // 2])                       # truncated
    with pytest.raises(ValueError, match=r"model\.safetensors: not a readable safetensors file"):
        from_pretrained(folder)

    tensors = load_file_from_bytes(whole, tmp_path)                      # two shards, one of them missing
    names = sorted(tensors)
    save_file({n: tensors[n] for n in names[:3]}, str(folder / "model-00001-of-00002.safetensors"))
    weights.unlink()
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        n: "model-00001-of-00002.safetensors" if i < 3 else "model-00002-of-00002.safetensors"
        for i, n in enumerate(names)}}))
    with pytest.raises(ValueError, match=r"model-00002-of-00002\.safetensors: the shard is missing"):
        from_pretrained(folder)

    (folder / "config.json").write_text('{"model_type": "mamba2", ')   # invalid JSON
    with pytest.raises(ValueError, match=r"config\.json: not valid JSON"):
        from_pretrained(folder)
    (folder / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match=r"config\.json: must hold a JSON object"):
        from_pretrained(folder)


@pytest.mark.parametrize("shard", ["../outside.safetensors", "ABSOLUTE", "sub/../../outside.safetensors", 7])
def test_a_shard_name_leaving_the_folder_is_refused(tmp_path, shard):
    """The index is data from whoever published the folder: a shard named ../x or /x would open a file outside
    it (here a readable safetensors file, so nothing else stops the load)."""
    _, folder = _hf_mamba(tmp_path, falcon="mamba2")
    outside = tmp_path / "outside.safetensors"
    outside.write_bytes((folder / "model.safetensors").read_bytes())
    (folder / "sub").mkdir()
    (folder / "model.safetensors").unlink()
    shard = str(outside) if shard == "ABSOLUTE" else shard
    names = load_file(str(outside))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {n: shard for n in names}}))
    with pytest.raises(ValueError, match=r"model\.safetensors\.index\.json: .*shard " + re.escape(repr(shard))):
        from_pretrained(folder)


def test_saving_over_a_sharded_folder_leaves_one_set_of_weights(tmp_path):
    """transformers saved model A in shards; subquad's save_pretrained of model B into the same folder removes
    A's index and shards (two sets of weights once loaded A here, B in transformers); a folder holding both a
    single file and an index is read as transformers reads it: the single file."""
    from subquad.models.hf import save_pretrained

    hf_a, folder = _hf_mamba(tmp_path, falcon="mamba2")
    (folder / "model.safetensors").unlink()
    hf_a.save_pretrained(folder, max_shard_size="20KB")
    assert (folder / "model.safetensors.index.json").exists() and not (folder / "model.safetensors").exists()
    model_b, _ = from_pretrained(folder)
    with torch.no_grad():
        for p in model_b.parameters():
            p.add_(0.01 * torch.randn_like(p))
    save_pretrained(model_b, folder)
    assert not (folder / "model.safetensors.index.json").exists() and not list(folder.glob("model-*-of-*"))
    idx = torch.randint(0, 64, (1, 7), generator=torch.Generator().manual_seed(0))
    want = model_b(idx)
    torch.testing.assert_close(from_pretrained(folder)[0](idx), want, rtol=0, atol=0)
    with torch.no_grad():
        torch.testing.assert_close(transformers.AutoModelForCausalLM.from_pretrained(folder)(idx).logits, want,
                                   rtol=1e-5, atol=1e-5)
    hf_a.save_pretrained(tmp_path / "a", max_shard_size="20KB")        # an index beside the single file: not read
    for f in (tmp_path / "a").glob("model*"):
        (folder / f.name).write_bytes(f.read_bytes())
    torch.testing.assert_close(from_pretrained(folder)[0](idx), want, rtol=0, atol=0)


def load_file_from_bytes(data: bytes, tmp_path):
    f = tmp_path / "whole.safetensors"
    f.write_bytes(data)
    return load_file(str(f))


def test_non_finite_weights_are_refused_by_name(tmp_path):
    _, folder = _hf_mamba(tmp_path, falcon="mamba2")
    w = load_file(str(folder / "model.safetensors"))
    w["backbone.layers.1.mixer.dt_bias"][2] = float("nan")
    save_file(w, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match=r"weight backbone\.layers\.1\.mixer\.dt_bias holds NaN or inf"):
        from_pretrained(folder)


def test_the_blockwise_finite_check_finds_every_nan_and_inf():
    """``all_finite`` checks a block at a time (to not allocate the tensor's size three times over): a bad value
    in the first, a middle or the last, short block is found, as torch.isfinite on the whole tensor finds it."""
    from subquad.models.hf.common import all_finite

    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        t = torch.randn(5, 13, generator=g).to(dtype)          # 65 elements: blocks of 8 leave one of 1
        assert all_finite(t, block=8) and all_finite(t)
        for i in (0, 7, 8, 33, 63, 64):
            for bad in (float("nan"), float("inf"), -float("inf")):
                u = t.clone()
                u.view(-1)[i] = bad
                assert not all_finite(u, block=8) and not bool(torch.isfinite(u).all()), (dtype, i, bad)
        assert not all_finite(t.T.contiguous().T.clone().fill_(float("nan")), block=8)   # column-major too
    assert all_finite(torch.empty(0, 3))


def test_an_untied_embedding_is_mapped_and_its_file_never_written(tmp_path):
    """An untied embedding (only looked up) is a view of a private map of model.safetensors, row-major; the
    head and the wide projections are column-major copies (``decode_layout``). The logits are transformers';
    writing into the embedding changes the model, not the file, and saving over the folder the model was
    mapped from keeps what was written. NaN in the mapped embedding is refused by name, as any weight."""
    import sys

    from subquad.models.hf import save_pretrained

    hf, folder = _hf_mamba(tmp_path, falcon="mamba2", tie_word_embeddings=False)
    model, _ = from_pretrained(folder)
    file = folder / "model.safetensors"
    if sys.platform.startswith("linux"):
        assert str(file) in Path("/proc/self/maps").read_text()
    emb, head = model.embed.weight, model.head.weight
    assert emb.is_contiguous() and head.T.is_contiguous() and not head.is_contiguous()
    ids = torch.randint(0, 64, (2, 20), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), hf(ids).logits, rtol=1e-4, atol=1e-5)
        before = file.read_bytes()
        emb[5].fill_(0.25)
    assert file.read_bytes() == before
    assert torch.equal(from_pretrained(folder)[0].embed.weight, hf.backbone.embeddings.weight.detach())
    save_pretrained(model, folder)                          # over the mapped file: a new file, the map intact
    again, _ = from_pretrained(folder)
    assert torch.equal(again.embed.weight[5], torch.full((32,), 0.25)) and torch.equal(again.embed.weight, emb)

    w = load_file(str(file))
    w["backbone.embeddings.weight"][63, 31] = float("inf")
    save_file(w, str(file))
    with pytest.raises(ValueError, match=r"weight backbone\.embeddings\.weight holds NaN or inf"):
        from_pretrained(folder)
    tied, _ = from_pretrained(_hf_mamba(tmp_path / "tied", falcon="mamba2", tie_word_embeddings=True)[1])
    assert tied.head is None and tied.embed.weight.T.is_contiguous()      # the tied matrix is the head's


def test_dtype_names_as_transformers_users_write_them(tmp_path):
    _, folder = _hf_mamba(tmp_path, falcon="mamba2")
    for dtype, want in (("bfloat16", torch.bfloat16), ("torch.float16", torch.float16), ("fp32", torch.float32),
                        (torch.float64, torch.float64)):
        model, _ = from_pretrained(folder, dtype=dtype)
        assert model.embed.weight.dtype == want, dtype
    c = json.loads((folder / "config.json").read_text())
    c["dtype"] = "bfloat16"
    (folder / "config.json").write_text(json.dumps(c))
    assert from_pretrained(folder, dtype="auto")[0].embed.weight.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="dtype must be .* got 'bf17'"):
        from_pretrained(folder, dtype="bf17")


def test_a_hub_id_says_only_local_folders_are_read(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=r"'state-spaces/mamba-130m-hf' is not a local folder.*hf download"):
        from_pretrained("state-spaces/mamba-130m-hf")
