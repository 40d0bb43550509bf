"""Byte-level BPE (Hugging Face ``tokenizers``), trained on the training split and saved with the run."""

from __future__ import annotations

from pathlib import Path

import numpy as np

EOT = "<|endoftext|>"


def train_tokenizer(texts: list[str], vocab_size: int = 4096):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < 300:
        raise ValueError(f"vocab_size must be >= 300 for byte-level BPE (256 bytes + merges), got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def load_tokenizer(path):
    from tokenizers import Tokenizer

    path = Path(path)
    if not path.exists():
        raise ValueError(f"tokenizer file {path} does not exist")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:                  # tokenizers raises a bare Exception on a truncated file
        raise ValueError(f"tokenizer file {path} is not a valid tokenizer (truncated or altered?): "
                         f"{str(e).splitlines()[0] if str(e) else e.__class__.__name__}") from None


def encode_docs(tok, texts: list[str]) -> np.ndarray:
    """All documents as one uint16/int32 array, each followed by the end-of-text token."""
    eot = tok.token_to_id(EOT)
    ids = []
    for enc in tok.encode_batch(texts):
        ids.extend(enc.ids)
        ids.append(eot)
    dtype = np.uint16 if tok.get_vocab_size() <= 65535 else np.int32
    return np.asarray(ids, dtype=dtype)


def end_of_text_ids(model, tok) -> list[int]:
    """The ids that end a sequence: the model's own (``config.eos_token_ids``), else - a subquad run, whose
    tokenizer ends every training document with ``<|endoftext|>`` (``encode_docs``), or a folder naming none -
    that token of its tokenizer. ``subquad serve`` and ``subquad generate`` stop at them alike."""
    if model.config.eos_token_ids:
        return list(model.config.eos_token_ids)
    find = getattr(tok, "token_to_id", None)                  # None: no tokenizer, or one without a vocabulary map
    eot = find(EOT) if find is not None else None
    return [] if eot is None else [eot]
