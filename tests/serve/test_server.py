"""``subquad serve`` as a user meets it: a real server on 127.0.0.1 in a subprocess, driven by the real
``openai`` client. Three tiny random checkpoints: a pure recurrent model (Mamba), a hybrid with an attention
layer (Mamba-2 + softmax, with a tokenizer, a chat template and an end-of-text id), and the recurrent one
behind a one-slot queue. Expected outputs are computed here, independently, with ``generate`` run alone."""

from __future__ import annotations

import http.client
import json
import random
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
    server = Server(path, "--api-key", KEY, "--max-batch", 32, "--max-context", CONTEXT, "--prefill-chunk", 32)
    yield server, model, tok, free[i]
    server.stop()


@pytest.fixture(scope="module")
def recurrent(tmp_path_factory):
    path = folder(tmp_path_factory.mktemp("serve") / "recurrent", "mamba2")
    model, tok = load(path)
    server = Server(path, "--max-batch", 32, "--max-context", LONG)     # no --memory-mb: the default budget
    yield server, model, tok
    server.stop()


def alone(model, ids, n, temperature=0.0, seed=None, top_p=None, top_k=None):
    return model.generate(ids, n, temperature=temperature, seed=seed, top_p=top_p, top_k=top_k)[0]


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


def streams_equal_generate_alone(server, model, tok, key="none", n=32):
    rng = random.Random(7)
    words = [i for i in range(5, V) if i not in model.config.eos_token_ids]
    reqs = []
    for i in range(n):
        prompt = [rng.choice(words) for _ in range(rng.choice([1, 3, 8, 20, 45]))]
        greedy = i % 2 == 0
        reqs.append(dict(prompt=prompt, max_tokens=rng.choice([1, 6, 16]), temperature=0.0 if greedy else 0.9,
                         seed=None if greedy else 100 + i, top_p=None if greedy else rng.choice([None, 0.9]),
                         top_k=None if greedy else rng.choice([None, 30])))

    def one(req):
        client = server.client(key)
        extra = {"top_k": req["top_k"]} if req["top_k"] else None
        out = client.completions.create(model=server.model_name, prompt=" ".join(f"w{t}" for t in req["prompt"]),
                                        max_tokens=req["max_tokens"], temperature=req["temperature"],
                                        seed=req["seed"], top_p=req["top_p"], stream=True, extra_body=extra)
        return "".join(ch.choices[0].text for ch in out if ch.choices)

    before = server.metrics()
    with ThreadPoolExecutor(n) as pool:
        got = list(pool.map(one, reqs))
    after = server.metrics()
    rows, steps = (after[k] - before[k] for k in ("decode_rows_total", "decode_steps_total"))
    assert steps > 0 and rows / steps > 1, (rows, steps)          # batched: more than one row per step on average
    for req, text in zip(reqs, got):
        want = alone(model, req["prompt"], req["max_tokens"], req["temperature"], req["seed"], req["top_p"],
                     req["top_k"])
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
    status, _, _ = request(server, "GET", "/health")                    # probes need no key
    assert status == 200


