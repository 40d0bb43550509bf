"""``subquad serve`` as a user meets it: a real server on 127.0.0.1 in a subprocess, driven by the real
``openai`` client. Three tiny random checkpoints: a pure recurrent model (Mamba), a hybrid with an attention
layer (Mamba-2 + softmax, with a tokenizer, a chat template and an end-of-text id), and the recurrent one
behind a one-slot queue. Expected outputs are computed here, independently, with ``generate`` run alone."""

from __future__ import annotations

import asyncio
import http.client
import json
import random
import select
import signal
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from tests.serve.helpers import SPECIALS, V, Server, folder, load  # noqa: E402

KEY = "sk-test"
CONTEXT = 256
LONG = 8192                # the recurrent server's context: a request long enough to be caught running
PROMPT = "w11 w40 w12 w9 w30"
BLOCK = 8                  # the hybrid server's --prefix-block


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    """(server, model, tokenizer, eos id): the hybrid folder, its end-of-text id a token its greedy answer to
    PROMPT emits a few tokens in (chosen from a first copy without one)."""
    tmp = tmp_path_factory.mktemp("serve")
    model, tok = load(folder(tmp / "probe", "bamba"))
    free = model.generate(tok.encode(PROMPT).ids, 12, temperature=0)[0]
    i = next(i for i in range(2, 12) if free[i] not in free[:i] and free[i] not in SPECIALS.values())
    path = folder(tmp / "hybrid", "bamba", template=True, eos=free[i])
    model, tok = load(path)
    (tmp / "key").write_text(KEY + "\n")                          # the key from a file, its line break dropped
    server = Server(path, "--api-key-file", tmp / "key", "--max-batch", 32, "--max-context", CONTEXT,
                    "--prefill-chunk", 32, "--prefix-block", BLOCK)
    yield server, model, tok, free[i]
    server.stop()


@pytest.fixture(scope="module")
def recurrent(tmp_path_factory):
    path = folder(tmp_path_factory.mktemp("serve") / "recurrent", "mamba2")
    model, tok = load(path)
    server = Server(path, "--max-batch", 32, "--max-context", LONG,     # no --memory-mb: the default budget
                    "--max-body-mb", 1)
    yield server, model, tok
    server.stop()


def alone(model, ids, n, temperature=0.0, seed=None, top_p=None, top_k=None, **options):
    return model.generate(ids, n, temperature=temperature, seed=seed, top_p=top_p, top_k=top_k, **options)[0]


def _mem_available() -> int:
    """MemAvailable from /proc/meminfo, in bytes (what the default --memory-mb is half of, at the server's start)."""
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))


def _wait_for(server, ok, seconds=15.0) -> dict:
    """Poll /metrics until ``ok(metrics)`` (or ``seconds`` pass); the last metrics."""
    deadline = time.monotonic() + seconds
    while True:
        m = server.metrics()
        if ok(m) or time.monotonic() > deadline:
            return m
        time.sleep(0.05)


