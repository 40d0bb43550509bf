"""The HTTP layer: OpenAI's routes over an ``Engine`` (FastAPI), thin on purpose.

    POST /v1/completions, /v1/chat/completions     (stream: server-sent events, "data: [DONE]" last)
    POST /tokenize, /detokenize                    (vLLM's: text or messages -> ids, ids -> text)
    GET  /v1/models, /v1/models/{id}, /health, /metrics   (/metrics: Prometheus text)

Requests are checked in ``protocol``; every refusal is OpenAI's error body with the offending field in ``param``. A
body is read chunk by chunk and refused with 413 (closing the connection) as soon as it passes ``max_body`` bytes,
or at once when its Content-Length does; JSON parsing, tokenising and chat templating run in a worker thread, off
the event loop (``gateway.Gateway``: the handling behind every route), so one large prompt does not stall every
other stream. The engine runs in its own thread and hands events to the request's asyncio queue. A client that goes
away cancels its request (every choice of it): a stream when the response task is cancelled, a plain request when
the connection reports the disconnect (asked every ``gateway.DISCONNECT_POLL`` seconds, whether or not tokens are
arriving). With an API key, /v1 routes and /tokenize, /detokenize need ``Authorization: Bearer KEY`` (/health and
/metrics stay open for probes and scrapers).
"""


import functools
import re
import time

from subquad.serve.chat import message_ends
from subquad.serve.engine import Engine
from subquad.serve.protocol import APIError, bad, parse_chat, parse_completion, parse_detokenize, parse_tokenize

MAX_BODY_MB = 8.0        # the default bound of a request body (--max-body-mb)

METRICS = [  # name, type, help
    ("queue_length", "gauge", "Requests waiting for a batch slot."),
    ("active_sequences", "gauge", "Requests prefilling or decoding."),
    ("generated_tokens_per_second", "gauge", "Tokens generated per second over the last 10 s."),
    ("state_bytes", "gauge", "Bytes of the live decoding states (allocated, KV caches included)."),
    ("prefix_cache_bytes", "gauge", "Bytes held by the prefix-state cache (exact)."),
    ("prefix_cache_entries", "gauge", "States held by the prefix-state cache."),
    ("prefix_cache_max_bytes", "gauge", "The prefix-state cache's bound (--state-cache-mb)."),
    ("memory_budget_bytes", "gauge", "Admission budget for states plus the cache (0: none)."),
    ("requests_total", "counter", "Requests accepted."),
    ("finished_total", "counter", "Sequences (a request's n choices each) that ended by themselves (stop, length)."),
    ("cancelled_total", "counter", "Sequences cancelled (client gone) or aborted at shutdown."),
    ("errors_total", "counter", "Sequences ended by an engine error."),
    ("decode_steps_total", "counter", "Batched decoding steps."),
    ("decode_rows_total", "counter", "Rows stepped, summed over decoding steps (/ steps: the mean batch)."),
    ("prefill_tokens_total", "counter", "Prompt tokens prefilled (not taken from the prefix cache)."),
    ("prefill_forwards_total", "counter", "Prefill forwards (the pieces due together share one: / tokens)."),
    ("generated_tokens_total", "counter", "Tokens generated."),
    ("prefix_cache_hits_total", "counter", "Requests that resumed from a cached prefix state."),
    ("prefix_cache_misses_total", "counter", "Requests that found no cached prefix."),
    ("prefix_cache_hit_tokens_total", "counter", "Prompt tokens taken from the prefix cache."),
    ("verifications_total", "counter", "Decoding steps that verified drafts (--speculative)."),
    ("drafted_total", "counter", "Tokens drafted (--speculative)."),
    ("accepted_total", "counter", "Drafted tokens accepted (/ drafted: the acceptance rate)."),
]


def metrics_text(values: dict, prefix: str = "subquad_") -> str:
    """The engine's metrics in Prometheus' text format, each with its HELP and TYPE lines."""
    lines = []
    for name, kind, help in METRICS:
        lines += [f"# HELP {prefix}{name} {help}", f"# TYPE {prefix}{name} {kind}", f"{prefix}{name} {values[name]}"]
    return "\n".join(lines) + "\n"


