"""The RWKV "world" tokenizer (BlinkDL's ``rwkv_vocab_v20230424.txt``, 65,529 byte strings): greedy longest match.

Each line of the vocabulary is ``id repr(token) length``, the token a Python str (UTF-8 encoded) or bytes
literal; id 0 is end-of-text and has no line. Encoding walks the UTF-8 bytes left to right and takes, at each
position, the longest token that starts there - what the ``rwkv`` package's ``TRIE_TOKENIZER`` does (every
single byte is a token, so the walk never sticks).

    tok = WorldTokenizer.from_file("rwkv_vocab_v20230424.txt")
    tok.encode("Hello").ids   ->  [33155, ...]        tok.decode(ids) -> str

``encode(text).ids``, ``decode(ids)`` and ``token_to_id`` are the calls subquad makes of a Hugging Face
``tokenizers.Tokenizer`` (the server's ``add_special_tokens`` / ``skip_special_tokens`` keywords taken too), so
``from_pretrained`` returns one for a ``.pth`` with the vocabulary file beside it, and for a GGUF file of RWKV's
world vocabulary (``models.gguf.vocab``: there token 0 is ``<s>``, a special token matched in text as a
``tokenizers`` special token is).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from types import SimpleNamespace

VOCAB_FILE = "rwkv_vocab_v20230424.txt"


class WorldTokenizer:
    """Greedy longest-match over a byte trie (module docstring). ``vocab``: {token bytes: id}; ``special``:
    {text: id} of special tokens, found in the text before the trie runs on the pieces between them, and left
    out of ``decode`` unless ``skip_special_tokens=False``."""

    def __init__(self, vocab: dict, special: dict | None = None):
        if not vocab or any(not isinstance(t, bytes) or not t for t in vocab):
            raise ValueError("vocab must map non-empty byte strings to ids")
        if any(not isinstance(t, str) or not t for t in special or {}):
            raise ValueError("special must map non-empty strings to ids")
        self.id_to_bytes = {i: t for t, i in vocab.items()}
        self.special = dict(special or {})
        self.special_text = {i: t for t, i in self.special.items()}
        # the longest first, so that a special token holding another is found whole
        self._split = re.compile("(" + "|".join(map(re.escape, sorted(self.special, key=len, reverse=True))) + ")") \
            if self.special else None
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

    def encode(self, text: str, add_special_tokens: bool = True):
        """An object with ``.ids``, as ``tokenizers.Tokenizer.encode`` returns. ``add_special_tokens``: the world
        vocabulary adds none (llama.cpp: no BOS for RWKV), taken for the server's calls."""
        if self._split is None:
            return SimpleNamespace(ids=self.encode_bytes(text.encode("utf-8")))
        ids = []
        for k, piece in enumerate(self._split.split(text)):     # odd pieces: the special tokens found
            ids += [self.special[piece]] if k % 2 else self.encode_bytes(piece.encode("utf-8"))
        return SimpleNamespace(ids=ids)

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        """The text of ``ids``; special tokens (their text with ``skip_special_tokens=False``), id 0 of the
        vocabulary file (end-of-text) and unknown ids decode to nothing, broken UTF-8 to U+FFFD."""
        keep = {} if skip_special_tokens else self.special_text
        return b"".join(self.id_to_bytes.get(int(i)) or keep.get(int(i), "").encode("utf-8")
                        for i in ids).decode("utf-8", errors="replace")

    def token_to_id(self, text: str) -> int | None:
        """The id of the token spelling ``text`` (a special token's, or the token of its UTF-8 bytes); None."""
        if text in self.special:
            return self.special[text]
        node = self.trie
        for byte in text.encode("utf-8"):
            node = node.get(byte)
            if node is None:
                return None
        return node.get(None)

    def get_vocab_size(self) -> int:
        return max([*self.id_to_bytes, *self.special_text]) + 1