def test_completions_plain_and_streamed_with_usage_logprobs_stop_and_end_of_text(hybrid):
    server, model, tok, eos = hybrid
    client = server.client(KEY)
    ids = tok.encode(PROMPT).ids
    want = alone(model, ids, 12)
    assert want[-1] == eos and len(want) < 12                    # generate alone stops at the end of text
    r = client.completions.create(model="hybrid", prompt=PROMPT, max_tokens=12, temperature=0, logprobs=2)
    c = r.choices[0]
    assert c.text == tok.decode(want) and c.finish_reason == "stop"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), len(want))
    with torch.no_grad():                                          # log-probabilities from one full forward
        lp = torch.log_softmax(model(torch.tensor([ids + want]))[0, len(ids) - 1:-1].double(), -1)
    assert c.logprobs.tokens == [tok.decode([t], skip_special_tokens=False) for t in want]
    assert c.logprobs.token_logprobs == pytest.approx([float(lp[j, t]) for j, t in enumerate(want)], abs=1e-4)
    assert all(len(top) == 2 and max(top.values()) == pytest.approx(float(lp[j].max()), abs=1e-4)
               for j, top in enumerate(c.logprobs.top_logprobs))

    n = len(want) - 1                                              # short of the end of text: "length"
    chunks = list(client.completions.create(model="hybrid", prompt=ids, max_tokens=n, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == tok.decode(want[:n])
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == n and chunks[-1].usage.total_tokens == len(ids) + n

    text = tok.decode(want)
    k = len(tok.decode(want[:2]))
    stop = text[k - 1:k + 3]                                       # across the second token boundary
    r = client.completions.create(model="hybrid", prompt=PROMPT, max_tokens=12, temperature=0, stop=[stop, "w999"])
    assert r.choices[0].text == text[:text.index(stop)] and r.choices[0].finish_reason == "stop"


def test_chat_plain_streamed_and_the_second_turn_from_the_prefix_cache(hybrid):
    server, model, tok, eos = hybrid
    client = server.client(KEY)
    msgs = [{"role": "system", "content": "w20 w21"}, {"role": "user", "content": "w5 w6 w7"}]
    # the template by hand: "<|role|> content </s> " per message, then "<|assistant|>"
    ids = [4, 20, 21, eos, 2, 5, 6, 7, eos, 3]
    want = alone(model, ids, 9)
    before = server.metrics()
    r = client.chat.completions.create(model="hybrid", messages=msgs, max_tokens=9, temperature=0)
    answer = r.choices[0].message.content
    assert answer == tok.decode(want) and r.usage.prompt_tokens == len(ids)
    assert r.usage.completion_tokens == len(want) and r.choices[0].message.role == "assistant"

    msgs2 = msgs + [{"role": "assistant", "content": answer}, {"role": "user", "content": "w8 w9"}]
    ids2 = ids + [t for t in want if t != eos] + [eos, 2, 8, 9, eos, 3]
    want2 = alone(model, ids2, 6)
    mid = server.metrics()
    stream = client.chat.completions.create(model="hybrid", messages=msgs2, max_tokens=6, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == tok.decode(want2)
    after = server.metrics()
    # turn 1's state (its prompt and every answer token but the last) was kept: turn 2 prefills the rest only
    resumed = len(ids) + len(want) - 1
    assert after["prefill_tokens_total"] - mid["prefill_tokens_total"] == len(ids2) - resumed
    assert mid["prefill_tokens_total"] - before["prefill_tokens_total"] == len(ids)
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == resumed
    assert after["prefix_cache_hits_total"] == mid["prefix_cache_hits_total"] + 1
    assert after["prefix_cache_bytes"] > 0


def test_a_shared_system_prompt_is_resumed_from_the_prefix_cache_by_another_user(hybrid):
    """Two users, one 30-word system prompt, different questions: the second resumes at the system message's
    end (a checkpoint at each message's end) or later; a prompt sharing 21 tokens mid-message at 16 (every
    --prefix-block 8 tokens). Answers equal generate alone."""
    server, model, tok, eos = hybrid
    client = server.client(KEY)
    system = " ".join(f"w{20 + i}" for i in range(30))
    ids = {}
    for question in ("w5 w6", "w7 w8 w9"):
        msgs = [{"role": "system", "content": system}, {"role": "user", "content": question}]
        # the template by hand: "<|role|> content </s> " per message, then "<|assistant|>"
        ids[question] = [4, *range(20, 50), eos, 2, *tok.encode(question).ids, eos, 3]
        r = client.chat.completions.create(model="hybrid", messages=msgs, max_tokens=4, temperature=0)
        assert r.choices[0].message.content == tok.decode(alone(model, ids[question], 4))
    assert r.usage.prompt_tokens_details.cached_tokens >= 1 + 30 + 1          # the system message
    shared = ids["w5 w6"][:21] + [90, 91, 92]
    r = client.completions.create(model="hybrid", prompt=shared, max_tokens=3, temperature=0)
    assert r.usage.prompt_tokens_details.cached_tokens >= 21 - 21 % BLOCK
    assert r.choices[0].text == tok.decode(alone(model, shared, 3))


def test_chat_stop_strings_plain_and_streamed(hybrid):
    server, model, tok, eos = hybrid
    client = server.client(KEY)
    for content in ("w30 w31 w32", "w40 w41", "w50 w52 w54 w56", "w61"):   # an answer of a few words before eos
        ids = [2, *tok.encode(content).ids, eos, 3]                          # "<|user|> ... </s> <|assistant|>"
        want = alone(model, ids, 10)
        if len([t for t in want if t != eos]) >= 4:
            break
    text = tok.decode(want)
    k = len(tok.decode(want[:2]))
    stop = text[k - 1:k + 3]                                       # across the second token boundary
    msgs = [{"role": "user", "content": content}]
    r = client.chat.completions.create(model="hybrid", messages=msgs, max_tokens=10, temperature=0, stop=[stop, "w999"])
    assert r.choices[0].message.content == text[:text.index(stop)] and r.choices[0].finish_reason == "stop"
    chunks = list(client.chat.completions.create(model="hybrid", messages=msgs, max_tokens=10, temperature=0,
                                                 stop=stop, stream=True))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == text[:text.index(stop)]
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_a_tiny_temperature_is_served_greedy(hybrid):
    """temperature 1e-300 once made the sampling probabilities NaN, failed every row in the batch and left the
    request itself without a final event: it is greedy now (below 1e-5), and nothing fails."""
    server, model, tok, _ = hybrid
    r = server.client(KEY).completions.create(model="hybrid", prompt="w7 w8", max_tokens=5, temperature=1e-300)
    assert r.choices[0].text == tok.decode(alone(model, tok.encode("w7 w8").ids, 5))
    assert server.metrics()["errors_total"] == 0


# each request draws one: the fields of OpenAI and vLLM that change the tokens (logit_bias ids are below every
# model's vocabulary; their values, -100 and 5, ban one token and favour another)
OPTIONS = [{}, {}, {"presence_penalty": 1.2, "frequency_penalty": 0.5}, {"repetition_penalty": 1.5}, {"min_p": 0.05},
           {"logit_bias": {9: 5, 12: -100}}, {"repetition_penalty": 0.8, "presence_penalty": -0.6},
           {"frequency_penalty": 1.7, "min_p": 0.1, "logit_bias": {30: 3}}]


def streams_equal_generate_alone(server, model, tok, key="none", n=32):
    rng = random.Random(7)
    words = [i for i in range(5, V) if i not in model.config.eos_token_ids]
    reqs = []
    for i in range(n):
        prompt = [rng.choice(words) for _ in range(rng.choice([1, 3, 8, 20, 45]))]
        greedy = i % 2 == 0
        reqs.append(dict(prompt=prompt, max_tokens=rng.choice([1, 6, 16]), temperature=0.0 if greedy else 0.9,
                         seed=None if greedy else 100 + i, top_p=None if greedy else rng.choice([None, 0.9]),
                         top_k=None if greedy else rng.choice([None, 30]), options=rng.choice(OPTIONS)))

    def one(req):
        client = server.client(key)
        o = req["options"]
        extra = {k: v for k, v in {"top_k": req["top_k"], **o}.items()
                 if v is not None and k not in ("presence_penalty", "frequency_penalty", "logit_bias")}
        out = client.completions.create(model=server.model_name, prompt=" ".join(f"w{t}" for t in req["prompt"]),
                                        max_tokens=req["max_tokens"], temperature=req["temperature"],
                                        seed=req["seed"], top_p=req["top_p"], stream=True, extra_body=extra or None,
                                        presence_penalty=o.get("presence_penalty", openai.NOT_GIVEN),
                                        frequency_penalty=o.get("frequency_penalty", openai.NOT_GIVEN),
                                        logit_bias={str(t): v for t, v in o["logit_bias"].items()}
                                        if "logit_bias" in o else openai.NOT_GIVEN)
        return "".join(ch.choices[0].text for ch in out if ch.choices)

    before = server.metrics()
    with ThreadPoolExecutor(n) as pool:
        got = list(pool.map(one, reqs))
    after = server.metrics()
    rows, steps = (after[k] - before[k] for k in ("decode_rows_total", "decode_steps_total"))
    assert steps > 0 and rows / steps > 1, (rows, steps)          # batched: more than one row per step on average
    for req, text in zip(reqs, got):
        want = alone(model, req["prompt"], req["max_tokens"], req["temperature"], req["seed"], req["top_p"],
                     req["top_k"], **req["options"])
        assert text == tok.decode(want), req


def test_32_concurrent_streams_each_equal_generate_alone_recurrent(recurrent):
    server, model, tok = recurrent
    streams_equal_generate_alone(server, model, tok)
    m = server.metrics()
    assert m["active_sequences"] == 0
    assert 0 < m["memory_budget_bytes"] <= _mem_available()         # the default: half of what was available


def test_32_concurrent_streams_each_equal_generate_alone_hybrid(hybrid):
    server, model, tok, _ = hybrid
    streams_equal_generate_alone(server, model, tok, KEY)


def test_a_model_without_chat_template_refuses_chat(recurrent):
    server, _, _ = recurrent
    with pytest.raises(openai.BadRequestError) as e:
        server.client().chat.completions.create(model="recurrent", messages=[{"role": "user", "content": "w5"}])
    assert e.value.body["param"] == "messages" and "chat template" in e.value.body["message"]
    assert [m.id for m in server.client().models.list().data] == ["recurrent"]


def test_api_key(hybrid):
    server = hybrid[0]
    for key in ("wrong", ""):
        with pytest.raises(openai.AuthenticationError):
            server.client(key or "x", default_headers={"Authorization": key}).models.list()
    assert [m.id for m in server.client(KEY).models.list().data] == ["hybrid"]
    assert server.client(KEY).models.retrieve("hybrid").id == "hybrid"              # OpenAI's retrieve
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        server.client(KEY).models.retrieve("other")
    status, _, _ = request(server, "GET", "/health")                    # probes need no key
    assert status == 200
    for header, want in ((f"bearer {KEY}", 200), (f"BEARER  {KEY} ", 200), (f"Basic {KEY}", 401), (KEY, 401),
                         (f"Bearer {KEY}x", 401)):              # the scheme's case is free (RFC 9110), not the key's
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
        try:
            conn.request("GET", "/v1/models", headers={"Authorization": header})
            assert conn.getresponse().status == want, header
        finally:
            conn.close()


def freed(before):
    """The row cancelled since ``before`` and its state gone: ``state_bytes`` is measured at the end of the loop's
    iteration that drops the row, a moment after ``active_sequences`` stops counting it (the gauge read between the
    two was the fresh clone's failure of the twenty-eighth session)."""
    return lambda m: m["active_sequences"] == 0 and m["cancelled_total"] > before["cancelled_total"] \
        and m["state_bytes"] == 0


def test_a_client_that_disconnects_frees_its_row(recurrent):
    """Streamed, on the recurrent server: its long context keeps the request running for seconds, so the
    disconnect, not the end of max_tokens, is what frees the row (the hybrid's 255 tokens can all be sampled
    before a loaded machine reports the closed socket)."""
    server = recurrent[0]
    before = server.metrics()
    stream = server.client().completions.create(model="recurrent", prompt="w5", max_tokens=LONG - 2,
                                                temperature=0.9, seed=1, stream=True)
    next(iter(stream))
    stream.close()
    m = _wait_for(server, freed(before))
    assert m["active_sequences"] == 0 and m["state_bytes"] == 0
    assert m["cancelled_total"] == before["cancelled_total"] + 1 and m["finished_total"] == before["finished_total"]
    assert m["generated_tokens_total"] - before["generated_tokens_total"] < LONG - 2


def test_a_plain_request_whose_client_disconnects_frees_its_row(recurrent):
    """Not streamed: the server asks whether its client is still there on a clock, not only when no token came
    for a while (tokens come every millisecond), so the row is freed well before max_tokens."""
    server = recurrent[0]
    before = server.metrics()
    body = json.dumps({"model": "recurrent", "prompt": "w5", "max_tokens": LONG - 2, "temperature": 0}).encode()
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(body) + body)
    running = _wait_for(server, lambda m: m["active_sequences"] == 1)
    sock.close()
    m = _wait_for(server, freed(before))
    assert running["active_sequences"] == 1
    assert m["active_sequences"] == 0 and m["state_bytes"] == 0
    assert m["cancelled_total"] == before["cancelled_total"] + 1 and m["finished_total"] == before["finished_total"]
    assert m["generated_tokens_total"] - before["generated_tokens_total"] < LONG - 2


def request(server, method, path, body=None, key=KEY):
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    try:
        conn.request(method, path, body=body, headers={"Authorization": f"Bearer {key}",
                                                        "Content-Type": "application/json"})
        r = conn.getresponse()
        return r.status, r.read(), dict(r.getheaders())
    finally:
        conn.close()


def malformed(n: int, seed: int = 0):
    """(path, body bytes, the field the error must name or None) for ``n`` generated malformed requests: wrong
    types and values, unknown fields, and strings with non-ASCII characters or lone UTF-16 surrogates (which
    JSON's escapes, or their bytes, can carry: no tokenizer encodes them, no UTF-8 response holds them)."""
    rng = random.Random(seed)
    long_prompt = " ".join(["w5"] * (CONTEXT + 1))
    wrong = ["x", -1, 1.5, [], {}, True, [1, "a"], {"a": 1}, "", [[]], "\u00e9t\u00e9", "\ud800"]
    fields = {  # field: invalid values (besides wrong types that do not fit)
        "model": [1, [], "no-such-model", "", "\u043c\u043e\u0434\u0435\u043b\u044c", "\ud800", "hybrid\udfff"],
        "prompt": ["", [], [-1], [V], [1.5], long_prompt, ["a", "b"], 3, "w5 \ud800", "\udfff", "w5 \u00e9 \ud834",
                   ["w5 \udc00"]],
        "max_tokens": [-5, 0, 10 ** 9, CONTEXT + 1, 1.5, "8"],
        "temperature": [-0.1, -5, "hot", [0], "\u0436\u0430\u0440"],
        "top_p": [0, 1.01, -1, 2, "x", "\ud800"], "top_k": [-3, 2.5],
        "stop": [5, [1], [""], ["a"] * 5, "", "\ud800", ["ok", "x\udc00"]],
        "seed": [2 ** 63, -2 ** 63 - 1, 2 ** 64, 1.5, "1"], "stream": ["yes", 1, []], "logprobs": [6, -1, True, "2"],
        "n": [0, -1, 40], "echo": [True], "best_of": [3], "presence_penalty": [2.5, -2.01], "frequency_penalty": [3],
        "repetition_penalty": [0, -1.5], "min_p": [-0.1, 1.5], "ignore_eos": ["yes", 1],
        "logit_bias": [{"5": 101}, {"\ud800": 1}, {"-1": 1}, {"x": 1}, {str(V): 1}, {"5": "x"}, {"5": None}],
        "stop_token_ids": [[-1], [V], [1.5], "5", [True]],
        "response_format": [{"type": "xml"}, {"type": "json_schema", "json_schema": 3}, "json",
                            {"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}}],
        "stream_options": [{"include_usage": True}], "user": [5, "\ud800"],
        # unknown fields, their names ASCII, not, or a lone surrogate (named back escaped: "\\ud800")
        "foo": [1, "x"], "na\u00efve": [1], "\u043a\u043b\u044e\u0447": ["x"], "\ud800": [1], "a\udfffb": ["x"],
    }
    chat_fields = {
        "messages": [[], "hi", [{"role": "user"}], [{"role": "wizard", "content": "w5"}], [{"content": "w5"}],
                     [{"role": "user", "content": 5}], [{"role": "user", "content": [{"type": "image_url"}]}],
                     [{"role": "user", "content": "w5", "tool_calls": []}], [5],
                     [{"role": "user", "content": long_prompt}], [{"role": "user", "content": "w5 \ud800"}],
                     [{"role": "user", "content": [{"type": "text", "text": "\udc00"}]}],
                     [{"role": "user", "content": "w5", "name": "\ud800"}],
                     [{"role": "user", "content": "w5", "\ud800": 1}],
                     [{"role": "\u30e6\u30fc\u30b6\u30fc", "content": "w5"}],
                     [{"role": "user\ud800", "content": "w5"}]],
        "logprobs": ["yes", 1], "top_logprobs": [21, -1, 3], "max_completion_tokens": [0, -1, "x"],
        "tools": [[{"type": "function"}]],
    }
    raw = [b"", b"{", b"nul", b"\xff\xfe", b"[1, 2]", b"3", b'"x"', b'{"model": "hybrid", "prompt": }', b"{}" * 2]
    out = []
    for _ in range(n):
        kind = rng.random()
        if kind < 0.08:
            out.append((rng.choice(["/v1/completions", "/v1/chat/completions"]), rng.choice(raw), None))
            continue
        chat = kind < 0.4
        body = ({"model": "hybrid", "messages": [{"role": "user", "content": "w5 w6"}], "max_tokens": 2}
                if chat else {"model": "hybrid", "prompt": "w5 w6", "max_tokens": 2})
        pool = {**{k: v for k, v in fields.items() if not (chat and k in ("prompt", "logprobs", "echo", "best_of"))},
                **(chat_fields if chat else {})}
        field = rng.choice(sorted(pool))
        value = rng.choice(pool[field] + ([w for w in wrong if _wrong_type(field, w, chat)]
                                          if field not in UNKNOWN else []))
        if field == "stream_options":
            body.pop("stream", None)
        body[field] = value
        text = json.dumps(body, ensure_ascii=rng.random() < 0.5)      # escapes, or the characters themselves
        data = text.encode("utf-8", "surrogatepass")                  # a lone surrogate's (invalid) UTF-8 bytes
        out.append(("/v1/chat/completions" if chat else "/v1/completions", data,
                    field.encode("utf-8", "backslashreplace").decode()))
    return out


UNKNOWN = {"foo", "na\u00efve", "\u043a\u043b\u044e\u0447", "\ud800", "a\udfffb"}
VALID = {"prompt": ["x", "\u00e9t\u00e9"], "temperature": [1.5], "stop": ["x", [], "\u00e9t\u00e9"], "stream": [True],
         "logit_bias": [{}], "tools": [[]], "user": ["x", "", "\u00e9t\u00e9"], "presence_penalty": [-1, 1.5],
         "frequency_penalty": [-1, 1.5], "repetition_penalty": [1.5], "stop_token_ids": [[]],
         "ignore_eos": [True], "top_k": [-1], "seed": [-1]}      # generic wrong values valid there
VALID_CHAT = {"logprobs": [True]}


def _wrong_type(field, value, chat=False):
    """Whether a generic wrong value is invalid for this field (of a chat request, if ``chat``)."""
    valid = VALID.get(field, []) + (VALID_CHAT.get(field, []) if chat else [])
    return not any(value == v and type(value) is type(v) for v in valid)


def test_1000_malformed_requests_get_4xx_naming_the_field_and_the_server_goes_on(hybrid):
    server, model, tok, _ = hybrid
    statuses = {}
    for path, body, field in malformed(1000):
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
        conn.request("POST", path, body=body, headers={"Authorization": f"Bearer {KEY}"})
        r = conn.getresponse()
        data = r.read()
        conn.close()
        statuses[r.status] = statuses.get(r.status, 0) + 1
        assert 400 <= r.status < 500, (path, body[:200], r.status, data[:300])
        err = json.loads(data)["error"]
        assert err["message"] and err["type"]
        if field is not None:
            assert err["param"] is not None and err["param"].split(".")[0].split("[")[0] == field, (body[:200], err)
    assert set(statuses) <= {400, 404}
    ids = tok.encode("w5 w6").ids
    r = server.client(KEY).completions.create(model="hybrid", prompt="w5 w6", max_tokens=4, temperature=0)
    assert r.choices[0].text == tok.decode(alone(model, ids, 4))
    assert server.metrics()["errors_total"] == 0


def test_a_full_queue_answers_429_and_sigterm_aborts_at_the_drain_deadline_and_exits_0(tmp_path):
    """Two streams running, one waiting, the next refused with 429. Both running streams ask for a million tokens,
    so neither can end before the signal however fast or slow the host (a short stream here once ended under the
    suite's load before the fourth request came, and the queue had room). SIGTERM with --drain-timeout 2: both end
    at the deadline with a final "abort" event, the waiting one gets a final event too, and the server exits 0."""
    path = folder(tmp_path / "one", "mamba2")
    endless = 1_000_000
    server = Server(path, "--max-batch", 2, "--max-queue", 1, "--max-context", endless + 16, "--drain-timeout", 2)
    try:
        client = server.client()
        running = []
        for prompt in ("w5", "w6"):
            running.append(iter(client.completions.create(model="one", prompt=prompt, max_tokens=endless,
                                                          temperature=0, stream=True)))
            next(running[-1])
        waiting = client.completions.create(model="one", prompt="w7", max_tokens=4, temperature=0, stream=True)
        with pytest.raises(openai.RateLimitError) as e:
            client.completions.create(model="one", prompt="w8", max_tokens=4)
        assert e.value.response.headers["retry-after"] == "1"
        assert e.value.body["type"] == "rate_limit_error"
        assert server.metrics()["active_sequences"] == 2          # both in flight when the signal comes
        server.proc.send_signal(signal.SIGTERM)
        for stream in running:
            tail = list(stream)
            assert tail and tail[-1].choices[0].finish_reason == "abort"
        assert [ch.choices[0].finish_reason for ch in waiting][-1] in ("length", "abort")
        assert server.proc.wait(30) == 0
        with pytest.raises(openai.APIConnectionError):
            client.completions.create(model="one", prompt="w7", max_tokens=4)
    finally:
        server.stop()


def test_sigterm_lets_a_stream_in_flight_finish_within_the_drain(tmp_path):
    """The signal comes right after the stream's first token (microseconds, against the milliseconds its 1,000
    tokens take even on a fast host): the stream runs on to "length" with every token, and then the server exits 0
    without waiting for the rest of its 120 s drain."""
    path = folder(tmp_path / "one", "mamba2")
    n = 1000
    server = Server(path, "--max-batch", 2, "--max-context", 4096, "--drain-timeout", 120)
    try:
        client = server.client()
        stream = iter(client.completions.create(model="one", prompt="w6", max_tokens=n, temperature=0, stream=True,
                                                stream_options={"include_usage": True}))
        first = [next(stream)]
        server.proc.send_signal(signal.SIGTERM)
        rest = first + list(stream)                                 # read while the server drains
        assert [ch.choices[0].finish_reason for ch in rest if ch.choices][-1] == "length"
        assert rest[-1].usage.completion_tokens == n
        assert server.proc.wait(60) == 0
    finally:
        server.stop()


def test_a_port_already_taken_exits_1(tmp_path):
    """uvicorn runs on a thread of its own (the engine on the main thread): a port it cannot bind still ends the
    process with status 1 and uvicorn's message, not 0."""
    import subprocess
    import sys

    path = folder(tmp_path / "m", "mamba2")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        r = subprocess.run([sys.executable, "-m", "subquad", "serve", "--model", str(path), "--port",
                            str(taken.getsockname()[1])], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "address already in use" in r.stderr


def test_a_run_chats_with_a_chat_template_file_or_its_own(tmp_path, corpus, monkeypatch, capsys):
    """A run trained here has no chat template: ``--chat-template FILE`` gives it one (its eos_token the run's
    <|endoftext|>), as does a chat_template.jinja put in the run folder; the flag replaces a folder's own; a
    missing file is named."""
    import subquad.serve.server as server
    from subquad.cli import main

    run = tmp_path / "run"
    assert main(["train", "--data", str(corpus), "--vocab-size", "300", "--d-model", "32", "--n-layers", "1",
                 "--pattern", "mamba2", "--steps", "1", "--out", str(run), "--no-progress"]) == 0
    seen = []
    monkeypatch.setattr(server, "run", lambda engine, name, chat_template=None, **kw: seen.append(chat_template) or 0)
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}<{{ m.role }}>{{ m.content }}{{ eos_token }}{% endfor %}"
                        "{% if add_generation_prompt %}<assistant>{% endif %}")
    base = ["serve", "--run", str(run), "--memory-mb", "64"]
    assert main(base) == 0 and seen[-1] is None                       # no template: chat refused with a 400
    assert main([*base, "--chat-template", str(template)]) == 0
    msgs = [{"role": "user", "content": "hi"}]
    assert seen[-1].render(msgs) == "<user>hi<|endoftext|><assistant>"
    (run / "chat_template.jinja").write_text("{% for m in messages %}[{{ m.content }}]{% endfor %}")
    assert main(base) == 0 and seen[-1].render(msgs) == "[hi]"        # the run folder's own
    assert main([*base, "--chat-template", str(template)]) == 0 and seen[-1].render(msgs).startswith("<user>")
    assert main([*base, "--chat-template", str(tmp_path / "none.jinja")]) == 2
    assert "--chat-template" in capsys.readouterr().err


def test_cli_refuses_bad_serve_arguments(tmp_path, capsys):
    from subquad.cli import main

    assert main(["serve"]) == 2 and "--run" in capsys.readouterr().err
    assert main(["serve", "--model", str(tmp_path / "none")]) == 2
    assert "neither a folder nor a GGUF file" in capsys.readouterr().err
    assert main(["serve", "--model", str(tmp_path / "none.gguf")]) == 2
    assert "no such GGUF file" in capsys.readouterr().err
    path = folder(tmp_path / "m", "mamba2")
    assert main(["serve", "--model", str(path), "--max-queue", "-1"]) == 2
    assert "max_queue" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["serve", "--model", str(path), "--state-cache-mb", "-5"])
    with pytest.raises(SystemExit):
        main(["serve", "--model", str(path), "--prefix-block", "0"])
    assert "--prefix-block" in capsys.readouterr().err


def test_streamed_logprobs_carry_the_text_offsets_of_the_plain_response(hybrid):
    """Each streamed chunk's text_offset is where its token starts in the completion text (it was 0 for every
    token: each chunk was rendered alone), the same offsets as the non-streamed response to the same request."""
    server = hybrid[0]
    client = server.client(KEY)
    req = {"model": "hybrid", "prompt": "w7 w8 w9", "max_tokens": 6, "temperature": 0, "logprobs": 1}
    plain = client.completions.create(**req).choices[0]
    chunks = [ch.choices[0] for ch in client.completions.create(**req, stream=True) if ch.choices]
    with_lp = [i for i, c in enumerate(chunks) if c.logprobs is not None and c.logprobs.tokens]
    offsets = [o for i in with_lp for o in chunks[i].logprobs.text_offset]
    assert offsets == plain.logprobs.text_offset
    assert offsets == [len("".join(c.text for c in chunks[:i])) for i in with_lp]
    assert len(set(offsets)) > 1                                   # the test means something: tokens have text


def test_n_choices_plain_and_streamed_each_equal_generate_alone_seeded_seed_plus_i(hybrid):
    """n choices: one prefill (prefill_tokens grows by the prompt once), choice i = generate alone with seed + i;
    usage counts the prompt once and every choice's tokens; a stream carries each choice's index."""
    server, model, tok, eos = hybrid
    client = server.client(KEY)
    ids = tok.encode("w13 w14 w15 w16").ids
    opts = {"repetition_penalty": 1.3}
    want = [alone(model, ids, 7, 0.9, 70 + i, ignore_eos=True, **opts) for i in range(3)]
    assert len(set(map(tuple, want))) > 1
    before = server.metrics()
    r = client.completions.create(model="hybrid", prompt=ids, max_tokens=7, temperature=0.9, seed=70, n=3,
                                  extra_body={"ignore_eos": True, **opts})
    assert server.metrics()["prefill_tokens_total"] - before["prefill_tokens_total"] <= len(ids)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.text for c in r.choices] == [tok.decode(w) for w in want]
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == sum(map(len, want)) == 21
    chunks = list(client.completions.create(model="hybrid", prompt=ids, max_tokens=7, temperature=0.9, seed=70, n=3,
                                            stream=True, extra_body={"ignore_eos": True, **opts}))
    for i in range(3):
        assert "".join(ch.choices[0].text for ch in chunks if ch.choices[0].index == i) == tok.decode(want[i])
        assert [ch.choices[0].finish_reason for ch in chunks if ch.choices[0].index == i][-1] == "length"

    msgs = [{"role": "user", "content": "w5 w6 w7"}]
    chat_ids = [2, 5, 6, 7, eos, 3]
    want = [alone(model, chat_ids, 6, 0.8, 11 + i) for i in range(2)]
    chunks = list(client.chat.completions.create(model="hybrid", messages=msgs, max_tokens=6, temperature=0.8, seed=11,
                                                 n=2, stream=True))
    for i in range(2):
        mine = [ch.choices[0] for ch in chunks if ch.choices[0].index == i]
        assert mine[0].delta.role == "assistant"
        assert "".join(c.delta.content or "" for c in mine) == tok.decode(want[i])


def test_chat_logprobs_in_openais_shape_equal_a_full_forward(hybrid):
    server, model, tok, eos = hybrid
    client = server.client(KEY)
    msgs = [{"role": "user", "content": "w21 w22"}]
    ids = [2, 21, 22, eos, 3]
    want = alone(model, ids, 5)
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([ids + want]))[0, len(ids) - 1:-1].double(), -1)
    r = client.chat.completions.create(model="hybrid", messages=msgs, max_tokens=5, temperature=0, logprobs=True,
                                       top_logprobs=3)
    content = r.choices[0].logprobs.content
    names = [tok.decode([t], skip_special_tokens=False) for t in want]
    assert [c.token for c in content] == names
    assert [c.bytes for c in content] == [list(n.encode()) for n in names]
    assert [c.logprob for c in content] == pytest.approx([float(lp[j, t]) for j, t in enumerate(want)], abs=1e-4)
    for j, c in enumerate(content):
        top = torch.topk(lp[j], 3)
        assert [t.token for t in c.top_logprobs] == [tok.decode([t], skip_special_tokens=False) for t in top.indices]
        assert [t.logprob for t in c.top_logprobs] == pytest.approx(top.values.tolist(), abs=1e-4)
    chunks = list(client.chat.completions.create(model="hybrid", messages=msgs, max_tokens=5, temperature=0,
                                                 logprobs=True, stream=True))
    streamed = [c for ch in chunks if ch.choices[0].logprobs for c in ch.choices[0].logprobs.content]
    assert [c.token for c in streamed] == names and all(c.top_logprobs == [] for c in streamed)
    plain = client.chat.completions.create(model="hybrid", messages=msgs, max_tokens=5, temperature=0)
    assert plain.choices[0].logprobs is None


