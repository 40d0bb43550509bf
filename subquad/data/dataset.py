"""Tokenised corpus on disk, cached by content hash, and seeded random batches from it."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from subquad.data.corpus import default_cache, load_corpus
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


def file_sha256(path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def manifest_changes(old: dict, new: dict, limit: int = 6) -> list[str]:
    """What differs between two corpus manifests, file by file ('code.py changed', 'new.py added', ...);
    empty when their sha256 agree."""
    if old.get("sha256") == new.get("sha256"):
        return []
    before = {f["path"]: f["sha256"] for f in old.get("files", [])}
    after = {f["path"]: f["sha256"] for f in new.get("files", [])}
    out = [f"{p} changed" for p in sorted(before.keys() & after.keys()) if before[p] != after[p]]
    out += [f"{p} added" for p in sorted(after.keys() - before.keys())]
    out += [f"{p} removed" for p in sorted(before.keys() - after.keys())]
    if old.get("corpus") != new.get("corpus"):
        out.insert(0, f"corpus {new.get('corpus')!r} (was {old.get('corpus')!r})")
    if old.get("python") != new.get("python") and new.get("corpus") == "stdlib":
        out.insert(0, f"Python {new.get('python')} (was {old.get('python')})")
    if len(out) > limit:
        out = out[:limit] + [f"{len(out) - limit} more"]
    return out or ["the corpus sha256 differs"]


def prepare(data: str | None = None, vocab_size: int = 4096, cache_dir=None, log=print, tokenizer=None,
            expect: dict | None = None) -> TokenData:
    """Load the corpus, train (or reuse) the BPE tokenizer and encode both splits; cached by corpus hash.

    ``tokenizer``: a tokenizer.json to encode with instead of training one (a run's own, on resume and in
    eval), cached by its sha256 too. ``expect``: a run's corpus manifest; a corpus whose sha256 differs is
    refused (ValueError naming what changed) before any tokenizer is trained."""
    corpus = load_corpus(data)
    if expect is not None and expect.get("sha256") != corpus.manifest["sha256"]:
        raise ValueError(f"the data differ from the run's (its manifest.json): "
                         f"{'; '.join(manifest_changes(expect, corpus.manifest))}")
    root = Path(cache_dir or default_cache()) / "tokens"
    d = root / f"{corpus.manifest['sha256'][:16]}-v{vocab_size}"
    if tokenizer is not None:
        want = file_sha256(tokenizer)
        if not ((d / "tokenizer.json").exists() and file_sha256(d / "tokenizer.json") == want):
            d = root / f"{corpus.manifest['sha256'][:16]}-t{want[:16]}"
    tok_path, tr_path, ho_path = d / "tokenizer.json", d / "train.npy", d / "heldout.npy"
    if not (tok_path.exists() and tr_path.exists() and ho_path.exists()):
        d.mkdir(parents=True, exist_ok=True)
        tmp = d / "tokenizer.json.tmp"
        if tokenizer is not None:
            tok = load_tokenizer(tokenizer)
            shutil.copyfile(tokenizer, tmp)
        else:
            log(f"training a byte-level BPE tokenizer (vocab {vocab_size:,}) on "
                f"{corpus.manifest['train_chars']:,} characters of {corpus.name} ...")
            tok = train_tokenizer(corpus.train, vocab_size)
            if tok.get_vocab_size() < vocab_size:          # BPE ran out of pairs to merge: said, not silent
                log(f"BPE ran out of merges on this corpus: a vocabulary of {tok.get_vocab_size():,} tokens, fewer "
                    f"than the {vocab_size:,} asked (a larger corpus gives more)")
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