def test_a_client_that_disconnects_frees_its_row(hybrid):
    server = hybrid[0]
    before = server.metrics()
    stream = server.client(KEY).completions.create(model="hybrid", prompt="w5", max_tokens=CONTEXT - 1,
                                                   temperature=0.9, seed=1, stream=True)
    next(iter(stream))
    stream.close()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        m = server.metrics()
        if m["active_sequences"] == 0 and m["cancelled_total"] > before["cancelled_total"]:
            break
        time.sleep(0.05)
    assert m["active_sequences"] == 0 and m["state_bytes"] == 0
    assert m["cancelled_total"] == before["cancelled_total"] + 1
    assert m["generated_tokens_total"] - before["generated_tokens_total"] < CONTEXT - 1


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
    m = _wait_for(server, lambda m: m["active_sequences"] == 0 and m["cancelled_total"] > before["cancelled_total"])
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
        "top_p": [0, 1.01, -1, 2, "x", "\ud800"], "top_k": [0, -3, 2.5],
        "stop": [5, [1], [""], ["a"] * 5, "", "\ud800", ["ok", "x\udc00"]],
        "seed": [-1, 2 ** 64, 1.5, "1"], "stream": ["yes", 1, []], "logprobs": [6, -1, True, "2"],
        "n": [2, 0], "echo": [True], "best_of": [3], "presence_penalty": [0.5], "logit_bias": [{"5": 1}, {"\ud800": 1}],
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
        "logprobs": [True], "max_completion_tokens": [0, -1, "x"], "tools": [[{"type": "function"}]],
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
        value = rng.choice(pool[field] + ([w for w in wrong if _wrong_type(field, w)] if field not in UNKNOWN else []))
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
         "logit_bias": [{}], "tools": [[]], "user": ["x", "", "\u00e9t\u00e9"]}   # generic wrong values valid there


def _wrong_type(field, value):
    """Whether a generic wrong value is invalid for this field."""
    return not any(value == v and type(value) is type(v) for v in VALID.get(field, []))


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


def test_a_full_queue_answers_429_and_sigterm_drains_and_exits_0(tmp_path):
    """Two streams running, one waiting, the next refused with 429. SIGTERM with --drain-timeout 10: the short
    stream (in flight at the signal) runs on and finishes ("length", every token), the long one ends at the
    deadline with a final "abort" event, the waiting one gets a final event too, and the server exits 0."""
    path = folder(tmp_path / "one", "mamba2")
    short_n = 500
    # 10 s: the short stream's 500 tokens must fit in the drain on a loaded machine (3 s did not at load 2-3);
    # the long one's 32,000 never do
    server = Server(path, "--max-batch", 2, "--max-queue", 1, "--max-context", 32768, "--drain-timeout", 10)
    try:
        client = server.client()
        long = iter(client.completions.create(model="one", prompt="w5", max_tokens=32000, temperature=0, stream=True))
        next(long)
        short = iter(client.completions.create(model="one", prompt="w6", max_tokens=short_n, temperature=0,
                                               stream=True, stream_options={"include_usage": True}))
        first = [next(short)]
        waiting = client.completions.create(model="one", prompt="w7", max_tokens=4, temperature=0, stream=True)
        with pytest.raises(openai.RateLimitError) as e:
            client.completions.create(model="one", prompt="w8", max_tokens=4)
        assert e.value.response.headers["retry-after"] == "1"
        assert e.value.body["type"] == "rate_limit_error"
        assert server.metrics()["active_sequences"] == 2          # both in flight when the signal comes
        server.proc.send_signal(signal.SIGTERM)
        rest = first + list(short)                                  # read while the server drains
        assert [ch.choices[0].finish_reason for ch in rest if ch.choices][-1] == "length"
        assert rest[-1].usage.completion_tokens == short_n
        tail = list(long)
        assert tail and tail[-1].choices[0].finish_reason == "abort"
        assert [ch.choices[0].finish_reason for ch in waiting][-1] in ("length", "abort")
        assert server.proc.wait(30) == 0
        with pytest.raises(openai.APIConnectionError):
            client.completions.create(model="one", prompt="w7", max_tokens=4)
    finally:
        server.stop()


def test_cli_refuses_bad_serve_arguments(tmp_path, capsys):
    from subquad.cli import main

    assert main(["serve"]) == 2 and "--run" in capsys.readouterr().err
    assert main(["serve", "--model", str(tmp_path / "none")]) == 2 and "not a folder" in capsys.readouterr().err
    path = folder(tmp_path / "m", "mamba2")
    assert main(["serve", "--model", str(path), "--max-queue", "-1"]) == 2
    assert "max_queue" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["serve", "--model", str(path), "--state-cache-mb", "-5"])


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