def test_stop_token_ids_and_ignore_eos(hybrid):
    """A stop token ends the text ("stop") without its own text; ignore_eos runs past the end of text."""
    server, model, tok, eos = hybrid
    client = server.client(KEY)
    ids = tok.encode(PROMPT).ids
    free = alone(model, ids, 12, ignore_eos=True)
    assert eos in free[:-1]                                          # the end of text comes early
    r = client.completions.create(model="hybrid", prompt=PROMPT, max_tokens=12, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].text == tok.decode(free) and r.choices[0].finish_reason == "length"
    stop = free[1]
    r = client.completions.create(model="hybrid", prompt=PROMPT, max_tokens=12, temperature=0,
                                  extra_body={"stop_token_ids": [stop]})
    assert r.choices[0].text == tok.decode(free[:1]) and r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens == 2


def test_tokenize_and_detokenize(hybrid):
    server, model, tok, eos = hybrid
    status, data, _ = request(server, "POST", "/tokenize", json.dumps({"prompt": PROMPT}))
    assert status == 200 and json.loads(data) == {"tokens": tok.encode(PROMPT).ids, "count": 5,
                                                  "max_model_len": CONTEXT}
    msgs = [{"role": "system", "content": "w20"}, {"role": "user", "content": "w5 w6"}]
    status, data, _ = request(server, "POST", "/tokenize", json.dumps({"model": "hybrid", "messages": msgs}))
    assert json.loads(data)["tokens"] == [4, 20, eos, 2, 5, 6, eos, 3]         # the template by hand
    status, data, _ = request(server, "POST", "/tokenize", json.dumps({"messages": msgs,
                                                                       "add_generation_prompt": False}))
    assert json.loads(data)["tokens"] == [4, 20, eos, 2, 5, 6, eos]
    status, data, _ = request(server, "POST", "/detokenize", json.dumps({"tokens": [11, 40, 3]}))
    assert status == 200 and json.loads(data) == {"prompt": "w11 w40 <|assistant|>"}
    for path, body, field in (("/tokenize", {"prompt": 5}, "prompt"), ("/tokenize", {"prompt": "w5", "n": 2}, "n"),
                              ("/tokenize", {"messages": [{"role": "x"}]}, "messages[0].role"),
                              ("/detokenize", {"tokens": [V]}, "tokens"), ("/detokenize", {"tokens": "w5"}, "tokens"),
                              ("/tokenize", {"prompt": "w5", "model": "other"}, "model")):
        status, data, _ = request(server, "POST", path, json.dumps(body))
        assert 400 <= status < 500 and json.loads(data)["error"]["param"] == field, (body, data)
    assert request(server, "POST", "/tokenize", json.dumps({"prompt": "w5"}), key="wrong")[0] == 401


