"""Tokenised corpus on disk, cached by content hash, and seeded random batches from it."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from subquad.data.corpus import load_corpus
from subquad.data.tokenizer import encode_docs, load_tokenizer, train_tokenizer


@dataclass
class TokenData:
    train: np.ndarray
    heldout: np.ndarray
    tokenizer_path: Path
    manifest: dict

    def tokenizer(self):
        return load_tokenizer(self.tokenizer_path)

    @property
    def eot(self) -> int | None:
        """The end-of-text id that follows every document in the token streams (None without one)."""
        from subquad.data.tokenizer import EOT

        return self.tokenizer().token_to_id(EOT)

    def documents(self) -> int:
        """How many documents the training stream holds (end-of-text tokens)."""
        eot = self.eot
        return 0 if eot is None else int((self.train == eot).sum())


def default_cache() -> Path:
    return Path(os.environ.get("SUBQUAD_CACHE", Path.home() / ".cache" / "subquad"))


def prepare(data: str | None = None, vocab_size: int = 4096, cache_dir=None, log=print) -> TokenData:
    """Load the corpus, train (or reuse) the BPE tokenizer and encode both splits; cached by corpus hash."""
    corpus = load_corpus(data)
    key = f"{corpus.manifest['sha256'][:16]}-v{vocab_size}"
    d = Path(cache_dir or default_cache()) / "tokens" / key
    tok_path, tr_path, ho_path = d / "tokenizer.json", d / "train.npy", d / "heldout.npy"
    if not (tok_path.exists() and tr_path.exists() and ho_path.exists()):
        d.mkdir(parents=True, exist_ok=True)
        log(f"training a byte-level BPE tokenizer (vocab {vocab_size:,}) on {corpus.manifest['train_chars']:,} "
            f"characters of {corpus.name} ...")
        tok = train_tokenizer(corpus.train, vocab_size)
        tmp = d / "tokenizer.json.tmp"
        tok.save(str(tmp))
        os.replace(tmp, tok_path)
        for path, texts in ((tr_path, corpus.train), (ho_path, corpus.heldout)):
            arr = encode_docs(tok, texts)
            with open(str(path) + ".tmp", "wb") as f:
                np.save(f, arr)
            os.replace(str(path) + ".tmp", path)
        (d / "manifest.json").write_text(json.dumps(corpus.manifest, indent=1))
    train, held = np.load(tr_path), np.load(ho_path)
    return TokenData(train, held, tok_path, corpus.manifest)


def get_batch(tokens: np.ndarray, batch_size: int, context: int, generator: torch.Generator):
    """Random windows: x (B, T) and the next-token targets y (B, T)."""
    n = len(tokens) - context - 1
    if n <= 0:
        raise ValueError(f"the token stream ({len(tokens):,} tokens) is shorter than context + 1 = {context + 1}")
    starts = torch.randint(0, n, (batch_size,), generator=generator, device=generator.device).tolist()
    win = np.stack([tokens[s:s + context + 1].astype(np.int64) for s in starts])
    t = torch.from_numpy(win)
    return t[:, :-1], t[:, 1:]


IGNORE = -100   # a target the loss skips (F.cross_entropy's ignore_index)


def pack_batch(x: torch.Tensor, y: torch.Tensor, eot: int):
    """Rows of windows (B, T) -> one packed row (1, B T) with boundaries at every row start and every
    document start (the token after an end-of-text), and targets that never cross a boundary: an
    end-of-text token's target (the next document's first token) is ``IGNORE``d.

    Returns (x (1, B T), y (1, B T), cu_seqlens (N + 1,) int64): what ``LanguageModel(idx, cu_seqlens=...)``
    takes, so no token attends to or is carried from another document."""
    B, T = x.shape
    starts = torch.zeros(B, T, dtype=torch.bool)
    starts[:, 0] = True
    starts[:, 1:] = x[:, :-1] == eot
    pos = torch.nonzero(starts.reshape(-1)).squeeze(1)
    cu = torch.cat([pos, torch.tensor([B * T])]).to(torch.int64)
    y = y.masked_fill(x == eot, IGNORE)
    return x.reshape(1, B * T), y.reshape(1, B * T), cu
