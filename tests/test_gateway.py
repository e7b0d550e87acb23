"""The OpenAI-compatible gateway: the official ``openai`` client against a real uvicorn, a real
worker and Redis; request mapping, errors, auth, disconnects, health and metrics."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest
from producer_helpers import done, publish, serve_gateway, shared_worker, tokens, wait_for

from common.keys import Keys
from common.protocol import parse_control
from common.settings import Settings
from producer import Client


@pytest.fixture(scope="module")
def worker(request, redis_url, tiny_model_dir, tmp_path_factory):
    return shared_worker(request, redis_url, tiny_model_dir, tmp_path_factory)


@pytest.fixture(scope="module")
def gateway(worker, redis_url):
    """(base URL, prefix): the gateway in front of the shared real worker."""
    prefix, _ = worker
    with serve_gateway(Settings.from_env(redis_url=redis_url, prefix=prefix, model_name="tiny")) as base:
        yield base, prefix


@pytest.fixture
def oai(gateway):
    base, _ = gateway
    return openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture
def idle_gateway(redis_url, prefix):
    """A gateway on a prefix no worker serves: requests stay in the queue where we can read them."""
    with serve_gateway(Settings.from_env(redis_url=redis_url, prefix=prefix, model_name="tiny")) as base:
        yield base


# ---------------------------------------------------------------------------- end to end with openai


def test_completion(oai, gateway, redis_url):
    _, prefix = gateway
    r = oai.completions.create(model="tiny", prompt="Once upon a time", max_tokens=6, temperature=0)
    assert r.object == "text_completion" and r.model == "tiny" and r.id.startswith("cmpl-")
    (choice,) = r.choices
    assert choice.finish_reason == "length" and choice.index == 0
    assert (r.usage.completion_tokens, r.usage.total_tokens) == (6, r.usage.prompt_tokens + 6)
    with Client(redis_url, prefix) as c:  # the same request straight through the queue
        assert choice.text == c.generate("Once upon a time", max_tokens=6, temperature=0, timeout=60).text


def test_completion_stream(oai):
    full = oai.completions.create(model="tiny", prompt="Tell me", max_tokens=8, temperature=0)
    chunks = list(oai.completions.create(model="tiny", prompt="Tell me", max_tokens=8, temperature=0, stream=True,
                                         stream_options={"include_usage": True}))
    assert len(chunks) >= 3
    assert all(c.object == "text_completion" and c.id == chunks[0].id for c in chunks)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8


def test_stream_ends_with_done_marker(gateway):
    base, _ = gateway
    with httpx.stream("POST", base + "/v1/completions", json={"model": "tiny", "prompt": "a", "max_tokens": 3,
                                                              "temperature": 0, "stream": True}, timeout=60) as resp:
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in resp.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(ln[len("data: "):]) for ln in lines[:-1]]
    assert all(ln.startswith("data: ") for ln in lines)
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    assert resp.headers["x-request-id"] == events[0]["id"][len("cmpl-"):]


def test_chat(oai):
    msgs = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "hello"}]
    r = oai.chat.completions.create(model="tiny", messages=msgs, max_tokens=5, temperature=0, seed=1)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert r.choices[0].message.role == "assistant" and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 5
    chunks = list(oai.chat.completions.create(model="tiny", messages=msgs, max_completion_tokens=5, temperature=0,
                                              stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == r.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"
    # content given as text parts, and the extension fields
    r2 = oai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": [
        {"type": "text", "text": "hel"}, {"type": "text", "text": "lo"}]}], max_tokens=5, temperature=0,
        extra_body={"priority": "high", "top_k": 3, "ignore_eos": True})
    assert r2.usage.completion_tokens == 5


def test_batch_prompts_and_token_ids(oai):
    r = oai.completions.create(model="tiny", prompt=["one", "two"], max_tokens=3, temperature=0)
    assert [c.index for c in r.choices] == [0, 1]
    singles = [oai.completions.create(model="tiny", prompt=p, max_tokens=3, temperature=0).choices[0].text
               for p in ("one", "two")]
    assert [c.text for c in r.choices] == singles
    assert r.usage.completion_tokens == 6
    r = oai.completions.create(model="tiny", prompt=[1, 5, 9], max_tokens=2, temperature=0)
    assert r.usage.prompt_tokens == 3
    chunks = list(oai.completions.create(model="tiny", prompt=["a", "b"], max_tokens=3, temperature=0, stream=True))
    assert sorted(c.choices[0].index for c in chunks if c.choices[0].finish_reason) == [0, 1]


def test_cached_prompt_tokens_in_usage(oai):
    """A repeated 40-token prompt: the second finds 2 pages of 16 in the worker's prefix cache,
    reported where OpenAI puts it; a different cache_salt shares nothing."""
    prompt = list(range(100, 140))
    first = oai.completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0)
    again = oai.completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0)
    salted = oai.completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0,
                                    extra_body={"cache_salt": "tenant-b"})
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens == 32 and again.usage.prompt_tokens == 40
    assert salted.usage.prompt_tokens_details.cached_tokens == 0
    assert again.choices[0].text == first.choices[0].text == salted.choices[0].text


@pytest.mark.parametrize("kwargs, status, param", [
    ({"max_tokens": 0}, 400, "max_tokens"),
    ({"max_tokens": 100_000}, 400, "max_tokens"),
    ({"temperature": -0.5}, 400, "temperature"),
    ({"top_p": 1.5}, 400, "top_p"),
    ({"n": 17}, 400, "n"),
    ({"logprobs": 21}, 400, "logprobs"),
    ({"best_of": 3}, 400, "best_of"),
    ({"presence_penalty": 2.5}, 400, "presence_penalty"),
    ({"logit_bias": {"5": 101}}, 400, "logit_bias"),
    ({"extra_body": {"structured_outputs": {"regex": "a", "choice": ["b"]}}}, 400, "structured_outputs"),
    ({"extra_body": {"response_format": {"type": "xml"}}}, 400, "response_format"),
    ({"stop": [""]}, 400, "stop"),
    ({"prompt": ""}, 400, "prompt"),
    ({"prompt": [[1, 2], "mixed"]}, 400, "prompt"),
    ({"seed": -4}, 400, "seed"),
    ({"extra_body": {"priority": "urgent"}}, 400, "priority"),
    ({"extra_body": {"top_k": -5}}, 400, "top_k"),
    ({"extra_body": {"request_id": "has space"}}, 400, "request_id"),
    ({"model": "gpt-4o"}, 404, "model"),
])
def test_invalid_requests(oai, kwargs, status, param):
    args = {"model": "tiny", "prompt": "hi", "max_tokens": 3, **kwargs}
    with pytest.raises(openai.APIStatusError) as e:
        oai.completions.create(**args)
    assert e.value.status_code == status
    body = e.value.body
    assert body["param"] == param and body["message"] and body["type"] == "invalid_request_error"


@pytest.mark.parametrize("kwargs, param", [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages"),
    ({"top_logprobs": 3}, "top_logprobs"),  # without logprobs: true
    ({"n": 0}, "n"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, "tools"),
])
def test_invalid_chat_requests(oai, kwargs, param):
    args = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, **kwargs}
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(**args)
    assert e.value.body["param"] == param


def test_worker_side_error_is_a_400(oai):
    """too_long is found by the worker (it knows the model's length): still a 400, streaming or not."""
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as e:
            out = oai.completions.create(model="tiny", prompt=[3] * 3000, max_tokens=4, stream=stream)
            list(out) if stream else None
        assert e.value.body["code"] == "too_long" and "exceeds" in e.value.body["message"]


def test_raw_bad_bodies(gateway):
    base, _ = gateway
    cases = [
        (httpx.post(base + "/v1/completions", content=b"{not json"), 400, "not valid JSON"),
        (httpx.post(base + "/v1/completions", json=[1, 2]), 400, "must be a JSON object"),
        (httpx.post(base + "/v1/completions", json={"max_tokens": 3}), 400, "prompt is required"),
        (httpx.post(base + "/v1/completions", json={"prompt": "x", "stream": "yes"}), 400, "stream must be a boolean"),
        (httpx.post(base + "/v1/chat/completions", json={"messages": "hi"}), 400, "messages must be a non-empty array"),
        (httpx.post(base + "/v1/completions", json={"prompt": "x"}, headers={"X-Priority": "asap"}), 400, "priority"),
        (httpx.get(base + "/v1/completions"), 405, "no route GET"),
        (httpx.get(base + "/v2/whatever"), 404, "no route GET /v2/whatever"),
        (httpx.get(base + "/v1/models/gpt-4"), 404, "does not exist"),
    ]
    for resp, status, needle in cases:
        assert resp.status_code == status, resp.text
        err = resp.json()["error"]
        assert needle in err["message"] and set(err) == {"message", "type", "param", "code"}


def test_models_health_metrics(oai, gateway):
    base, _ = gateway
    assert [m.id for m in oai.models.list()] == ["tiny"]
    assert oai.models.retrieve("tiny").id == "tiny"
    h = httpx.get(base + "/health")
    assert h.status_code == 200 and h.json()["redis"] == "ok" and h.json()["workers"] >= 1
    oai.completions.create(model="tiny", prompt="count me", max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        oai.completions.create(model="tiny", prompt="count me", max_tokens=0)
    text = httpx.get(base + "/metrics").text
    assert 'tokenq_gateway_requests_total{method="POST",route="/v1/completions",status="200"}' in text
    assert 'tokenq_gateway_requests_total{method="POST",route="/v1/completions",status="400"}' in text
    assert 'tokenq_gateway_request_duration_seconds_count{method="POST",route="/v1/completions"}' in text
    assert 'tokenq_gateway_tokens_total{kind="completion"}' in text


def test_streaming_disconnect_cancels(gateway, redis_url):
    base, prefix = gateway
    with httpx.stream("POST", base + "/v1/completions", timeout=60, json={
            "model": "tiny", "prompt": "never ending", "max_tokens": 2000, "ignore_eos": True, "stream": True}) as resp:
        rid = resp.headers["x-request-id"]
        next(resp.iter_lines())  # the first chunk, then hang up
    with Client(redis_url, prefix) as c:
        res = c.attach(rid).result(timeout=60)
    assert res.finish_reason == "cancelled" and len(res.token_ids) < 2000


def test_non_streaming_disconnect_cancels(gateway, redis_url, r):
    base, prefix = gateway
    rid = f"hangup-{time.time_ns()}"
    with pytest.raises(httpx.TimeoutException):
        httpx.post(base + "/v1/completions", timeout=1.0, json={
            "model": "tiny", "prompt": "hang up on me", "max_tokens": 2000, "ignore_eos": True, "request_id": rid})
    # The gateway noticed the hang-up and sent a cancel; the worker ended the request with it.
    with Client(redis_url, prefix) as c:
        res = c.attach(rid).result(timeout=60)
    assert res.finish_reason == "cancelled" and len(res.token_ids) < 2000
    assert ("cancel", rid) in [parse_control(f) for _, f in r.xrange(Keys(prefix).control)]


# ---------------------------------------------------------------------------- mapping (no worker: the request stays queued)


def test_fields_sent_to_the_queue(idle_gateway, prefix, r):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 7,
            "temperature": 0.5, "top_p": 0.9, "seed": 3, "stop": "END", "top_k": 4, "ignore_eos": True,
            "timeout_s": 30, "user": "someone", "frequency_penalty": 0, "cache_salt": "t1"}
    with pytest.raises(httpx.TimeoutException):
        httpx.post(idle_gateway + "/v1/chat/completions", json=body, headers={"X-Priority": "high"}, timeout=0.7)
    k = Keys(prefix)
    (eid, f), = r.xrange(k.requests("high"))
    f = {a.decode(): b.decode() for a, b in f.items()}
    rid = f.pop("id")
    assert f == {"messages": '[{"role": "user", "content": "hi"}]', "max_tokens": "7", "temperature": "0.5",
                 "top_p": "0.9", "seed": "3", "stop": '["END"]', "top_k": "4", "ignore_eos": "true",
                 "timeout_s": "30.0", "cache_salt": "t1"}
    # The hang-up cancelled it.
    wait_for(lambda: [parse_control(x) for _, x in r.xrange(k.control)] == [("cancel", rid)], 10, what="cancel")
    # /v1/completions defaults to OpenAI's 16 tokens; the body's priority wins over the header.
    with pytest.raises(httpx.TimeoutException):
        httpx.post(idle_gateway + "/v1/completions", json={"prompt": "p", "priority": "low"},
                   headers={"X-Priority": "high"}, timeout=0.5)
    (_, f2), = r.xrange(k.requests("low"))
    assert f2[b"max_tokens"] == b"16" and f2[b"prompt"] == b"p"


def test_api_key(redis_url, prefix):
    s = Settings.from_env(redis_url=redis_url, prefix=prefix, model_name="tiny", api_key="s3cret")
    with serve_gateway(s) as base:
        bad = openai.OpenAI(base_url=base + "/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError) as e:
            bad.models.list()
        assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"
        assert httpx.post(base + "/v1/completions", json={"prompt": "x"}).status_code == 401
        good = openai.OpenAI(base_url=base + "/v1", api_key="s3cret", max_retries=0)
        assert [m.id for m in good.models.list()] == ["tiny"]
        assert httpx.get(base + "/health").status_code == 200  # health stays open


def test_health_when_redis_is_down(local_redis, prefix):
    srv = local_redis()
    with serve_gateway(Settings.from_env(redis_url=srv.url, prefix=prefix)) as base:
        assert httpx.get(base + "/health").status_code == 200
        srv.stop(kill=True)
        h = httpx.get(base + "/health", timeout=30)
        assert h.status_code == 503 and h.json()["status"] == "unavailable"
        resp = httpx.post(base + "/v1/completions", json={"prompt": "x"}, timeout=30)
        assert resp.status_code == 503 and resp.json()["error"]["code"] == "unavailable"


def test_stream_of_a_queued_request_keeps_alive(idle_gateway, prefix, r, monkeypatch):
    """A stream whose request waits in the queue answers 200 after a while and sends SSE keep-alive
    comments until the tokens come (written here with the protocol's encoders, as a worker would)."""
    import producer.gateway.streaming as gw

    monkeypatch.setattr(gw, "FIRST_EVENT_WAIT_S", 0.3)
    monkeypatch.setattr(gw, "KEEPALIVE_S", 0.2)
    key = Keys(prefix).result("late-1")
    with httpx.stream("POST", idle_gateway + "/v1/completions", timeout=30, json={
            "prompt": "wait", "max_tokens": 2, "stream": True, "request_id": "late-1"}) as resp:
        assert resp.status_code == 200
        lines = resp.iter_lines()
        assert next(lines) == ": keep-alive"
        publish(r, key, tokens((0, [5], "he"), (1, [6], "y")) + [done("late-1", "length", 1, 2)])
        rest = [ln for ln in lines if ln and not ln.startswith(":")]
    texts = [json.loads(ln[6:])["choices"][0]["text"] for ln in rest[:-1]]
    assert "".join(texts) == "hey" and rest[-1] == "data: [DONE]"
