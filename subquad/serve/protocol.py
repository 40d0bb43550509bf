"""OpenAI request bodies -> what the engine needs, and OpenAI's error shape.

Every field is checked by name; a field this server does not honour is refused by name (a value that asks
for nothing - ``n: 1``, ``presence_penalty: 0``, ``echo: false`` - is accepted), and so is a field OpenAI
does not have. ``null`` means "not given", as in OpenAI's API. ``top_k`` is an extension (vLLM's and
llama.cpp's).

A JSON string may carry a lone UTF-16 surrogate (the escape "\\ud800", or its bytes, which Python's json
decodes with surrogatepass): Python keeps it in the str, but no tokenizer encodes it and no UTF-8 response
can carry it back, so any string holding one - a value or a field's name - is refused by its path.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass

from subquad.serve.sampling import MAX_LOGPROBS, SamplingParams


class APIError(Exception):
    """An HTTP error in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error", headers: dict | None = None):
        """The status, a message and the offending field (both made UTF-8-safe: they may quote the request)."""
        message, param = printable(message), None if param is None else printable(param)
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type
        self.headers = headers or {}

    def body(self) -> dict:
        """OpenAI's error body."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(param: str | None, message: str) -> APIError:
    """A 400 naming the field at fault."""
    return APIError(400, message, param)


def printable(text: str) -> str:
    """``text`` with any lone surrogate written as its escape ("\\ud800"), so it can be sent as UTF-8."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode("utf-8")


_ESCAPED_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]")


def _refuse_surrogates(body: dict, raw: bytes):
    """400 naming the first string (a value or a field's name, by its path) that holds a lone surrogate."""
    if raw.isascii() and not _ESCAPED_SURROGATE.search(raw):    # the usual body (or ids): nothing to walk
        return
    stack = [(body, None)]
    while stack:
        obj, where = stack.pop()
        if isinstance(obj, str):
            if printable(obj) != obj:
                raise bad(where, f"{printable(where)}: the string holds a lone UTF-16 surrogate, not a character")
        elif isinstance(obj, dict):
            for key, v in reversed(list(obj.items())):
                path = key if where is None else f"{where}.{key}"
                if printable(key) != key:
                    raise bad(path, f"the field name {printable(key)!r} holds a lone UTF-16 surrogate")
                stack.append((v, path))
        elif isinstance(obj, list):
            stack += [(v, f"{where}[{i}]") for i, v in reversed(list(enumerate(obj)))
                      if isinstance(v, (str, list, dict))]


# fields honoured by each route; and fields accepted only with the value that asks for nothing
SAMPLING = ("max_tokens", "temperature", "top_p", "top_k", "stop", "seed", "stream", "stream_options")
COMPLETION_FIELDS = {"model", "prompt", "logprobs", "user", *SAMPLING}
CHAT_FIELDS = {"model", "messages", "max_completion_tokens", "user", *SAMPLING}
NO_OP = {"n": 1, "best_of": 1, "echo": False, "presence_penalty": 0, "frequency_penalty": 0, "logit_bias": {},
         "suffix": "", "logprobs": False, "top_logprobs": 0, "tools": [], "tool_choice": "none",
         "parallel_tool_calls": False, "response_format": {"type": "text"}}
ROLES = {"system", "developer", "user", "assistant"}


@dataclass
class Parsed:
    """A checked request: the prompt (text or token ids, or chat messages), sampling, and streaming options."""

    model: str
    prompt: object                 # str | list[int] (completions) or list[dict] (chat)
    params: SamplingParams
    max_tokens_given: bool
    stream: bool
    include_usage: bool


