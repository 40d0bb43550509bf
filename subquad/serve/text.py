"""A sequence's text as its tokens arrive: incremental decoding and stop strings.

Decoding token by token must not cut a multi-byte character in half (a byte-level BPE token may hold part of
one) nor lose the space a SentencePiece-style decoder strips from a sequence's first token. So, as vLLM
does, each new token is decoded together with a few tokens before it, and only text that has grown and no
longer ends in U+FFFD (an incomplete character) is released.

Stop strings are matched on the decoded text, so a stop string that spans two tokens is found. Text that
might be the beginning of a stop string is held back until it is not (OpenAI's output never contains the
stop string).
"""

from __future__ import annotations


class TextStream:
    """``push(ids)`` with every token generated so far -> (newly released text, stopped at a stop string).

    ``decode(ids) -> str`` is the tokenizer's decoding (special tokens skipped). ``text`` is everything
    released so far; after a stop, it ends just before the stop string."""

    def __init__(self, decode, stops=()):
        self.decode = decode
        self.stops = list(stops)
        self.text = ""              # released
        self._all = ""              # decoded, released or held back
        self._prefix, self._read = 0, 0
        self._ids: list[int] = []
        self._n = 0                 # how many of _ids the last push was given (the caller's list grows after it)

    def push(self, ids: list[int]) -> tuple[str, bool]:
        self._ids, self._n = ids, len(ids)
        cut = self._decode_new(ids, partial=False)
        if cut is not None:
            return self._release(self._all[:cut]), True
        return self._release(self._all[:len(self._all) - self._held()]), False

    def flush(self) -> str:
        """The text held back, released at the end of the sequence (it ended before completing a stop) - its last
        tokens' too where they end inside a character (as U+FFFD, as the tokenizer decodes the whole sequence)."""
        # (a stop token appended after the last push is not text: only what that push was given)
        cut = self._decode_new(self._ids[:self._n], partial=True) if self._read < self._n else None
        return self._release(self._all if cut is None else self._all[:cut])

    def _decode_new(self, ids: list[int], partial: bool):
        """Decode the tokens after the last read ones into ``_all`` - unless the text has not grown, or (not
        ``partial``) ends inside a character - and return where a stop string begins in it, or None."""
        prefix_text = self.decode(ids[self._prefix:self._read])
        new_text = self.decode(ids[self._prefix:])
        if len(new_text) <= len(prefix_text) or (not partial and new_text.endswith("\ufffd")):
            return None
        searched = len(self._all)
        self._all += new_text[len(prefix_text):]
        self._prefix, self._read = self._read, len(ids)
        return self._find_stop(searched)

    def _release(self, upto: str) -> str:
        delta = upto[len(self.text):] if upto.startswith(self.text) else ""
        self.text += delta
        return delta

    def _find_stop(self, searched: int):
        """Index in the text where the first stop string begins, looking only where new text could end one."""
        best = None
        for s in self.stops:
            i = self._all.find(s, max(0, searched - len(s) + 1))
            if i >= 0 and (best is None or i < best):
                best = i
        return best

    def _held(self) -> int:
        """Characters at the end of the text that begin some stop string (and so may not be released yet)."""
        held = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(self._all)), held, -1):
                if self._all.endswith(s[:k]):
                    held = k
                    break
        return held
