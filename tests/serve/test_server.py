"""``subquad serve`` as a user meets it: a real server on 127.0.0.1 in a subprocess, driven by the real
``openai`` client. Three tiny random checkpoints: a pure recurrent model (Mamba), a hybrid with an attention
layer (Mamba-2 + softmax, with a tokenizer, a chat template and an end-of-text id), and the recurrent one
behind a one-slot queue. Expected outputs are computed here, independently, with ``generate`` run alone."""

from __future__ import annotations

import http.client
import json
import random
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
    server = Server(path, "--max-batch", 32, "--max-context", CONTEXT)
    yield server, model, tok
    server.stop()


def alone(model, ids, n, temperature=0.0, seed=None, top_p=None, top_k=None):
    return model.generate(ids, n, temperature=temperature, seed=seed, top_p=top_p, top_k=top_k)[0]


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

    with ThreadPoolExecutor(n) as pool:
        got = list(pool.map(one, reqs))
    for req, text in zip(reqs, got):
        want = alone(model, req["prompt"], req["max_tokens"], req["temperature"], req["seed"], req["top_p"],
                     req["top_k"])
        assert text == tok.decode(want), req


def test_32_concurrent_streams_each_equal_generate_alone_recurrent(recurrent):
    server, model, tok = recurrent
    streams_equal_generate_alone(server, model, tok)
    assert server.metrics()["active_sequences"] == 0


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
    """(path, body bytes, the field the error must name or None) for ``n`` generated malformed requests."""
    rng = random.Random(seed)
    long_prompt = " ".join(["w5"] * (CONTEXT + 1))
    wrong = ["x", -1, 1.5, [], {}, True, [1, "a"], {"a": 1}, "", [[]]]
    fields = {  # field: invalid values (besides wrong types that do not fit)
        "model": [1, [], "no-such-model", ""], "prompt": ["", [], [-1], [V], [1.5], long_prompt, ["a", "b"], 3],
        "max_tokens": [-5, 0, 10 ** 9, CONTEXT + 1, 1.5, "8"], "temperature": [-0.1, -5, "hot", [0]],
        "top_p": [0, 1.01, -1, 2, "x"], "top_k": [0, -3, 2.5], "stop": [5, [1], [""], ["a"] * 5, ""],
        "seed": [-1, 2 ** 64, 1.5, "1"], "stream": ["yes", 1, []], "logprobs": [6, -1, True, "2"],
        "n": [2, 0], "echo": [True], "best_of": [3], "presence_penalty": [0.5], "logit_bias": [{"5": 1}],
        "stream_options": [{"include_usage": True}], "foo": [1, "x"],
    }
    chat_fields = {
        "messages": [[], "hi", [{"role": "user"}], [{"role": "wizard", "content": "w5"}], [{"content": "w5"}],
                     [{"role": "user", "content": 5}], [{"role": "user", "content": [{"type": "image_url"}]}],
                     [{"role": "user", "content": "w5", "tool_calls": []}], [5],
                     [{"role": "user", "content": long_prompt}]],
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
        value = rng.choice(pool[field] + ([w for w in wrong if _wrong_type(field, w)] if field != "foo" else []))
        if field == "stream_options":
            body.pop("stream", None)
        body[field] = value
        out.append(("/v1/chat/completions" if chat else "/v1/completions", json.dumps(body).encode(), field))
    return out


VALID = {"prompt": ["x"], "temperature": [1.5], "stop": ["x", []], "stream": [True], "logit_bias": [{}],
         "tools": [[]]}    # generic wrong values that happen to be valid for these fields


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
    path = folder(tmp_path / "one", "mamba2")
    server = Server(path, "--max-batch", 1, "--max-queue", 1, "--max-context", 8192, "--drain-timeout", 0)
    try:
        client = server.client()
        first = client.completions.create(model="one", prompt="w5", max_tokens=8000, temperature=0, stream=True)
        it = iter(first)
        next(it)                                                   # running: it holds the only slot
        waiting = client.completions.create(model="one", prompt="w6", max_tokens=4, temperature=0, stream=True)
        with pytest.raises(openai.RateLimitError) as e:
            client.completions.create(model="one", prompt="w7", max_tokens=4)
        assert e.value.response.headers["retry-after"] == "1"
        assert e.value.body["type"] == "rate_limit_error"
        assert server.terminate(timeout=30) == 0
        rest = list(it)                                            # the stream ended with a final event
        assert rest and rest[-1].choices[0].finish_reason == "abort"
        assert [ch.choices[0].finish_reason for ch in waiting][-1] == "abort"
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
