"""from_pretrained("x.gguf"): files written by ggml's own writer from tiny random transformers models give
transformers' logits (F32) and, quantised, the logits of the same weights dequantised by ``gguf.quants``
loaded from a Hugging Face folder; quantised projections stay quantised."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

from subquad.models.hf import from_pretrained, save_pretrained
from subquad.models.quant import Int8Linear
from tests.models.gguf_harness import convert, dequantized_folder
from tests.models.test_hf import _hf_logits, _hf_mamba, _ids
from tests.models.test_hf_lfm2 import _hf as _hf_lfm2


@pytest.mark.parametrize("kind", ["mamba", "mamba2"])
def test_f32_file_gives_transformers_logits(tmp_path, kind):
    hf, _ = _hf_mamba(tmp_path, falcon=kind)
    convert(hf, tmp_path / "m.gguf", "f32")
    ours, tok = from_pretrained(tmp_path / "m.gguf")
    ids = _ids()
    with torch.no_grad():
        want = _hf_logits(hf, ids)
        assert torch.allclose(ours(ids), want, atol=1e-4, rtol=1e-4)
    assert ours.config.pattern == kind and tok is None and not getattr(ours, "quantized", None)


def test_lfm2_files_give_transformers_logits_and_their_dequantised_weights(tmp_path):
    """LFM2 (conv, attention, conv, conv; MLP width adjusted): F32 against transformers, Q8_0 against the
    same weights dequantised by gguf."""
    hf, _ = _hf_lfm2(tmp_path, conv_bias=True)
    convert(hf, tmp_path / "f.gguf", "f32")
    ours, _ = from_pretrained(tmp_path / "f.gguf")
    ids = torch.randint(0, 96, (2, 30), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.allclose(ours(ids), hf(ids).logits, atol=1e-4, rtol=1e-4)
    assert ours.config.pattern == "gated_conv,softmax,gated_conv,gated_conv" and ours.config.mlp_hidden == 96
    convert(hf, tmp_path / "q.gguf", "q8_0")
    ref, _ = from_pretrained(dequantized_folder(hf, tmp_path / "q.gguf", tmp_path / "ref"))
    with pytest.warns(UserWarning, match="token_embd.weight"):
        ours, _ = from_pretrained(tmp_path / "q.gguf")
    with torch.no_grad():
        want = ref(ids)
        assert torch.allclose(ours(ids), want, rtol=0, atol=1e-5 * want.abs().max())
    assert sum(isinstance(m, Int8Linear) for m in ours.modules()) == 4 * 3 + 4 + 2 * 3 + 1   # MLPs, attention, convs, head


@pytest.mark.parametrize("kind,outtype", [("mamba", "q8_0"), ("mamba2", "q4_0")])
def test_quantised_file_equals_its_weights_dequantised_by_gguf(tmp_path, kind, outtype):
    hf, _ = _hf_mamba(tmp_path, falcon=kind, tie_word_embeddings=kind == "mamba")
    types = convert(hf, tmp_path / "m.gguf", outtype)
    assert outtype.upper() in types.values() and ("F16" in types.values()) == (kind == "mamba")  # dt_proj: 4 wide
    ref, _ = from_pretrained(dequantized_folder(hf, tmp_path / "m.gguf", tmp_path / "ref"))
    if kind == "mamba":
        ours, _ = from_pretrained(tmp_path / "m.gguf")
    else:                                       # an untied embedding is looked up: dequantised, and said so
        with pytest.warns(UserWarning, match=r"dequantised to torch.float32: token_embd.weight \(Q4_0\)"):
            ours, _ = from_pretrained(tmp_path / "m.gguf")
    ids = _ids()
    with torch.no_grad():
        want = ref(ids)
        assert torch.allclose(ours(ids), want, rtol=0, atol=1e-5 * want.abs().max())
    quantised = [m for m in ours.modules() if isinstance(m, Int8Linear)]
    # every matrix written quantised is held as int8 blocks (and a tied head of the embedding's)
    assert len(quantised) == sum(t == outtype.upper() for g, t in types.items() if g != "token_embd.weight") + \
        (kind == "mamba")
    assert ours.quantized == "int8" and all(m.scale.shape[1] == m.in_features // 32 for m in quantised)
    from types import SimpleNamespace

    from subquad.cli.eval import precision

    assert ours.gguf_types == [outtype.upper()]                 # what subquad eval names it
    assert precision(ours, SimpleNamespace(quantize=None, dtype=None)) == f"{outtype.upper()} (the file's)"
    # Q4_0's nibbles kept as the file packs them (half a byte a weight), Q8_0's int8 codes
    assert all(m.q.dtype == (torch.uint8 if outtype == "q4_0" else torch.int8) for m in quantised)
    save_pretrained(ours, tmp_path / "saved")            # a quantised folder keeps the blocks, bit for bit
    again, _ = from_pretrained(tmp_path / "saved")
    with torch.no_grad():
        assert torch.equal(again(ids), ours(ids))


def test_refusals_name_the_problem(tmp_path):
    (tmp_path / "x.gguf").write_bytes(b"GGML" + bytes(20))
    with pytest.raises(ValueError, match="not a GGUF file"):
        from_pretrained(tmp_path / "x.gguf")
    w = gguf.GGUFWriter(str(tmp_path / "y.gguf"), "llama")
    w.add_tensor("token_embd.weight", torch.zeros(4, 32).numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="architecture 'llama' is not one subquad loads"):
        from_pretrained(tmp_path / "y.gguf")
    (tmp_path / "Y.GGUF").write_bytes((tmp_path / "y.gguf").read_bytes())      # known by its magic, any name
    (tmp_path / "y.bin").write_bytes((tmp_path / "y.gguf").read_bytes())
    for name in ("Y.GGUF", "y.bin"):
        with pytest.raises(ValueError, match="architecture 'llama' is not one subquad loads"):
            from_pretrained(tmp_path / name)
    with pytest.raises(ValueError, match=r"missing\.gguf: no such GGUF file"):
        from_pretrained(tmp_path / "missing.gguf")
    (tmp_path / "empty.gguf").write_bytes(b"")
    with pytest.raises(ValueError, match=r"empty\.gguf: not a GGUF file \(0 bytes"):
        from_pretrained(tmp_path / "empty.gguf")


def test_tokenizer_from_llama_cpps_vocabulary(tmp_path):
    """A byte-level BPE written as llama.cpp's "gpt2" vocabulary (tokens, merges; no tokenizer.json) reads back
    as a tokenizer that encodes and decodes as the original."""
    from subquad.data.tokenizer import train_tokenizer

    text = "".join(f"def h{i}(z):\n    return z * {i}  # é\n" for i in range(60))
    tok0 = train_tokenizer([text], vocab_size=300)
    hf, _ = _hf_mamba(tmp_path, vocab_size=tok0.get_vocab_size())
    convert(hf, tmp_path / "m.gguf", "f32", tokenizer=tok0)
    _, tok = from_pretrained(tmp_path / "m.gguf")
    sample = "def h7(z):\n    return z * 12  # é ü"
    assert tok.encode(sample).ids == tok0.encode(sample).ids
    assert tok.decode(tok.encode(sample).ids) == sample


def test_a_tensor_its_own_metadata_does_not_describe_is_named(tmp_path, monkeypatch):
    """A converter that misread its model's config writes tensors the metadata does not describe (llama.cpp's,
    on a transformers-5 Granite folder: head counts of 0 beside attention tensors): the tensor and the file are
    named, not an IndexError from inside the reshaping."""
    from subquad.models.gguf.registry import ARCHS

    convert(_hf_mamba(tmp_path)[0], tmp_path / "m.gguf", "f32")
    arch = ARCHS["mamba"]
    real = arch.to_hf

    def misread(name, t, c):
        if name.endswith("layers.1.mixer.out_proj.weight") and t.device.type != "meta":
            return t[torch.tensor([t.shape[0]])]                 # a row past the metadata's count
        return real(name, t, c)

    monkeypatch.setattr(arch, "to_hf", misread)
    with pytest.raises(ValueError, match=r"m\.gguf: GGUF tensor 'blk\.1\.ssm_out\.weight' \(\d+, \d+\) does not "
                                         r"fit the file's own mamba metadata \(IndexError"):
        from_pretrained(tmp_path / "m.gguf")


# pre-tokenizers as released tokenizer.json files hold them (Qwen2's, Llama 3's, StarCoder's), and the name
# llama.cpp's converter gives each
RELEASED = {"qwen2": ([r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                      r"\s*[\r\n]+|\s+(?!\S)|\s+"], False, False),
            "llama-bpe": ([r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+"
                           r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"], False, True),
            "starcoder": (["digits"], True, False), "gpt-2": ([], True, False)}


@pytest.mark.parametrize("name", list(RELEASED))
def test_a_byte_level_bpe_is_written_under_llama_cpps_name_and_split_as_it_names(name):
    """The pre-tokenizer's name written (what llama.cpp's converter writes for such a tokenizer.json, so llama.cpp
    splits text as the model was trained), and a file holding only llama.cpp's vocabulary (no tokenizer.json: the
    converter's files) read back as a tokenizer that encodes as the original - digits one by one (Qwen2), in threes
    (Llama 3, whose merges are skipped for a piece that is a token), words with their leading space (GPT-2)."""
    from subquad.models.gguf.vocab import tokenizer, tokenizer_metadata

    tok0, text = _released(name)
    meta = tokenizer_metadata(tok0, 420)
    types = dict(zip(meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"]))
    assert meta["tokenizer.ggml.pre"] == name and meta["tokenizer.ggml.tokens"][-1] == "[PAD419]"
    assert (types["<|endoftext|>"], types["<|im_end|>"], types["<think>"], types["[PAD419]"]) == (3, 3, 4, 5)
    del meta["tokenizer.huggingface.json"]
    tok = tokenizer(meta)
    for sample in ("In 2031, hello!!! world's 987654321 (a+b)  \u4e2d caf\u00e9\n\n\n ok It'S<|endoftext|>",
                   "<think>x</think> 12<|im_end|>", *text[:3]):
        assert tok.encode(sample).ids == tok0.encode(sample).ids, sample
        assert tok.decode(tok.encode(sample).ids) == tok0.decode(tok0.encode(sample).ids)


@pytest.mark.parametrize("name", ["llama-bpe", "qwen2"])
def test_the_bos_a_tokenizer_adds_is_written_and_read_as_llama_cpp_reads_it(name):
    """A tokenizer whose post-processor puts a BOS before every text (LFM2's, Jamba's, Llama 3's): the file says
    ``tokenizer.ggml.add_bos_token`` true and reads back adding it; one that adds none says false (llama.cpp's
    default for "llama-bpe" would add one) and reads back adding none. A file that does not say (as the converter
    writes one without the tokenizer_config flag) gets llama.cpp's default for its pre-tokenizer name:
    llama-vocab.cpp adds a BOS for "llama-bpe", none for "qwen2"."""
    from tokenizers import processors

    from subquad.models.gguf.vocab import tokenizer, tokenizer_metadata

    sample = "def f(x):\n    return x"
    for adds in (True, False):
        tok0, _ = _released(name)
        if adds:
            tok0.post_processor = processors.TemplateProcessing(single="<|endoftext|> $A", pair="<|endoftext|> $A $B:1",
                                                                special_tokens=[("<|endoftext|>", 0)])
        meta = tokenizer_metadata(tok0, 420)
        assert meta["tokenizer.ggml.add_bos_token"] is adds and meta["tokenizer.ggml.add_eos_token"] is False
        assert meta.get("tokenizer.ggml.bos_token_id") == (0 if adds else None)
        meta["tokenizer.ggml.bos_token_id"] = 0          # a BOS named but not to be added (add_bos_token false)
        del meta["tokenizer.huggingface.json"]
        tok = tokenizer(meta)
        assert tok.encode(sample).ids == tok0.encode(sample).ids
        assert (tok.encode(sample).ids[0] == 0) is adds
        assert tok.encode(sample, add_special_tokens=False).ids == tok0.encode(sample, add_special_tokens=False).ids
        if adds:
            del meta["tokenizer.ggml.add_bos_token"]
            assert (tokenizer(meta).encode(sample).ids[0] == 0) is (name == "llama-bpe")
    tok0, _ = _released(name)                            # an EOS after every text (an encoder's tokenizer)
    eos = tok0.token_to_id("<|im_end|>")
    tok0.post_processor = processors.TemplateProcessing(single="$A <|im_end|>", pair="$A $B:1 <|im_end|>",
                                                        special_tokens=[("<|im_end|>", eos)])
    meta = tokenizer_metadata(tok0, 420)
    assert (meta["tokenizer.ggml.add_bos_token"], meta["tokenizer.ggml.add_eos_token"]) == (False, True)
    assert meta["tokenizer.ggml.eos_token_id"] == eos
    del meta["tokenizer.huggingface.json"]
    assert tokenizer(meta).encode(sample).ids == tok0.encode(sample).ids and tok0.encode(sample).ids[-1] == eos


def _released(name):
    """A byte-level BPE trained here with ``RELEASED[name]``'s pre-tokenizer, its added tokens as Qwen's and
    Llama 3's; and the texts it was trained on."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    regexes, gpt2_regex, ignore = RELEASED[name]
    tok0 = Tokenizer(models.BPE(ignore_merges=ignore))
    splits = [pre_tokenizers.Digits(individual_digits=True) if r == "digits" else
              pre_tokenizers.Split(Regex(r), behavior="isolated") for r in regexes]
    tok0.pre_tokenizer = pre_tokenizers.Sequence([*splits, pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                                                     use_regex=gpt2_regex)])
    tok0.decoder = decoders.ByteLevel()
    text = [f"In 20{i:02d}, hello!!! world's {i * 12345} (x+y)  \u4e2d\u6587 caf\u00e9\n\n  ok it'S" for i in range(40)]
    tok0.train_from_iterator(text, trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok0.add_special_tokens(["<|im_end|>"])          # added past the model's vocabulary, as Qwen's and Llama 3's
    tok0.add_tokens(["<think>"])
    return tok0, text


def test_a_split_no_name_says_is_kept_as_tokenizer_json_and_an_unknown_name_warns():
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers

    from subquad.models.gguf.vocab import tokenizer, tokenizer_metadata

    tok0 = Tokenizer(models.BPE({"a": 0, "b": 1}, []))
    tok0.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(r"\p{L}"), behavior="isolated"),
                                                  pre_tokenizers.ByteLevel(use_regex=False)])
    with pytest.warns(UserWarning, match="no GGUF name says"):
        meta = tokenizer_metadata(tok0, 2)
    assert "tokenizer.ggml.model" not in meta and tokenizer(meta).encode("ab").ids == [0, 1]
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "kimi-k2", "tokenizer.ggml.tokens": ["a", "b"],
            "tokenizer.ggml.token_type": [1, 1], "tokenizer.ggml.merges": []}
    with pytest.warns(UserWarning, match="'kimi-k2' is a pre-tokenizer subquad does not know"):
        assert tokenizer(meta).encode("ab").ids == [0, 1]


