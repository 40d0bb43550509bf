"""``subquad serve --model x.gguf``: a tiny random RWKV-7 written by ``save_gguf`` with a small world vocabulary
(``WorldTokenizer``: every byte, a few words; the file's chat template is then the converter's RWKV world one)
served on 127.0.0.1 and driven by the ``openai`` client: a completion (with logprobs and a stop string) and a chat
completion give ``generate``'s greedy tokens on the same file's model, the chat prompt tokenised by hand. A folder's
chat template and special tokens go through ``save_gguf`` into the file and come back as the folder's."""

from __future__ import annotations

import pytest
import torch

from subquad.data.rwkv_world import WorldTokenizer
from subquad.models import from_pretrained
from subquad.models.gguf import save_gguf
from subquad.testing import random_rwkv7_pth
from tests.serve.helpers import Server, folder, load

WORDS = [b"\n\n", b"User", b": ", b"Assistant", b"Hello", b" world", b"Hi"]
V = 300                                         # rows: <s>, 256 bytes, the words, unused padding
# the random model's head gives no logit to <s>, bytes >= 0x80, "\n\n" and the padding (all 0), so its greedy
# text is whole characters (the server, as vLLM, holds back an incomplete one) and runs to max_tokens


def world_tokenizer() -> WorldTokenizer:
    """Ids 1..256 the bytes (the world vocabulary's own order), then ``WORDS``."""
    return WorldTokenizer({t: i for i, t in enumerate([bytes([b]) for b in range(256)] + WORDS, start=1)})


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(server, the file's model, its tokenizer)."""
    pytest.importorskip("openai")
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    tmp = tmp_path_factory.mktemp("gguf")
    random_rwkv7_pth(tmp / "model.pth", V, 64, 1, {"w": 32, "a": 32, "v": 32, "g": 32}, 128, seed=3)
    model, _ = from_pretrained(tmp / "model.pth")
    with torch.no_grad():      # whole characters: no greedy token can be <s>, a byte >= 0x80, "\n\n" or padding
        model.head.weight[[0, *range(129, 258), *range(1 + 256 + len(WORDS), V)]] = 0
    save_gguf(model, tmp / "world.gguf", tokenizer=world_tokenizer())
    model, tok = from_pretrained(tmp / "world.gguf")
    server = Server(tmp / "world.gguf", "--max-context", 128, "--max-batch", 4)
    yield server, model, tok
    server.stop()


def greedy(model, ids, n):
    with torch.no_grad():
        return model.generate(ids, n, temperature=0)[0]


def test_a_completion_is_generates_greedy_text(served):
    server, model, tok = served
    client = server.client()
    assert [m.id for m in client.models.list().data] == ["world.gguf"]
    prompt = "Hello world"
    ids = tok.encode(prompt).ids
    assert ids == [261, 262]                                            # the words, not their bytes
    want = greedy(model, ids, 12)
    assert len(want) == 12 and "\ufffd" not in tok.decode(want)
    r = client.completions.create(model="world.gguf", prompt=prompt, max_tokens=12, temperature=0, logprobs=1)
    c = r.choices[0]
    assert c.text == tok.decode(want) and r.usage.completion_tokens == len(want)
    assert c.logprobs.tokens == [tok.decode([t], skip_special_tokens=False) for t in want]
    text = tok.decode(want)
    if len(text) > 2:                                                   # a stop string inside the answer
        stop = text[1:3]
        r = client.completions.create(model="world.gguf", prompt=prompt, max_tokens=12, temperature=0, stop=[stop])
        assert r.choices[0].text == text[:text.index(stop)] and r.choices[0].finish_reason == "stop"


def test_a_chat_completion_renders_the_files_template(served):
    server, model, tok = served
    # the converter's RWKV world template by hand: "<s>" (token 0), "User: Hi\n\n", "Assistant:"
    ids = [0, 258, 259, 263, 257, 260, 1 + ord(":")]
    want = greedy(model, ids, 10)
    r = server.client().chat.completions.create(model="world.gguf", messages=[{"role": "user", "content": " Hi "}],
                                                max_tokens=10, temperature=0)
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == len(want)
    assert r.choices[0].message.content == tok.decode(want)
    assert model.config.eos_token_ids == [0, 257]                       # <s> and "\n\n": the converter's eos, eot


def test_a_folders_chat_template_and_special_tokens_go_through_the_file(tmp_path):
    pytest.importorskip("jinja2")
    from subquad.models.gguf.reader import GGUFFile
    from subquad.serve.chat import chat_template_of, load_chat_template

    path = folder(tmp_path / "m", "mamba2", template=True, eos=7)
    model, tok = load(path)
    save_gguf(model, tmp_path / "m.gguf", tokenizer=tok)
    meta = GGUFFile(tmp_path / "m.gguf").metadata
    assert meta["tokenizer.chat_template"] == load_chat_template(path).source and meta[
        "tokenizer.ggml.eos_token_id"] == 7
    again, tok2 = from_pretrained(tmp_path / "m.gguf")
    messages = [{"role": "system", "content": "w20"}, {"role": "user", "content": "w5 w6"}]
    want = load_chat_template(path).render(messages)
    assert want == "<|system|> w20 </s> <|user|> w5 w6 </s> <|assistant|>"
    assert chat_template_of(again.hf_source["files"]).render(messages) == want
    assert again.config.eos_token_ids == [7] and tok2.encode(want).ids == tok.encode(want).ids


def test_serve_help_says_it_takes_a_gguf_file(capsys):
    from subquad.cli import main

    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    assert "or a GGUF file" in " ".join(capsys.readouterr().out.split())