def create_app(engine: Engine, model_name: str, chat_template=None, api_key: str | None = None,
               max_body_mb: float = MAX_BODY_MB):
    """The FastAPI app serving ``engine`` under ``model_name``; request bodies up to ``max_body_mb`` MiB."""
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, PlainTextResponse
    from starlette.concurrency import run_in_threadpool
    from starlette.exceptions import HTTPException as StarletteHTTPException

    from subquad.serve.gateway import Gateway

    app = FastAPI(title="subquad", docs_url=None, redoc_url=None, openapi_url=None)
    created = int(time.time())

    @app.exception_handler(APIError)
    async def _api_error(request, e: APIError):
        """A refusal of ours: OpenAI's error body, its status and headers (Retry-After, WWW-Authenticate)."""
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, e):
        """Starlette's own errors (404 route, 405 method) in OpenAI's error shape too."""
        return JSONResponse(APIError(e.status_code, str(e.detail)).body(), status_code=e.status_code)

    @app.exception_handler(Exception)
    async def _internal(request, e):
        """A bug: 500 in OpenAI's shape, naming the exception's type only (no traceback to the client)."""
        return JSONResponse(APIError(500, f"internal error: {type(e).__name__}", type="server_error").body(),
                            status_code=500)

    gate = Gateway(engine, model_name, chat_template, api_key, int(max_body_mb * 2 ** 20))

    @app.post("/v1/completions")
    async def completions(request: Request):
        """POST /v1/completions: a text prompt (encoded with special tokens) or token ids."""
        parsed = parse_completion(await gate.read(request), engine.max_context)
        gate.check_model(parsed.model)
        ids = parsed.prompt if isinstance(parsed.prompt, list) else await gate.encode(parsed.prompt, True, "prompt")
        return await gate.run(request, parsed, ids, "prompt", _Completion(model_name, gate.tok))

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        """POST /v1/chat/completions: messages rendered by the folder's chat template, then encoded as is."""
        parsed = parse_chat(await gate.read(request), engine.max_context)
        gate.check_model(parsed.model)
        text = await gate.render_chat(parsed.prompt)
        ids = await gate.encode(text, False, "messages")
        ends = await run_in_threadpool(message_ends, gate.chat_template, parsed.prompt,
                                       lambda t: gate.tok.encode(t, add_special_tokens=False).ids, ids)
        return await gate.run(request, parsed, ids, "messages", _Chat(model_name, gate.tok), ends)

    @app.post("/tokenize")
    async def tokenize(request: Request):
        """POST /tokenize (vLLM's): a prompt, or messages through the chat template -> {tokens, count,
        max_model_len}, the ids /v1/completions or /v1/chat/completions would prefill."""
        body = parse_tokenize(await gate.read(request))
        gate.check_model(body["model"], optional=True)
        if "messages" in body:
            text, field = await gate.render_chat(body["messages"], body["add_generation_prompt"]), "messages"
        else:
            text, field = body["prompt"], "prompt"
        ids = await gate.encode(text, body["add_special_tokens"], field, empty_ok=True)
        return {"tokens": ids, "count": len(ids), "max_model_len": engine.max_context}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        """POST /detokenize (vLLM's): {tokens} -> {prompt}, the ids decoded (special tokens kept)."""
        body = parse_detokenize(await gate.read(request), engine.model.config.vocab_size)
        gate.check_model(body["model"], optional=True)
        if gate.tok is None:
            raise bad("tokens", "this model has no tokenizer to decode with")
        return {"prompt": await run_in_threadpool(gate.tok.decode, body["tokens"], skip_special_tokens=False)}

    card = {"id": model_name, "object": "model", "created": created, "owned_by": "subquad",
            "max_model_len": engine.max_context}

    @app.get("/v1/models")
    async def models(request: Request):
        """GET /v1/models: the one model served, with its max context."""
        gate.authorize(request)
        return {"object": "list", "data": [card]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str, request: Request):
        """GET /v1/models/{id}: the model's card (OpenAI's retrieve), 404 for another name."""
        gate.authorize(request)
        gate.check_model(model_id)
        return card

    @app.get("/health")
    async def health():
        """GET /health: 200 while accepting, 503 while draining (load balancers stop sending)."""
        if not engine.accepting:
            return JSONResponse({"status": "draining"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        """GET /metrics: Prometheus text, open without the key for scrapers."""
        return PlainTextResponse(metrics_text(engine.metrics()), media_type="text/plain; version=0.0.4")

    return app


def token_text(tok, t: int) -> str:
    """A token as logprobs name it: its text, special tokens included ("token_id:N" without a tokenizer)."""
    return tok.decode([t], skip_special_tokens=False) if tok is not None else f"token_id:{t}"


def token_bytes(tok, t: int) -> list[int]:
    """A token's own bytes, as chat logprobs' ``bytes`` give them (OpenAI's: so that a client can join the bytes
    of a character split over tokens): a byte-level BPE's piece mapped back through GPT-2's byte alphabet,
    SentencePiece's byte-fallback piece ``<0xNN>`` as that byte, a world vocabulary's bytes, an added token's text;
    else the UTF-8 of its text (a lone byte's text is U+FFFD, its bytes are not)."""
    if tok is not None and hasattr(tok, "id_to_bytes"):              # data.rwkv_world.WorldTokenizer
        return list(tok.id_to_bytes.get(t, token_text(tok, t).encode("utf-8")))
    if tok is not None and hasattr(tok, "id_to_token"):
        piece, (_, byte_level, added, _) = tok.id_to_token(t), _facts(tok)
        if piece is not None and t in added:                           # an added token: its text as written
            return list(piece.encode("utf-8"))
        byte = re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", piece or "")
        if byte:                                                        # SentencePiece's byte fallback
            return [int(byte.group(1), 16)]
        table = _unicode_to_byte()
        if piece is not None and byte_level and all(c in table for c in piece):
            return [table[c] for c in piece]
    return list(token_text(tok, t).encode("utf-8"))


_SEEN: dict = {}      # id(tokenizer) -> (the tokenizer, kept so that its id is not reused; byte-level; added ids;
                      # its size then: a token added since is seen)


def _facts(tok) -> tuple:
    """(tok, whether it decodes as a byte-level BPE - its pieces in GPT-2's alphabet -, the ids of its added tokens
    - spelled as text, not in that alphabet -, its size), worked out once per tokenizer and size."""
    hit = _SEEN.get(id(tok))
    size = tok.get_vocab_size(with_added_tokens=True) if hasattr(tok, "get_vocab_size") else None
    if hit is None or hit[0] is not tok or hit[3] != size:
        import json

        try:
            dec = json.loads(tok.to_str()).get("decoder") or {}
        except Exception:
            dec = {}
        kinds = [dec.get("type")] + [d.get("type") for d in dec.get("decoders", []) or []]
        added = set(tok.get_added_tokens_decoder()) if hasattr(tok, "get_added_tokens_decoder") else set()
        hit = _SEEN[id(tok)] = (tok, "ByteLevel" in kinds, added, size)
    return hit


@functools.cache
def _unicode_to_byte() -> dict[str, int]:
    """GPT-2's byte alphabet inverted: each of the 256 characters a byte-level BPE spells a byte with -> the byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    out, extra = {}, 0
    for b in range(256):
        if b in printable:
            out[chr(b)] = b
        else:
            out[chr(256 + extra)] = b
            extra += 1
    return out


class _Completion:
    """/v1/completions' response shapes."""

    prefix = "cmpl-"

    def __init__(self, model, tok):
        """The served model's name and the tokenizer (None: tokens are named "token_id:N"). One per request:
        ``_streamed`` counts each choice's characters streamed so far, where its next chunk's text_offset starts."""
        self.model, self.tok = model, tok
        self._streamed: dict[int, int] = {}

    def _logprobs(self, events, offset=0):
        """The logprobs object for these events (None when not asked): tokens, their log-probs, tops, offsets."""
        evs = [e for e in events if e.token is not None and e.logprob is not None]
        if not evs:
            return None
        offsets, at = [], offset
        for e in evs:
            offsets.append(at)
            at += len(e.text)
        return {"tokens": [token_text(self.tok, e.token) for e in evs], "token_logprobs": [e.logprob for e in evs],
                "top_logprobs": [{token_text(self.tok, t): lp for t, lp in e.top_logprobs} for e in evs],
                "text_offset": offsets}

    def _obj(self, rid, now, choices, usage=None):
        """A text_completion object around these choices."""
        out = {"id": rid, "object": "text_completion", "created": now, "model": self.model, "choices": choices}
        if usage is not None:
            out["usage"] = usage
        return out

    def whole(self, rid, now, choices, usage):
        """The non-streamed response: per choice (a list of its events), every event's text joined and the last
        event's finish_reason."""
        return self._obj(rid, now, [{"index": i, "text": "".join(e.text for e in evs), "logprobs": self._logprobs(evs),
                                     "finish_reason": evs[-1].finish_reason} for i, evs in enumerate(choices)], usage)

    def chunks(self, rid, now, ev):
        """The stream chunks of one event (one per event). Its text_offset continues from the text already
        streamed for its choice, as the non-streamed response counts it (a chunk alone would start at 0)."""
        at = self._streamed.get(ev.index, 0)
        logprobs = self._logprobs([ev], at)
        self._streamed[ev.index] = at + len(ev.text)
        return [self._obj(rid, now, [{"index": ev.index, "text": ev.text, "logprobs": logprobs,
                                      "finish_reason": ev.finish_reason}])]

    def usage_chunk(self, rid, now, usage):
        """The last chunk of a stream with include_usage: no choices, the usage."""
        return self._obj(rid, now, [], usage)


class _Chat:
    """/v1/chat/completions' response shapes."""

    prefix = "chatcmpl-"

    def __init__(self, model, tok):
        """The served model's name and tokenizer (to name tokens in logprobs). One per request: ``_started``
        holds the choices whose role chunk has been streamed."""
        self.model, self.tok = model, tok
        self._started: set[int] = set()

    def _obj(self, rid, now, kind, choices, usage=None):
        """A chat.completion(.chunk) object around these choices."""
        out = {"id": rid, "object": kind, "created": now, "model": self.model, "choices": choices}
        if usage is not None:
            out["usage"] = usage
        return out

    def _entry(self, t: int, lp: float) -> dict:
        """A token in chat logprobs: its text, log-probability and UTF-8 bytes."""
        return {"token": token_text(self.tok, t), "logprob": lp, "bytes": token_bytes(self.tok, t)}

    def _logprobs(self, events):
        """OpenAI's chat logprobs, {"content": [{token, logprob, bytes, top_logprobs}]}, or None when not asked."""
        evs = [e for e in events if e.token is not None and e.logprob is not None]
        if not evs:
            return None
        return {"content": [{**self._entry(e.token, e.logprob),
                             "top_logprobs": [self._entry(t, lp) for t, lp in e.top_logprobs]} for e in evs]}

    def whole(self, rid, now, choices, usage):
        """The non-streamed response: per choice, the assistant message and the last event's finish_reason."""
        return self._obj(rid, now, "chat.completion", [
            {"index": i, "message": {"role": "assistant", "content": "".join(e.text for e in evs)},
             "logprobs": self._logprobs(evs), "finish_reason": evs[-1].finish_reason}
            for i, evs in enumerate(choices)], usage)

    def chunks(self, rid, now, ev):
        """The stream chunks of one event: its choice's role first, then a content delta (with the token's
        logprobs when asked) and the finish_reason."""
        out = []
        if ev.index not in self._started:
            self._started.add(ev.index)
            out.append(self._obj(rid, now, "chat.completion.chunk",
                                 [{"index": ev.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                   "finish_reason": None}]))
        logprobs = self._logprobs([ev])
        if ev.text or ev.finish_reason is not None or logprobs is not None:
            out.append(self._obj(rid, now, "chat.completion.chunk",
                                 [{"index": ev.index, "delta": {"content": ev.text} if ev.text else {},
                                   "logprobs": logprobs, "finish_reason": ev.finish_reason}]))
        return out

    def usage_chunk(self, rid, now, usage):
        """The last chunk of a stream with include_usage: no choices, the usage."""
        return self._obj(rid, now, "chat.completion.chunk", [], usage)