def test_a_body_over_max_body_mb_is_refused_413_and_the_rest_never_read(recurrent):
    """--max-body-mb 1: a Content-Length over it is refused from the header alone; a chunked body that never
    ends gets its 413 once past 1 MiB, and the server closes the connection - the rest is not read."""
    server = recurrent[0]
    head = b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(head + b"Content-Length: 1000000000000\r\n\r\n")           # no body sent at all
        assert sock.recv(4096).startswith(b"HTTP/1.1 413")

    piece = 64 * 1024
    chunk = b"%x\r\n" % piece + b" " * piece + b"\r\n"                       # JSON whitespace, forever
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(head + b"Transfer-Encoding: chunked\r\n\r\n")
        sent, answer, closed = 0, b"", False
        while sent < 64 * 2 ** 20 and not answer and not closed:                 # bounded: 64 MiB at most
            try:
                sock.sendall(chunk)
                sent += piece
                if select.select([sock], [], [], 0)[0]:
                    answer = sock.recv(4096)
            except (BrokenPipeError, ConnectionResetError):    # answered and closed before this side looked:
                closed = True                                  # the reset may drop the answer's bytes (the
                                                               # in-process test below sees the 413 every time)
        assert closed or (answer.startswith(b"HTTP/1.1 413") and b"connection: close" in answer.lower()), answer
        assert sent < 16 * 2 ** 20                 # 1 MiB read, the rest in the sockets' buffers at most
        more = 0
        while more < 64 * 2 ** 20 and not closed:                                # the server reads no more
            try:
                sock.sendall(chunk)
                more += piece
            except (BrokenPipeError, ConnectionResetError):
                closed = True
        assert closed and more < 16 * 2 ** 20
    assert request(server, "GET", "/health")[0] == 200


