"""Output features through the OpenAI gateway with the official ``openai`` client: logprobs in
OpenAI's completion and chat shapes (with echo, streaming and not), n choices, response_format
and extra_body structured_outputs, penalties; and through Client / tokenq submit."""

from __future__ import annotations

import json
import re

import openai
import pytest
from producer_helpers import serve_gateway, shared_worker

from common.settings import Settings
from producer import Client

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["ok", "n"], "additionalProperties": False}


@pytest.fixture(scope="module")
def worker(request, redis_url, tiny_model_dir, tmp_path_factory):
    return shared_worker(request, redis_url, tiny_model_dir, tmp_path_factory)


@pytest.fixture(scope="module")
def oai(worker, redis_url):
    prefix, _ = worker
    with serve_gateway(Settings.from_env(redis_url=redis_url, prefix=prefix, model_name="tiny")) as base:
        yield openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture
def client(worker, redis_url):
    prefix, _ = worker
    with Client(redis_url, prefix) as c:
        yield c


def test_completion_logprobs_with_echo(oai, client):
    prompt = "Once upon a time"
    r = oai.completions.create(model="tiny", prompt=prompt, max_tokens=5, temperature=0, logprobs=2, echo=True)
    (c,) = r.choices
    lp = c.logprobs
    direct = client.generate(prompt, max_tokens=5, temperature=0, logprobs=2, prompt_logprobs=2, timeout=60)
    n_prompt = len(direct.prompt_logprobs)
    assert c.text == prompt + direct.text
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == n_prompt + 5
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[n_prompt:] == pytest.approx([e["logprob"] for e in direct.logprobs], abs=1e-9)
    assert all(len(t) <= 2 and lp.token_logprobs[i] <= max(t.values()) + 1e-12 for i, t in enumerate(lp.top_logprobs) if t)
    assert lp.text_offset[n_prompt] == len(prompt) and lp.text_offset == sorted(lp.text_offset)
    # streamed: the same logprobs, chunk by chunk
    chunks = list(oai.completions.create(model="tiny", prompt=prompt, max_tokens=5, temperature=0, logprobs=2, stream=True))
    streamed = [x for ch in chunks for x in (ch.choices[0].logprobs.token_logprobs if ch.choices and ch.choices[0].logprobs else [])]
    assert streamed == pytest.approx(lp.token_logprobs[n_prompt:], abs=1e-9)  # (last bits: another batch)


def test_chat_logprobs(oai):
    msgs = [{"role": "user", "content": "Name a colour."}]
    r = oai.chat.completions.create(model="tiny", messages=msgs, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3,
                                    extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 6
    assert all(len(t.top_logprobs) == 3 and t.top_logprobs[0].logprob >= t.logprob - 1e-12 for t in content)
    assert "".join(t.token for t in content) == r.choices[0].message.content
    stream = oai.chat.completions.create(model="tiny", messages=msgs, max_tokens=6, temperature=0, logprobs=True,
                                         top_logprobs=3, stream=True, extra_body={"ignore_eos": True})
    got = [t.logprob for ch in stream if ch.choices and ch.choices[0].logprobs for t in ch.choices[0].logprobs.content]
    assert got == pytest.approx([t.logprob for t in content], abs=1e-9)
    plain = oai.chat.completions.create(model="tiny", messages=msgs, max_tokens=3)
    assert plain.choices[0].logprobs is None


def test_n_choices(oai):
    r = oai.completions.create(model="tiny", prompt=["a", "b"], max_tokens=4, n=2, seed=5, extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1, 2, 3] and r.usage.completion_tokens == 16
    assert r.choices[0].text != r.choices[1].text
    chunks = list(oai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4, n=3,
                                              seed=1, stream=True, extra_body={"ignore_eos": True}))
    ends = sorted(ch.choices[0].index for ch in chunks if ch.choices and ch.choices[0].finish_reason)
    assert ends == [0, 1, 2]
    texts = {}
    for ch in chunks:
        for c in ch.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
    whole = oai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4, n=3,
                                        seed=1, extra_body={"ignore_eos": True})
    assert [texts[i] for i in range(3)] == [c.message.content for c in whole.choices]


def test_structured_output_and_penalties(oai):
    r = oai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "JSON please"}], max_tokens=40,
                                    response_format={"type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMA}},
                                    presence_penalty=0.5, frequency_penalty=0.2, logit_bias={"5": -100})
    v = json.loads(r.choices[0].message.content)
    assert isinstance(v["ok"], bool) and 0 <= v["n"] <= 9
    r = oai.completions.create(model="tiny", prompt="Answer:", max_tokens=10, n=3, seed=2,
                               extra_body={"structured_outputs": {"choice": ["yes", "no"]}, "repetition_penalty": 1.2})
    assert all(c.text in ("yes", "no") for c in r.choices)
    stream = oai.completions.create(model="tiny", prompt="Code:", max_tokens=20, stream=True,
                                    extra_body={"structured_outputs": {"regex": "[a-z]{2}-[0-9]{2}"}})
    assert re.fullmatch("[a-z]{2}-[0-9]{2}", "".join(ch.choices[0].text for ch in stream if ch.choices))
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model="tiny", prompt="x", max_tokens=3, extra_body={"structured_outputs": {"regex": "[a-"}})
    assert e.value.body["code"] == "invalid_request" and "structured_outputs.regex" in e.value.body["message"]


def test_client_choices_and_logprobs(client):
    r = client.generate("Once upon", max_tokens=5, n=3, seed=3, ignore_eos=True, logprobs=1, timeout=60)
    assert [c.index for c in r.choices] == [0, 1, 2] and all(len(c.token_ids) == 5 for c in r.choices)
    assert all(len(c.logprobs) == 5 and len(c.logprobs[0]["top"]) == 1 for c in r.choices)
    assert r.text == r.choices[0].text and r.usage.completion_tokens == 15
    d = r.to_dict()
    assert len(d["choices"]) == 3 and d["logprobs"] == r.choices[0].logprobs


def test_submit_flags(worker, redis_url, capsys):
    from producer.cli import main

    prefix, _ = worker
    common = ["--redis-url", redis_url, "--prefix", prefix, "-q"]
    assert main(["submit", "Answer:", "--choice", "yes", "--choice", "no", "-n", "3", "--seed", "4", *common]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [ln[:4] for ln in lines] == ["[0] ", "[1] ", "[2] "] and all(ln[4:] in ("yes", "no") for ln in lines)
    assert main(["submit", "JSON:", "--json-schema", json.dumps(SCHEMA), "--logprobs", "2", "--presence-penalty", "0.3",
                 "--repetition-penalty", "1.1", "--min-tokens", "2", "--logit-bias", '{"7": -50}', "--json", *common]) == 0
    res = json.loads(capsys.readouterr().out)
    assert json.loads(res["text"])["ok"] in (True, False) and len(res["logprobs"]) == len(res["token_ids"])
    assert main(["submit", "x", "--regex", "[a-", *common]) == 1
    assert "structured_outputs.regex is invalid" in capsys.readouterr().err
    assert main(["submit", "x", "--logit-bias", "{nope", *common]) == 2
