"""Chat templates: a checkpoint folder's messages-to-prompt template, rendered as transformers renders it (a GGUF
file's ``tokenizer.chat_template`` too: ``models.gguf.vocab`` keeps it as the folder's files would hold it).

The template is the jinja2 source under ``chat_template`` in ``tokenizer_config.json`` (a string, or a list
of named templates of which "default" is used), or the file ``chat_template.jinja`` beside it. Like
transformers' ``apply_chat_template``: a sandboxed environment with ``trim_blocks`` and ``lstrip_blocks``,
the loop-control extension, a ``tojson`` filter that keeps non-ASCII characters, ``raise_exception`` and
``strftime_now`` as globals, and the tokenizer's special tokens (``bos_token``, ``eos_token``, ...) as
variables. The rendered text is encoded without adding special tokens: the template writes them.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

SPECIAL = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


class TemplateError(ValueError):
    """The template refused the conversation (its ``raise_exception``) or failed to render it."""


class ChatTemplate:
    """``render(messages)`` -> the prompt text; ``source`` is the template's jinja2 text."""

    def __init__(self, source: str, special_tokens: dict | None = None):
        import jinja2
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise TemplateError(message)

        def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateError as e:
            raise ValueError(f"chat_template does not compile: {e}") from None
        self.source = source
        self.special_tokens = dict(special_tokens or {})

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        import jinja2

        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt, tools=None,
                                         documents=None, **self.special_tokens)
        except TemplateError:
            raise
        except jinja2.TemplateError as e:
            raise TemplateError(f"the chat template failed on these messages: {e}") from None


def load_chat_template(folder, source: str | None = None) -> ChatTemplate | None:
    """The folder's chat template (``source`` in place of it: ``chat_template_of``), or None when it has none."""
    folder = Path(folder)
    return chat_template_of({f: (folder / f).read_bytes() for f in ("tokenizer_config.json", "chat_template.jinja")
                             if (folder / f).exists()}, source)


def chat_template_of(files: dict, source: str | None = None) -> ChatTemplate | None:
    """The chat template of a folder's files ({name: bytes}: ``tokenizer_config.json``, ``chat_template.jinja``;
    a model's ``hf_source["files"]``, which a GGUF file's loader fills from its metadata), or None; ``source``
    (``serve --chat-template``) in place of theirs, with the special tokens their config names."""
    from subquad.models.hf.common import chat_template_source

    config, theirs = chat_template_source(files)
    source = source or theirs
    if not source:
        return None
    special = {}
    for name in SPECIAL:
        v = config.get(name)
        if isinstance(v, dict):
            v = v.get("content")
        if isinstance(v, str):
            special[name] = v
    return ChatTemplate(source, special)


def message_ends(template: ChatTemplate, messages: list[dict], encode, ids: list[int]) -> list[int]:
    """Where each message ends in the prompt ``ids`` (the encoding of ``template.render(messages)``), as token
    counts: the template rendered on the first i messages without a generation prompt, encoded with
    ``encode(text) -> ids``, where that is a prefix of ``ids`` (a template that renders a message differently
    once more follow, or a tokenizer that merges across the end, gives no boundary there). The prompt's own
    end is left out. Costs one render and one encoding per message, off the event loop in the server."""
    ends = []
    for i in range(1, len(messages) + 1):
        try:
            part = encode(template.render(messages[:i], add_generation_prompt=False))
        except (TemplateError, TypeError, ValueError, UnicodeError):
            continue                    # e.g. a template that refuses a conversation ending on a user turn
        if 0 < len(part) < len(ids) and ids[:len(part)] == part and (not ends or len(part) > ends[-1]):
            ends.append(len(part))
    return ends