def _on_event_loop() -> bool:
    try:
        asyncio.get_running_loop()
        return True
    except RuntimeError:
        return False


def test_tokenising_and_templating_run_off_the_event_loop_and_the_body_stops_at_its_bound(tmp_path):
    """The app in this process, called as ASGI: the tokenizer and the chat template are called from worker
    threads (no running event loop there), and a never-ending body is read only up to its bound."""
    from subquad.serve import Engine
    from subquad.serve.api import create_app
    from subquad.serve.chat import load_chat_template

    path = folder(tmp_path / "m", "mamba2", template=True, eos=1)
    model, tok = load(path)
    calls = []

    class Watched:
        """The tokenizer, its encode calls recorded with whether an event loop runs in their thread."""

        def encode(self, *a, **kw):
            calls.append(("encode", _on_event_loop()))
            return tok.encode(*a, **kw)

        def __getattr__(self, name):
            return getattr(tok, name)

    template = load_chat_template(path)
    render = template.render
    template.render = lambda *a, **kw: (calls.append(("render", _on_event_loop())), render(*a, **kw))[1]
    engine = Engine(model, Watched(), max_context=64, state_cache_mb=0).start()
    app = create_app(engine, "m", template, max_body_mb=1)

    async def call(path, body=None, endless=False):
        """(status, body) of one request; ``endless``: a body of 64 KiB chunks that never ends (counted)."""
        sent, reads = [], [0]

        async def receive():
            reads[0] += 1
            if endless and reads[0] < 1000:
                return {"type": "http.request", "body": b" " * 65536, "more_body": True}
            if reads[0] == 1:
                return {"type": "http.request", "body": body, "more_body": False}
            await asyncio.Event().wait()                                     # the client stays

        async def send(message):
            sent.append(message)

        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
                 "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
                 "headers": [(b"content-type", b"application/json")], "client": ("127.0.0.1", 1),
                 "server": ("127.0.0.1", 80)}
        await app(scope, receive, send)
        return sent[0]["status"], b"".join(m.get("body", b"") for m in sent[1:]), reads[0]

    async def main():
        out = [await call("/v1/completions", json.dumps({"model": "m", "prompt": "w5 w6", "max_tokens": 3,
                                                         "temperature": 0}).encode()),
               await call("/v1/chat/completions", json.dumps({"model": "m", "max_tokens": 2, "messages": [
                   {"role": "user", "content": "w7"}]}).encode()),
               await call("/tokenize", json.dumps({"prompt": "w5 w6 w7"}).encode()),
               await call("/v1/completions", endless=True)]
        return out

    try:
        (s1, b1, _), (s2, _, _), (s3, b3, _), (s4, _, reads) = asyncio.run(main())
    finally:
        engine.drain(0)
        engine.stop()
    assert (s1, s2, s3, s4) == (200, 200, 200, 413)
    assert json.loads(b1)["choices"][0]["text"] == tok.decode(alone(model, tok.encode("w5 w6").ids, 3))
    assert json.loads(b3)["tokens"] == tok.encode("w5 w6 w7").ids
    assert {name for name, _ in calls} == {"encode", "render"} and not any(on_loop for _, on_loop in calls)
    assert reads == 2 ** 20 // 65536 + 1                        # 1 MiB and the chunk that passed it: no more


