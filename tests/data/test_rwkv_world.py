"""The RWKV world tokenizer (``subquad.data.rwkv_world``) against the ``rwkv`` package's ``TRIE_TOKENIZER`` on its
own vocabulary file: the same ids for English, code, CJK, emoji, whitespace runs and broken-looking text; decode
inverts encode; the vocabulary beside a ``.pth`` comes back from ``from_pretrained``."""

import shutil
from pathlib import Path

import pytest

rwkv_tokenizer = pytest.importorskip("rwkv.rwkv_tokenizer")   # the `rwkv` extra (make test requires it)

from subquad.data.rwkv_world import VOCAB_FILE, WorldTokenizer  # noqa: E402

VOCAB = Path(rwkv_tokenizer.__file__).parent / VOCAB_FILE
TEXTS = ["Hello, world! The quick brown fox jumps over the lazy dog.",
         "def f(x):\n    return x ** 2  # squares\n\n\n\t\t}",
         "中文分词测试：这是一个句子。日本語のテキスト、한국어 문장.",
         "emoji 🙂🚀 and accents: café naïve Ωμέγα",
         "   leading and trailing spaces   ", "\x00\x01 control \x7f bytes", "a", ""]


@pytest.fixture(scope="module")
def both():
    return WorldTokenizer.from_file(VOCAB), rwkv_tokenizer.TRIE_TOKENIZER(str(VOCAB))


@pytest.mark.parametrize("text", TEXTS)
def test_ids_equal_the_package(both, text):
    ours, ref = both
    ids = ours.encode(text).ids
    assert ids == ref.encode(text)
    assert ours.decode(ids) == text


def test_vocabulary_size_and_bad_lines(both, tmp_path):
    assert both[0].get_vocab_size() == 65530
    bad = tmp_path / "v.txt"
    bad.write_text("1 'a' 1\n2 'bc' 3\n")
    with pytest.raises(ValueError, match="v.txt:2"):
        WorldTokenizer.from_file(bad)


def test_from_pretrained_returns_it_beside_a_pth(both, tmp_path):
    from subquad.models import from_pretrained
    from tests.models import test_rwkv7

    test_rwkv7.random_pth(tmp_path / "model.pth")
    shutil.copy(VOCAB, tmp_path / VOCAB_FILE)
    _, tok = from_pretrained(tmp_path)
    assert isinstance(tok, WorldTokenizer) and tok.encode(TEXTS[0]).ids == both[1].encode(TEXTS[0])
