"""The RWKV "world" tokenizer (BlinkDL's ``rwkv_vocab_v20230424.txt``, 65,529 byte strings): greedy longest match.

Each line of the vocabulary is ``id repr(token) length``, the token a Python str (UTF-8 encoded) or bytes
literal; id 0 is end-of-text and has no line. Encoding walks the UTF-8 bytes left to right and takes, at each
position, the longest token that starts there - what the ``rwkv`` package's ``TRIE_TOKENIZER`` does (every
single byte is a token, so the walk never sticks).

    tok = WorldTokenizer.from_file("rwkv_vocab_v20230424.txt")
    tok.encode("Hello").ids   ->  [33155, ...]        tok.decode(ids) -> str

``encode(text).ids`` and ``decode(ids)`` are the calls subquad makes of a Hugging Face ``tokenizers.Tokenizer``,
so ``from_pretrained`` returns one for a ``.pth`` with the vocabulary file beside it.
"""

from __future__ import annotations

import ast
from pathlib import Path
from types import SimpleNamespace

VOCAB_FILE = "rwkv_vocab_v20230424.txt"


class WorldTokenizer:
    """Greedy longest-match over a byte trie (module docstring). ``vocab``: {token bytes: id}."""

    def __init__(self, vocab: dict):
        if not vocab or any(not isinstance(t, bytes) or not t for t in vocab):
            raise ValueError("vocab must map non-empty byte strings to ids")
        self.id_to_bytes = {i: t for t, i in vocab.items()}
        self.trie: dict = {}                        # byte -> child node; a node's None key holds its token id
        for token, i in vocab.items():
            node = self.trie
            for byte in token:
                node = node.setdefault(byte, {})
            node[None] = i

    @classmethod
    def from_file(cls, path) -> "WorldTokenizer":
        """Read a vocabulary file of ``id repr(token) length`` lines; ValueError naming a line that is not one."""
        vocab = {}
        for n, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            try:
                i, rest = line.split(" ", 1)
                literal, length = rest.rsplit(" ", 1)
                token = ast.literal_eval(literal)
                token = token.encode("utf-8") if isinstance(token, str) else token
                if not isinstance(token, bytes) or len(token) != int(length):
                    raise ValueError("length mismatch")
            except (ValueError, SyntaxError) as e:
                raise ValueError(f"{path}:{n} is not an 'id token length' line: {e}") from None
            vocab[token] = int(i)
        return cls(vocab)

    def encode_bytes(self, data: bytes) -> list[int]:
        ids, pos = [], 0
        while pos < len(data):
            node, best, end, i = self.trie, None, pos, pos
            while i < len(data) and data[i] in node:
                node = node[data[i]]
                i += 1
                if None in node:
                    best, end = node[None], i
            if best is None:
                raise ValueError(f"byte {data[pos]} at position {pos} is in no token of the vocabulary")
            ids.append(best)
            pos = end
        return ids

    def encode(self, text: str):
        """An object with ``.ids``, as ``tokenizers.Tokenizer.encode`` returns."""
        return SimpleNamespace(ids=self.encode_bytes(text.encode("utf-8")))

    def decode(self, ids) -> str:
        """The text of ``ids``; id 0 (end-of-text) and unknown ids decode to nothing, broken UTF-8 to U+FFFD."""
        return b"".join(self.id_to_bytes.get(int(i), b"") for i in ids).decode("utf-8", errors="replace")

    def get_vocab_size(self) -> int:
        return max(self.id_to_bytes) + 1