def parse_body(raw: bytes) -> dict:
    """The request body as a JSON object, or a 400 (not JSON, not an object, a lone surrogate in a string)."""
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise bad(None, f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise bad(None, f"the request body must be a JSON object, got {type(body).__name__}")
    _refuse_surrogates(body, raw)
    return body


def _int(body, name, low=None, high=None):
    """An optional integer field within [low, high] (bools refused: JSON's true is not 1)."""
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise bad(name, f"{name} must be an integer, got {json.dumps(v)[:40]}")
    if (low is not None and v < low) or (high is not None and v > high):
        rng = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise bad(name, f"{name} must be {rng}, got {v}")
    return v


def _number(body, name):
    """An optional finite number field, as a float."""
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise bad(name, f"{name} must be a finite number, got {json.dumps(v)[:40]}")
    return float(v)


def _check_fields(body, allowed):
    """Refuse by name every field not honoured here, unless it asks for nothing (``NO_OP``) or is null."""
    for name, v in body.items():
        if name in allowed or v is None:
            continue
        if name in NO_OP:
            if not _asks_nothing(v, NO_OP[name]):
                raise bad(name, f"{name}={json.dumps(v)[:40]} is not supported by this server "
                                f"(only {json.dumps(NO_OP[name])})")
            continue
        raise bad(name, f"unknown or unsupported parameter {name!r}")


def _asks_nothing(v, default) -> bool:
    """Whether ``v`` is the value of an unsupported field that asks for nothing (its default)."""
    if isinstance(default, bool):
        return v is default
    if isinstance(default, (int, float)):
        return not isinstance(v, bool) and isinstance(v, (int, float)) and v == default
    return type(v) is type(default) and v == default


def _common(body, allowed) -> tuple:
    """The fields both routes share -> (model, stream, include_usage, SamplingParams keyword arguments)."""
    _check_fields(body, allowed)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad("model", "model must be a non-empty string (see GET /v1/models)")
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise bad("stream", f"stream must be a boolean, got {json.dumps(stream)[:40]}")
    opts = body.get("stream_options")
    include_usage = False
    if opts is not None:
        if not stream:
            raise bad("stream_options", "stream_options is only allowed with stream: true")
        if not isinstance(opts, dict) or set(opts) - {"include_usage"} or \
                not isinstance(opts.get("include_usage", False), bool):
            raise bad("stream_options", "stream_options must be {\"include_usage\": true|false}")
        include_usage = opts.get("include_usage", False)
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise bad("user", "user must be a string")
    temperature = _number(body, "temperature")
    if temperature is not None and temperature < 0:
        raise bad("temperature", f"temperature must be >= 0, got {temperature}")
    top_p = _number(body, "top_p")
    if top_p is not None and not 0 < top_p <= 1:
        raise bad("top_p", f"top_p must lie in (0, 1], got {top_p}")
    top_k = _int(body, "top_k", 1)
    seed = _int(body, "seed", 0, 2 ** 63 - 1)
    stop = body.get("stop")
    if stop is not None:
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or len(stop) > 4 or any(not isinstance(s, str) or not s for s in stop):
            raise bad("stop", "stop must be a non-empty string or a list of up to 4 non-empty strings")
    sampling = dict(temperature=1.0 if temperature is None else temperature, top_p=top_p, top_k=top_k,
                    seed=seed, stop=stop or [])
    return model, stream, include_usage, sampling


def parse_completion(body: dict, max_context: int) -> Parsed:
    """A /v1/completions body -> ``Parsed`` (the prompt a string or token ids); max_tokens up to ``max_context``."""
    model, stream, include_usage, sampling = _common(body, COMPLETION_FIELDS)
    if body.get("logprobs") is False:
        body = {**body, "logprobs": None}
    logprobs = _int(body, "logprobs", 0, MAX_LOGPROBS)
    max_tokens = _int(body, "max_tokens", 1, max_context)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]                                 # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise bad("prompt", "prompt must not be empty")
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        pass
    elif isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        raise bad("prompt", "prompt: one prompt per request (a string or a list of token ids), not a batch")
    else:
        raise bad("prompt", "prompt must be a non-empty string or a non-empty list of token ids")
    params = SamplingParams(max_tokens=max_tokens or 16, logprobs=logprobs, **sampling)
    return Parsed(model, prompt, params, max_tokens is not None, stream, include_usage)


def parse_chat(body: dict, max_context: int) -> Parsed:
    """A /v1/chat/completions body -> ``Parsed`` (the prompt the checked messages); max_tokens up to ``max_context``."""
    model, stream, include_usage, sampling = _common(body, CHAT_FIELDS)
    max_tokens = _int(body, "max_tokens", 1, max_context)
    mct = _int(body, "max_completion_tokens", 1, max_context)
    if max_tokens is not None and mct is not None and max_tokens != mct:
        raise bad("max_completion_tokens", "give max_tokens or max_completion_tokens, not two different values")
    max_tokens = max_tokens if max_tokens is not None else mct
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("messages", "messages must be a non-empty list of {role, content} objects")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad(where, f"{where} must be an object with role and content")
        extra = set(m) - {"role", "content", "name"}
        if extra:
            raise bad(f"{where}.{sorted(extra)[0]}", f"{where}: unsupported field {sorted(extra)[0]!r}")
        if m.get("role") not in ROLES:
            raise bad(f"{where}.role", f"{where}.role must be one of {', '.join(sorted(ROLES))}, "
                                       f"got {json.dumps(m.get('role'))[:40]}")
        content = m.get("content")
        if isinstance(content, list):                      # content parts: text only
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       and set(p) <= {"type", "text"} for p in content):
                raise bad(f"{where}.content", f"{where}.content parts must be {{\"type\": \"text\", \"text\": ...}}"
                                              " (no images or audio)")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise bad(f"{where}.content", f"{where}.content must be a string, got {json.dumps(content)[:40]}")
        if "name" in m and not isinstance(m["name"], str):
            raise bad(f"{where}.name", f"{where}.name must be a string")
        out.append({"role": m["role"], "content": content, **({"name": m["name"]} if "name" in m else {})})
    params = SamplingParams(max_tokens=max_tokens or 16, **sampling)
    return Parsed(model, out, params, max_tokens is not None, stream, include_usage)
