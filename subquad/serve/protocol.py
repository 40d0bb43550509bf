"""OpenAI request bodies -> what the engine needs, and OpenAI's error shape.

Every field is checked by name; a field this server does not honour is refused by name (a value that asks
for nothing - ``echo: false``, ``response_format: {"type": "text"}`` - is accepted), and so is a field neither
OpenAI nor vLLM has. ``null`` means "not given", as in OpenAI's API. vLLM's extensions are honoured: ``top_k``,
``min_p``, ``repetition_penalty``, ``stop_token_ids``, ``ignore_eos``. The sampling options' values are
checked once, by ``SamplingParams`` (``models.sampling.SamplingOptions``, the check ``generate`` runs), whose
``OptionError`` becomes a 400 naming the field; this module checks the JSON shapes around them.

A JSON string may carry a lone UTF-16 surrogate (the escape "\\ud800", or its bytes, which Python's json
decodes with surrogatepass): Python keeps it in the str, but no tokenizer encodes it and no UTF-8 response
can carry it back, so any string holding one - a value or a field's name - is refused by its path.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from subquad.serve.sampling import MAX_LOGPROBS, OptionError, SamplingParams


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


# the sampling options passed to SamplingParams as they are (their values checked there)
OPTIONS = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty",
           "seed", "n", "ignore_eos", "stop", "response_format")
# fields honoured by each route; and fields accepted only with the value that asks for nothing
SAMPLING = ("max_tokens", "stop_token_ids", "logit_bias", "stream", "stream_options", *OPTIONS)
COMPLETION_FIELDS = {"model", "prompt", "logprobs", "best_of", "user", "metadata", *SAMPLING}
CHAT_FIELDS = {"model", "messages", "max_completion_tokens", "logprobs", "top_logprobs", "user", "metadata",
               *SAMPLING}
NO_OP = {"echo": False, "suffix": "", "tools": [], "tool_choice": "none", "parallel_tool_calls": False,
         "store": False, "modalities": ["text"]}
TOOLS = {"tools", "tool_choice", "parallel_tool_calls"}
ROLES = {"system", "developer", "user", "assistant"}
MAX_COMPLETION_LOGPROBS = 5     # OpenAI's bound on completions' logprobs (chat's top_logprobs: MAX_LOGPROBS)
FIELD_OF = {"stop_ids": "stop_token_ids"}    # SamplingOptions' argument -> the request's field, where they differ


def option_error(e: OptionError) -> APIError:
    """A 400 naming the request field of a refused sampling option."""
    name = FIELD_OF.get(e.name, e.name)
    message = str(e).replace(e.name, name, 1)
    return bad(name, message if len(message) <= 300 else message[:300] + "...")   # it may quote a long value


def _params(**kw) -> SamplingParams:
    """``SamplingParams`` (every option's value checked there), or a 400 naming the field at fault."""
    try:
        return SamplingParams(**kw)
    except OptionError as e:
        raise option_error(e) from None


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


def _check_fields(body, allowed):
    """Refuse by name every field not honoured here, unless it asks for nothing (``NO_OP``) or is null."""
    for name, v in body.items():
        if name in allowed or v is None:
            continue
        if name in NO_OP:
            if not _asks_nothing(v, NO_OP[name]):
                if name in TOOLS:
                    raise bad(name, f"{name}: tools and function calling are not supported by this server (send "
                                    f"no {name}, or {json.dumps(NO_OP[name])})")
                shown = json.dumps(v)
                shown = shown if len(shown) <= 40 else shown[:37] + "..."
                raise bad(name, f"{name}={shown} is not supported by this server "
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
    meta = body.get("metadata")                 # tags for a stored completion (OpenAI's): nothing is stored here
    if meta is not None and (not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values())):
        raise bad("metadata", "metadata must be an object of string values")
    sampling = {name: body[name] for name in OPTIONS if body.get(name) is not None}
    if type(sampling.get("top_k")) is int and sampling["top_k"] in (-1, 0):
        del sampling["top_k"]                   # vLLM's "no top-k"
    if body.get("stop_token_ids") is not None:
        sampling["stop_ids"] = body["stop_token_ids"]
    bias = body.get("logit_bias")
    if bias is not None:                     # JSON's keys are strings: OpenAI's are token ids written in decimal
        if not isinstance(bias, dict) or any(not re.fullmatch(r"[0-9]{1,12}", k) for k in bias):
            raise bad("logit_bias", "logit_bias must map token ids (\"50256\") to values in [-100, 100], got "
                                    f"{json.dumps(bias)[:40]}")
        sampling["logit_bias"] = {int(k): v for k, v in bias.items()}
    return model, stream, include_usage, sampling


def parse_completion(body: dict, max_context: int) -> Parsed:
    """A /v1/completions body -> ``Parsed`` (the prompt a string or token ids); max_tokens up to ``max_context``."""
    model, stream, include_usage, sampling = _common(body, COMPLETION_FIELDS)
    if body.get("logprobs") is False:
        body = {**body, "logprobs": None}
    logprobs = _int(body, "logprobs", 0, MAX_COMPLETION_LOGPROBS)
    best_of = _int(body, "best_of", 1)
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
    params = _params(max_tokens=max_tokens or 16, logprobs=logprobs, **sampling)
    if best_of is not None and best_of != params.n:
        raise bad("best_of", f"best_of={best_of} is not supported by this server (only best_of equal to n, or null)")
    return Parsed(model, prompt, params, max_tokens is not None, stream, include_usage)


def parse_chat(body: dict, max_context: int) -> Parsed:
    """A /v1/chat/completions body -> ``Parsed`` (the prompt the checked messages); max_tokens up to ``max_context``."""
    model, stream, include_usage, sampling = _common(body, CHAT_FIELDS)
    max_tokens = _int(body, "max_tokens", 1, max_context)
    mct = _int(body, "max_completion_tokens", 1, max_context)
    if max_tokens is not None and mct is not None and max_tokens != mct:
        raise bad("max_completion_tokens", "give max_tokens or max_completion_tokens, not two different values")
    max_tokens = max_tokens if max_tokens is not None else mct
    logprobs = body.get("logprobs")
    if logprobs is not None and not isinstance(logprobs, bool):
        raise bad("logprobs", f"logprobs must be a boolean, got {json.dumps(logprobs)[:40]}")
    top = _int(body, "top_logprobs", 0, MAX_LOGPROBS)
    if top and not logprobs:
        raise bad("top_logprobs", "top_logprobs needs logprobs: true")
    params = _params(max_tokens=max_tokens or 16, logprobs=(top or 0) if logprobs else None, **sampling)
    return Parsed(model, parse_messages(body), params, max_tokens is not None, stream, include_usage)


def parse_messages(body: dict) -> list[dict]:
    """The checked chat messages of a body: [{role, content, name?}], content parts joined into one string."""
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
    return out


def _bool(body, name, default: bool) -> bool:
    """An optional boolean field."""
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad(name, f"{name} must be a boolean, got {json.dumps(v)[:40]}")
    return v


def parse_tokenize(body: dict) -> dict:
    """A /tokenize body (vLLM's) -> {model, prompt} or {model, messages}, with ``add_special_tokens`` (default:
    true for a prompt, false for messages, whose template writes them) and ``add_generation_prompt``
    (messages only, default true) - what /v1/completions and /v1/chat/completions would encode."""
    chat = "messages" in body
    _check_fields(body, {"model", "messages", "add_generation_prompt", "add_special_tokens"} if chat
                  else {"model", "prompt", "add_special_tokens"})
    out = {"model": body.get("model"), "add_special_tokens": _bool(body, "add_special_tokens", not chat)}
    if out["model"] is not None and not isinstance(out["model"], str):
        raise bad("model", "model must be a string")
    if chat:
        out["messages"] = parse_messages(body)
        out["add_generation_prompt"] = _bool(body, "add_generation_prompt", True)
    else:
        if not isinstance(body.get("prompt"), str):
            raise bad("prompt", "prompt must be a string (or send messages)")
        out["prompt"] = body["prompt"]
    return out


def parse_detokenize(body: dict, vocab_size: int) -> dict:
    """A /detokenize body (vLLM's) -> {model, tokens}, every id in the vocabulary."""
    _check_fields(body, {"model", "tokens"})
    model, tokens = body.get("model"), body.get("tokens")
    if model is not None and not isinstance(model, str):
        raise bad("model", "model must be a string")
    if not isinstance(tokens, list) or any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size
                                           for t in tokens):
        raise bad("tokens", f"tokens must be a list of token ids in [0, {vocab_size})")
    return {"model": model, "tokens": tokens}
