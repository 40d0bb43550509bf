"""The request handling behind the HTTP routes (``api.create_app``): authorisation, the bounded body, tokenising and
chat templating off the event loop, the engine's refusals as HTTP errors, and the answer - a server-sent event
stream or the whole response - with the request cancelled when its client goes away (``api``'s module doc)."""

import asyncio
import hmac
import json
import time
import uuid

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool

from subquad.serve.engine import Engine, Event, NotAccepting, QueueFull
from subquad.serve.protocol import APIError, OptionError, Parsed, bad, option_error, parse_body

DISCONNECT_POLL = 0.25   # seconds between a plain (non-streamed) request's checks that its client is still there


class Gateway:
    """One server's request handling: the engine, the served model's name, its chat template (or None), the API key
    (None: open) and the bound on a request body in bytes."""

    def __init__(self, engine: Engine, model_name: str, chat_template, api_key: str | None, max_body: int):
        self.engine, self.model_name, self.chat_template = engine, model_name, chat_template
        self.api_key, self.max_body, self.tok = api_key, max_body, engine.tokenizer

    def authorize(self, request: Request):
        """401 unless the request carries the API key (compared in constant time); open without a key."""
        if self.api_key is None:
            return
        scheme, _, got = request.headers.get("authorization", "").strip().partition(" ")
        # the scheme's case is free (RFC 9110: "bearer" is Bearer); the key compared in constant time
        if scheme.lower() != "bearer" or not hmac.compare_digest(got.strip().encode(), self.api_key.encode()):
            raise APIError(401, "missing or incorrect API key (send Authorization: Bearer KEY)",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    def too_large(self):
        """413, closing the connection: the rest of the body is never read."""
        return APIError(413, f"the request body is over {self.max_body:,} bytes (--max-body-mb)",
                        code="request_too_large", headers={"Connection": "close"})

    async def read(self, request: Request) -> dict:
        """The authorised request's JSON object body, read chunk by chunk up to ``max_body`` bytes (else 413 as
        soon as it passes), parsed in a worker thread."""
        self.authorize(request)
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > self.max_body:
            raise self.too_large()
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > self.max_body:
                raise self.too_large()
            chunks.append(chunk)
        return await run_in_threadpool(parse_body, b"".join(chunks))

    def check_model(self, name, optional=False):
        """404 for a model name this server does not serve (OpenAI's model_not_found); None passes if ``optional``."""
        if name != self.model_name and not (optional and name is None):
            raise APIError(404, f"the model {name!r} does not exist; this server serves {self.model_name!r}", "model",
                           code="model_not_found")

    async def encode(self, text: str, special: bool, field: str, empty_ok: bool = False) -> list[int]:
        """Text -> token ids, in a worker thread, or a 400 naming ``field`` (no tokenizer, text it cannot encode,
        no tokens unless ``empty_ok``)."""
        if self.tok is None:
            raise bad(field, f"{field}: this model has no tokenizer; send token ids")
        try:
            ids = (await run_in_threadpool(self.tok.encode, text, add_special_tokens=special)).ids
        except (TypeError, ValueError, UnicodeError) as e:      # protocol refuses lone surrogates before this
            raise bad(field, f"{field}: the tokenizer cannot encode this text ({type(e).__name__})") from None
        if not ids and not empty_ok:
            raise bad(field, f"{field} encodes to no token")
        return ids

    async def render_chat(self, messages, add_generation_prompt: bool = True) -> str:
        """The folder's chat template on ``messages``, in a worker thread; 400 naming messages if it refuses."""
        if self.chat_template is None:
            raise bad("messages", "this model has no chat template (tokenizer_config.json's chat_template or "
                                  "chat_template.jinja in its folder; subquad serve --chat-template FILE); use "
                                  "/v1/completions")
        from subquad.serve.chat import TemplateError

        try:
            return await run_in_threadpool(self.chat_template.render, messages,
                                           add_generation_prompt=add_generation_prompt)
        except TemplateError as e:
            raise bad("messages", f"messages: {e}") from None

    def submit(self, parsed: Parsed, ids: list[int], field: str, on_event, boundaries=()):
        """Hand the request to the engine, its refusals turned into HTTP errors (429, 503, 400 by field)."""
        p = parsed.params
        if not parsed.max_tokens_given and field == "messages":   # chat: up to the context, as OpenAI's default
            p.max_tokens = max(1, self.engine.max_context - len(ids))
        try:
            return self.engine.submit(ids, p, on_event, boundaries=boundaries)
        except QueueFull as e:
            raise APIError(429, f"the server is busy: {e}; retry later", code="rate_limit_exceeded",
                           type="rate_limit_error", headers={"Retry-After": "1"}) from None
        except NotAccepting as e:
            raise APIError(503, str(e), type="server_error") from None
        except OptionError as e:
            raise option_error(e) from None
        except ValueError as e:                 # the prompt's ids (the engine names them "prompt")
            raise bad(field if str(e).startswith("prompt") else None, str(e)) from None

    async def run(self, request: Request, parsed: Parsed, ids: list[int], field: str, render, boundaries=()):
        """Submit and answer: a server-sent event stream, or the whole response once every choice has ended.
        ``boundaries``: the prompt's chat-message ends (prefix checkpoints are kept there)."""
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        out: list = []                          # a whole response's events, by choice (filled once n is known)

        def on_event(ev: Event):
            """From the engine's thread: queue the event on this request's event loop - for a whole response
            only each choice's last, the others kept in ``out`` as they come (read once every choice has ended),
            so a token does not wake the loop and take the interpreter from the engine's thread."""
            if not parsed.stream:
                out[ev.index].append(ev)
                if ev.finish_reason is None:
                    return
            try:
                loop.call_soon_threadsafe(events.put_nowait, ev)
            except RuntimeError:            # the event loop is gone (shutdown): nobody is listening
                pass

        on_event.subquad_internal = True    # touches no model: the engine's steady span goes on (kernels.steady)
        out.extend([] for _ in range(parsed.params.n))
        seq = self.submit(parsed, ids, field, on_event, boundaries)
        rid, now = render.prefix + uuid.uuid4().hex[:24], int(time.time())
        if parsed.stream:
            return StreamingResponse(self._stream(seq, events, render, rid, now, parsed.include_usage),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        ended, check_at = 0, time.monotonic() + DISCONNECT_POLL
        try:
            while ended < len(seq.choices):
                try:
                    ev = await asyncio.wait_for(events.get(), DISCONNECT_POLL)
                except asyncio.TimeoutError:
                    ev = None
                if time.monotonic() >= check_at:            # asked on a clock: tokens may never stop arriving
                    check_at = time.monotonic() + DISCONNECT_POLL
                    if await request.is_disconnected():
                        return JSONResponse({}, status_code=499)
                if ev is not None:
                    ended += 1                                # a choice's last event (``on_event``)
        finally:
            self.cancel(seq)
        return JSONResponse(render.whole(rid, now, out, self.usage(seq)))

    async def _stream(self, seq, events, render, rid, now, include_usage):
        """The server-sent events of one request (its choices' events interleaved, each chunk naming its
        index), "data: [DONE]" last; cancels it if the client goes away."""
        try:
            ended = 0
            while ended < len(seq.choices):
                ev = await events.get()
                for chunk in render.chunks(rid, now, ev):
                    yield f"data: {json.dumps(chunk)}\n\n"
                ended += ev.finish_reason is not None
            if include_usage:
                yield f"data: {json.dumps(render.usage_chunk(rid, now, self.usage(seq)))}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            self.cancel(seq)                      # the client went away: free its rows

    def cancel(self, seq):
        """Cancel every choice of the request still running."""
        for s in seq.choices:
            if s.finish_reason is None:
                self.engine.cancel(s)

    def usage(self, seq) -> dict:
        """OpenAI's usage object (completion tokens summed over the choices), with the prompt tokens resumed
        from the prefix cache."""
        completion = sum(len(s.tokens) for s in seq.choices)
        return {"prompt_tokens": len(seq.prompt), "completion_tokens": completion,
                "total_tokens": len(seq.prompt) + completion,
                "prompt_tokens_details": {"cached_tokens": seq.cached_tokens}}