@pytest.mark.parametrize("quantize", ["int4", "int8"])
def test_quantize_puts_a_quantised_file_in_subquads_kernels(tmp_path, quantize):
    """quantize="int4": Q4_0's codes as they are in torch's int4 layout (group 32), the scales rounded to
    bfloat16; "int8": requantised per channel. Close to the exact load, and saved and loaded as it is."""
    from subquad.models.quant import Int4Linear

    hf, _ = _hf_mamba(tmp_path, falcon="mamba2", tie_word_embeddings=True)
    convert(hf, tmp_path / "m.gguf", "q4_0")
    exact, _ = from_pretrained(tmp_path / "m.gguf")
    ours, _ = from_pretrained(tmp_path / "m.gguf", quantize=quantize)
    cls = Int4Linear if quantize == "int4" else Int8Linear
    pairs = [(a, b) for a, b in zip(exact.modules(), ours.modules()) if isinstance(a, Int8Linear)]
    assert pairs and all(isinstance(b, cls) for _, b in pairs) and isinstance(ours.head, cls)
    for a, b in pairs:      # int4: the same codes, each block's float16 scale in bfloat16; int8: within half a step
        tol = {"rtol": 2 ** -8, "atol": 1e-7} if quantize == "int4" else {"rtol": 0, "atol": b.scale.max() / 2 + 1e-7}
        assert torch.allclose(b.weight, a.weight, **tol)
    ids = _ids()
    with torch.no_grad():
        want, got = exact(ids), ours(ids)
        assert (got - want).abs().max() < 0.05 * want.abs().max()
        assert ours.quantized == quantize
        save_pretrained(ours, tmp_path / "saved")
        again, _ = from_pretrained(tmp_path / "saved")
        assert torch.allclose(again(ids), got, rtol=0, atol=1e-5 * got.abs().max())
    with pytest.raises(ValueError, match="quantize must be None"):
        from_pretrained(tmp_path / "m.gguf", quantize="bf16")
