"""Structured output: ``response_format`` (OpenAI's JSON mode and JSON schema) as a mask on each row's logits.

    out, _ = model.generate(ids, 200, tokenizer=tok, response_format={"type": "json_object"})
    out, _ = model.generate(ids, 200, tokenizer=tok, response_format={"type": "json_schema", "json_schema":
                            {"name": "point", "schema": {"type": "object", "properties": {"x": {"type": "number"}}}}})

Each row keeps a matcher of the grammar (llguidance, the library llama.cpp and vLLM use; the optional extra
``grammar``): before each draw every token that cannot continue a string of the grammar gets logit -inf, after
it the drawn token advances the matcher; when the grammar is complete the row ends (the end-of-text token is
then the only one allowed, and a row that draws it or cannot continue is finished). The mask is computed on the
CPU from the tokenizer's bytes, so it holds for any tokenisation of the output. Formats:

    {"type": "text"}                                       no constraint
    {"type": "json_object"}                                any JSON object
    {"type": "json_schema", "json_schema": {"schema": S}}  JSON valid under schema S (``name``, ``strict`` read
                                                           and ignored, as OpenAI-compatible servers do)

Between JSON's tokens the grammar allows what llama.cpp's JSON grammars allow (``json_schema_to_grammar``'s
``space``): nothing, one space, or one or two newlines and up to 20 spaces or tabs - so a model writes the JSON it
learnt (``{"a": 1}``, indented objects; with no whitespace at all, a model that puts a space after a colon is
pushed through tokens it never writes there: ``{"name":",carol"``), and cannot spend its tokens on runs of
spaces. A schema's own llguidance options replace these (``"x-guidance": {"whitespace_flexible": true}``: any
whitespace; ``{"whitespace_flexible": false}``: none).
"""

from __future__ import annotations

import json
import weakref

import torch

FORMATS = ("text", "json_object", "json_schema")
_TOKENIZERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()   # tokenizer -> llguidance's (built once)


class FormatError(ValueError):
    """A bad ``response_format``, naming the field."""


def check_format(response_format) -> dict | None:
    """The JSON schema a ``response_format`` asks for (``{}``-like for json_object: any object), None for text
    or None; FormatError naming the field for anything else."""
    if response_format is None:
        return None
    if not isinstance(response_format, dict) or response_format.get("type") not in FORMATS:
        raise FormatError(f"response_format must be an object whose type is one of {FORMATS}, got "
                          f"{response_format!r}")
    kind = response_format["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    spec = response_format.get("json_schema")
    schema = spec.get("schema", {}) if isinstance(spec, dict) else None
    if schema is True:                  # JSON Schema's "anything": as no schema, any object
        schema = {}
    if not isinstance(schema, dict):
        raise FormatError("response_format.json_schema must be an object holding the JSON schema under 'schema', "
                          f"got {spec!r}")
    return schema or {"type": "object"}


SPACE = r"(?: |\n{1,2}[ \t]{0,20})"       # the whitespace allowed between JSON's tokens (module doc)
END_OF_TEXT = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "<|im_end|>")


def _end_of_text(tokenizer) -> int:
    """A model without end-of-text ids (one trained here): its tokenizer's end-of-text token (runs train
    "<|endoftext|>"), else its first special token, else 0 - the grammar allows it where the output may end."""
    for name in END_OF_TEXT:
        t = tokenizer.token_to_id(name)
        if t is not None:
            return t
    special = sorted(i for i, a in tokenizer.get_added_tokens_decoder().items() if a.special)
    return special[0] if special else 0


def _llguidance():
    try:
        import llguidance
    except ImportError:
        raise ImportError("response_format needs llguidance: pip install 'subquad[grammar]' "
                          "(or llguidance==1.9.1)") from None
    return llguidance


class Grammar:
    """A compiled ``response_format`` for one tokenizer (a ``tokenizers.Tokenizer``), ``vocab_size`` the model's
    (its head may be wider than the tokenizer) and ``eos_ids`` the end-of-text ids (the first ends a complete
    output). ``matcher()`` -> a fresh ``RowMatcher``."""

    def __init__(self, response_format, tokenizer, vocab_size: int, eos_ids=()):
        schema = check_format(response_format)
        if schema is None:
            raise FormatError("response_format of type 'text' needs no grammar")
        if tokenizer is None or not hasattr(tokenizer, "to_str"):
            raise FormatError("response_format needs the model's tokenizer (a tokenizers.Tokenizer: generate(..., "
                              f"tokenizer=tok)), got {type(tokenizer).__name__}")
        llg = _llguidance()
        eos = list(eos_ids)[:1] or [_end_of_text(tokenizer)]
        key = (vocab_size, eos[0])
        cache = _TOKENIZERS.setdefault(tokenizer, {})
        if key not in cache:
            try:
                cache[key] = llg.LLTokenizer(tokenizer.to_str(), n_vocab=max(vocab_size, tokenizer.get_vocab_size()),
                                             eos_token=eos[0])
            except ValueError as e:          # e.g. a word-level tokenizer: no bytes to match the grammar against
                raise FormatError(f"response_format: the grammar library cannot use this tokenizer ({e})") from None
        self.lltok, self.vocab_size, self.eos = cache[key], vocab_size, eos[0]
        schema = {"x-guidance": {"whitespace_flexible": False, "whitespace_pattern": SPACE}, **schema}
        try:
            self.grammar = llg.LLMatcher.grammar_from_json_schema(json.dumps(schema))
        except (ValueError, TypeError) as e:
            raise FormatError(f"response_format: the JSON schema is not usable: {e}") from None
        probe = llg.LLMatcher(self.lltok, self.grammar)
        if probe.is_error():
            raise FormatError(f"response_format: the JSON schema is not usable: {probe.get_error()}")

    def matcher(self) -> RowMatcher:
        return RowMatcher(_llguidance().LLMatcher(self.lltok, self.grammar), self.vocab_size)


class RowMatcher:
    """One row's place in the grammar: ``allowed()`` the (vocab,) bool mask of tokens that may come next,
    ``consume(token)`` advances, ``done`` once the grammar is complete (or cannot continue)."""

    def __init__(self, matcher, vocab_size: int):
        self.m, self.V = matcher, vocab_size
        self.words = (vocab_size + 31) // 32
        self.bits = torch.full((1, self.words), -1, dtype=torch.int32)
        self._shift = torch.arange(32, dtype=torch.int32)

    def allowed(self) -> torch.Tensor:
        from llguidance.torch import fill_next_token_bitmask

        fill_next_token_bitmask(self.m, self.bits, 0)
        return ((self.bits[0].unsqueeze(-1) >> self._shift) & 1).flatten()[:self.V].bool()

    def consume(self, token: int) -> None:
        if not self.m.is_stopped():
            self.m.consume_token(int(token))

    def along(self, drafts: list[int]) -> list[torch.Tensor]:
        """The masks at a verification's positions (speculative decoding): ``allowed()`` now, then after each
        draft in turn - up to the first draft the grammar refuses or after which it is complete (the row cannot
        go past it) - the matcher rolled back to where it was."""
        masks, taken = [self.allowed()], 0
        for d in drafts:
            if self.done or not bool(masks[-1][d]):
                break
            self.m.consume_token(int(d))
            taken += 1
            if self.done:
                break
            masks.append(self.allowed())
        self.rollback(taken)
        return masks

    def rollback(self, n: int) -> None:
        """Undo the last ``n`` tokens consumed."""
        if n:
            self.m.rollback(n)

    @property
    def done(self) -> bool:
        return self.m.is_stopped() or self.m.is_error()
