"""RWKV's world vocabulary in GGUF (``tokenizer.ggml.model`` "rwkv", ``models.gguf.vocab``): a tiny RWKV-7 file
written by llama.cpp's converter rule (``gguf_more_harness.set_vocab_rwkv_world``, ggml's ``gguf`` writer, the
real 65,529-token vocabulary of BlinkDL's ``rwkv`` package) loads with a tokenizer whose every token's bytes,
encodings and decodings equal ``data.rwkv_world``'s reading of the vocabulary file; its end-of-generation ids and
chat template are the converter's; ``save_gguf`` writes the same vocabulary fields; ``subquad generate`` prints
the model's greedy text."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

gguf = pytest.importorskip("gguf")
rwkv_tokenizer = pytest.importorskip("rwkv.rwkv_tokenizer")     # the `rwkv` extra: the vocabulary file

from subquad.data.rwkv_world import VOCAB_FILE, WorldTokenizer  # noqa: E402
from subquad.models import from_pretrained  # noqa: E402
from subquad.models.gguf import save_gguf  # noqa: E402
from subquad.models.gguf.vocab import WORLD_TEMPLATE, escape_world, unescape_world  # noqa: E402
from subquad.testing import random_rwkv7_pth  # noqa: E402
from tests.models import gguf_more_harness as harness  # noqa: E402

VOCAB = Path(rwkv_tokenizer.__file__).parent / VOCAB_FILE
V, D = 65536, 64                            # the released vocabulary's rows; one head of 64
TEXTS = ["Hello, world! The quick brown fox.", "def f(x):\n    return x ** 2\n\n\t}",
         "中文分词测试：这是一个句子。日本語、한국어 문장.", "emoji 🙂🚀 café naïve Ωμέγα",
         "\x00\x01 control \x7f bytes \\ back\\slash 'single' \"double\" \\x41 \\n", "   ", "a", ""]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """(the converter-rule GGUF, the fla folder it was written from, the model and world tokenizer of the .pth)."""
    tmp = tmp_path_factory.mktemp("world")
    random_rwkv7_pth(tmp / "model.pth", V, D, 1, {"w": 32, "a": 32, "v": 32, "g": 32}, 128)
    shutil.copy(VOCAB, tmp / VOCAB_FILE)
    model, tok = from_pretrained(tmp / "model.pth")
    model.save_pretrained(tmp / "fla")
    shutil.copy(VOCAB, tmp / "fla" / VOCAB_FILE)
    harness.convert(tmp / "fla", tmp / "theirs.gguf", "f32")
    return tmp / "theirs.gguf", tmp / "fla", model, tok


@pytest.fixture(scope="module")
def loaded(files):
    return from_pretrained(files[0])


def test_every_token_and_every_text_as_the_world_tokenizer(files, loaded):
    model, tok = loaded
    ref = WorldTokenizer.from_file(VOCAB)
    assert tok.id_to_bytes == ref.id_to_bytes                       # all 65,529 tokens' bytes, unescaped
    assert tok.special == {"<s>": 0} and tok.get_vocab_size() == 65530
    for text in TEXTS:
        ids = tok.encode(text).ids
        assert ids == ref.encode(text).ids and tok.decode(ids) == text
    assert tok.decode([0, 261], skip_special_tokens=False) == "<s>\n\n" and tok.decode([0, 261]) == "\n\n"
    assert tok.encode("<s>User", add_special_tokens=False).ids == [0] + ref.encode("User").ids
    assert tok.token_to_id("\n\n") == 261 and tok.token_to_id("<s>") == 0 and tok.token_to_id("\x00\x00x") is None
    # the converter's eos 0 and eot 261 ("\n\n") end generation, as llama.cpp's end-of-generation set
    assert model.config.vocab_size == V and model.config.eos_token_ids == [0, 261]


def test_escaping_is_the_converters_and_llama_cpps():
    for b in [b"\xff\xfe", b"'", b'"', b"'\"", b"\\", b"\\x41", b"\t\n\r", bytes(range(256))]:
        assert unescape_world(escape_world(b)) == b and escape_world(b) == repr(b)[2:-1]
    assert unescape_world(r"a\qb") == b"aqb"             # llama_unescape_rwkv_token: "\" + other -> that char


def test_the_chat_template_is_the_converters_and_renders(loaded):
    from subquad.serve.chat import chat_template_of

    pytest.importorskip("jinja2")
    template = chat_template_of(loaded[0].hf_source["files"])       # "rwkv-world": llama.cpp's built-in, by name
    assert template.source == WORLD_TEMPLATE
    text = template.render([{"role": "system", "content": "Be brief."}, {"role": "user", "content": " Hi "}])
    assert text == "<s>System: Be brief.\n\nUser: Hi\n\nAssistant:"


# gguf-py's writer's types for the converter's calls (add_token_list, add_token_types, add_*_token_id, ...)
FIELD_TYPES = {"tokenizer.ggml.model": [gguf.GGUFValueType.STRING],
               "tokenizer.ggml.tokens": [gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.STRING],
               "tokenizer.ggml.token_type": [gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.INT32],
               **{f"tokenizer.ggml.{k}_token_id": [gguf.GGUFValueType.UINT32] for k in ("bos", "eos", "eot")},
               "tokenizer.chat_template": [gguf.GGUFValueType.STRING]}


def test_save_gguf_writes_the_converters_vocabulary(files, tmp_path):
    """Values by subquad's reader (ggml's takes seconds a file on 65k strings; test_gguf_reader holds the two
    equal), types by ggml's on ours; the tensors as test_gguf_more's rwkv7 case compares them."""
    from subquad.models.gguf.reader import GGUFFile

    theirs, _, model, tok = files
    save_gguf(model, tmp_path / "ours.gguf", tokenizer=tok)
    a, b = GGUFFile(tmp_path / "ours.gguf").metadata, GGUFFile(theirs).metadata
    assert {k for k in a if k.startswith("tokenizer.")} == set(FIELD_TYPES) == {k for k in b if k.startswith("tok")}
    for k in set(FIELD_TYPES) - {"tokenizer.chat_template"}:
        assert a[k] == b[k], k
    assert len(a["tokenizer.ggml.tokens"]) == V and a["tokenizer.ggml.tokens"][:3] == ["<s>", "\\x00", "\\x01"]
    assert "rwkv7.vocab_size" not in a and "rwkv7.vocab_size" not in b
    # the converter writes llama.cpp's template file's text when it has it beside it, its name when not
    assert a["tokenizer.chat_template"] == WORLD_TEMPLATE and b["tokenizer.chat_template"] == "rwkv-world"
    fields = gguf.GGUFReader(str(tmp_path / "ours.gguf")).fields
    assert {k: fields[k].types for k in FIELD_TYPES} == FIELD_TYPES
    again, tok2 = from_pretrained(tmp_path / "ours.gguf")
    assert tok2.id_to_bytes == tok.id_to_bytes and again.config.eos_token_ids == [0, 261]


def test_generate_cli_prints_the_greedy_text(files, loaded, capsys):
    from subquad.cli import main

    model, tok = loaded
    prompt = "The café's"
    ids = tok.encode(prompt).ids
    model.config.eos_token_ids = []                     # the text of all 6 tokens, wherever eos falls
    with torch.no_grad():
        want = model.generate(ids, 6, temperature=0)[0]
    assert main(["generate", "--model", str(files[0]), "--prompt", prompt, "--max-new-tokens", "6",
                 "--temperature", "0", "--ignore-eos"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(prompt) and out.rstrip("\n") == prompt + tok.decode(want)
