"""Incremental text and stop strings: released text is always a prefix of the full decoding, a stop string
spanning tokens is found, text that may begin a stop string is held back, a split character is never cut."""

from subquad.serve.text import TextStream


def words(ids):
    return " ".join(f"w{i}" for i in ids)


def run(decode, ids, stops):
    ts, out = TextStream(decode, stops), []
    for n in range(1, len(ids) + 1):
        delta, stopped = ts.push(ids[:n])
        out.append(delta)
        if stopped:
            return "".join(out), True, n
    return "".join(out) + ts.flush(), False, len(ids)


def test_stop_across_token_boundaries_and_held_text():
    ids = [12, 345, 6, 78]                       # "w12 w345 w6 w78"
    assert run(words, ids, []) == ("w12 w345 w6 w78", False, 4)
    assert run(words, ids, ["2 w3"]) == ("w1", True, 2)          # spans tokens 1 and 2
    assert run(words, ids, ["w6 w7", "45 w"]) == ("w12 w3", True, 3)   # the earliest match wins
    ts = TextStream(words, ["w345 x"])
    assert ts.push([12]) == ("w12", False)
    assert ts.push([12, 345]) == (" ", False)    # "w345" may begin the stop string: held back
    assert ts.push([12, 345, 6]) == ("w345 w6", False)    # it did not
    assert ts.flush() == "" and ts.text == "w12 w345 w6"


def test_split_characters_wait_for_their_last_byte():
    data = "aé€b".encode()                       # one token per byte
    decode = lambda ids: bytes(ids).decode("utf-8", errors="replace")   # noqa: E731
    ts, out = TextStream(decode), []
    for n in range(1, len(data) + 1):
        delta, _ = ts.push(list(data[:n]))
        assert "\ufffd" not in delta
        out.append(delta)
    assert "".join(out) == "aé€b"


def test_flush_releases_a_last_split_character_as_the_tokenizer_decodes_it_but_not_a_later_stop_token():
    """A sequence that ends inside a character (its last token a lone byte) releases it at the end as U+FFFD, as
    decoding the whole sequence gives it - not dropped; a token appended after the last push (a stop token, whose
    text is never output) is not decoded."""
    decode = lambda ids: bytes(ids).decode("utf-8", errors="replace")   # noqa: E731
    data = list("aé".encode())
    ts = TextStream(decode)
    assert ts.push(data[:1]) == ("a", False)
    assert ts.push(data[:2]) == ("", False)       # the first byte of "é": held
    assert ts.flush() == "\ufffd" and ts.text == decode(data[:2])
    ts = TextStream(decode)
    ids = [ord("a")]
    assert ts.push(ids) == ("a", False)
    ids.append(ord("\n"))                         # the engine appends a stop token and flushes without a push
    assert ts.flush() == "" and ts.text == "a"


def test_token_bytes_join_to_the_texts_utf8_where_a_character_is_split_over_tokens():
    """Chat logprobs' ``bytes``: each token's own bytes (a byte-level BPE's piece mapped back through GPT-2's
    alphabet), so the tokens of a text join to its UTF-8 - a character split over two tokens included, whose
    pieces' texts are each U+FFFD; a world vocabulary's bytes as it holds them."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from subquad.data.rwkv_world import WorldTokenizer
    from subquad.serve.api import token_bytes, token_text

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(["plain ascii text " * 20], trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    text = "caf\u00e9 \u4e2d\u6587 \U0001f600 ok\u00ff\n\t~"
    ids = tok.encode(text).ids
    assert b"".join(bytes(token_bytes(tok, t)) for t in ids) == text.encode("utf-8")
    assert any(token_text(tok, t) == "\ufffd" for t in ids)          # a lone byte's text, not its bytes
    fallback = Tokenizer(models.WordLevel({"<0xC3>": 0, "<0xA9>": 1, "[UNK]": 2}, unk_token="[UNK]"))
    fallback.add_tokens(["\u00e9t\u00e9"])                    # an added token: its text's UTF-8, not the alphabet's
    assert token_bytes(fallback, 0) + token_bytes(fallback, 1) == list("\u00e9".encode())   # SentencePiece's bytes
    assert token_bytes(fallback, 3) == list("\u00e9t\u00e9".encode())
    tok.add_tokens(["\u00e9t\u00e9"])
    assert token_bytes(tok, tok.token_to_id("\u00e9t\u00e9")) == list("\u00e9t\u00e9".encode())
    world = WorldTokenizer({b"a": 1, "\u00e9".encode()[:1]: 2, "\u00e9".encode()[1:]: 3})
    ids = world.encode("a\u00e9a").ids
    assert ids == [1, 2, 3, 1] and b"".join(bytes(token_bytes(world, t)) for t in ids) == "a\u00e9a".encode()