def test_the_api_key_comes_from_one_of_the_flag_the_file_and_the_environment(tmp_path):
    from subquad.cli import build_parser
    from subquad.cli.serve import api_key

    p = build_parser()
    (tmp_path / "key").write_text("  sk-file\n")
    (tmp_path / "empty").write_text("\n")

    def args(*argv):
        return p.parse_args(["serve", "--model", str(tmp_path), *argv])

    assert api_key(args(), {}) is None
    assert api_key(args("--api-key", "sk-flag"), {}) == "sk-flag"
    assert api_key(args("--api-key-file", str(tmp_path / "key")), {}) == "sk-file"
    assert api_key(args(), {"SUBQUAD_API_KEY": "sk-env"}) == "sk-env"
    assert api_key(args(), {"SUBQUAD_API_KEY": " sk-env \n"}) == "sk-env"     # as the file's: whitespace dropped
    for argv, env, match in ((("--api-key", "a", "--api-key-file", str(tmp_path / "key")), {}, "--api-key and"),
                             (("--api-key", "a"), {"SUBQUAD_API_KEY": "b"}, "--api-key and SUBQUAD_API_KEY"),
                             (("--api-key-file", str(tmp_path / "empty")), {}, "empty"),
                             (("--api-key-file", str(tmp_path / "none")), {}, "cannot be read"),
                             ((), {"SUBQUAD_API_KEY": ""}, "SUBQUAD_API_KEY: the API key is empty"),
                             ((), {"SUBQUAD_API_KEY": "  "}, "SUBQUAD_API_KEY: the API key is empty"),
                             (("--api-key", "a\nb"), {}, "control character")):
        with pytest.raises(ValueError, match=match):
            api_key(args(*argv), env)
