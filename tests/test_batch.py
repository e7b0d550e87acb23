"""Batch jobs through the official ``openai`` client: a real gateway (uvicorn), a real worker on the
tiny model, Redis. Output lines hold what the synchronous endpoint answers; statuses, counts,
listing, cancelling, the feed bound and the batch's priority."""

from __future__ import annotations

import httpx
import openai
import pytest
from batch_helpers import by_custom_id, chat_line, completion_line, lines_of, submit, upload, wait_batch
from producer_helpers import serve_gateway, shared_worker, wait_for

from common.settings import Settings


@pytest.fixture(scope="module")
def worker(request, redis_url, tiny_model_dir, tmp_path_factory):
    return shared_worker(request, redis_url, tiny_model_dir, tmp_path_factory)


def _settings(redis_url: str, prefix: str, **kw) -> Settings:
    return Settings.from_env(redis_url=redis_url, prefix=prefix, model_name="tiny", batch_lease_s=1.0, **kw)


@pytest.fixture(scope="module")
def gateway(worker, redis_url):
    prefix, _ = worker
    with serve_gateway(_settings(redis_url, prefix, batch_feed_limit=8)) as base:
        yield base, prefix


@pytest.fixture
def oai(gateway):
    base, _ = gateway
    return openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=60)


def _sync(base: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(base + path, json=body, timeout=60)


def _same_answer(batch_body: dict, sync_body: dict) -> None:
    """Equal but for the fields that name one call (its id and time, and how much of its prompt
    the worker's prefix cache held at that moment)."""
    def strip(b: dict) -> dict:
        out = {k: v for k, v in b.items() if k not in ("id", "created")}
        usage = dict(out.get("usage") or {})
        usage.pop("prompt_tokens_details", None)
        return {**out, "usage": usage}
    assert strip(batch_body) == strip(sync_body)


# ---------------------------------------------------------------------------- end to end


def test_chat_batch_matches_the_synchronous_endpoint(oai, gateway):
    base, _ = gateway
    lines = [chat_line(f"req-{i}", f"Tell me about {w}", max_tokens=3 + i % 3)
             for i, w in enumerate(["cats", "dogs", "the sea", "bread", "trains", "rain"])]
    seen: list[str] = []
    b = submit(oai, lines, metadata={"job": "nightly"})
    assert b.status == "validating" and b.endpoint == "/v1/chat/completions" and b.metadata == {"job": "nightly"}
    b = wait_batch(oai, b.id, seen=seen)
    assert b.status == "completed", b
    assert seen[-1] == "completed" and set(seen) <= {"validating", "in_progress", "finalizing", "completed"}
    assert b.request_counts.total == 6 and b.request_counts.completed == 6 and b.request_counts.failed == 0
    assert b.error_file_id is None and b.in_progress_at and b.finalizing_at and b.completed_at
    out = by_custom_id(lines_of(oai, b.output_file_id))
    assert set(out) == {x["custom_id"] for x in lines}
    for line in lines:
        got = out[line["custom_id"]]
        assert got["error"] is None and got["response"]["status_code"] == 200 and got["id"].startswith("batch_req_")
        body = got["response"]["body"]
        assert body["id"] == "chatcmpl-" + got["response"]["request_id"]
        _same_answer(body, _sync(base, "/v1/chat/completions", line["body"]).json())
    f = oai.files.retrieve(b.output_file_id)
    assert f.purpose == "batch_output" and f.bytes == len(oai.files.content(b.output_file_id).content)


def test_completions_batch_with_prompt_arrays(oai, gateway):
    base, _ = gateway
    lines = [completion_line("one", "Once upon a time"), completion_line("many", ["a", "b c", "d e f"], max_tokens=3),
             completion_line("ids", [5, 6, 7, 8])]
    b = wait_batch(oai, submit(oai, lines, endpoint="/v1/completions").id)
    assert b.status == "completed" and b.request_counts.completed == 3
    out = by_custom_id(lines_of(oai, b.output_file_id))
    assert len(out["many"]["response"]["body"]["choices"]) == 3
    for line in lines:
        _same_answer(out[line["custom_id"]]["response"]["body"], _sync(base, "/v1/completions", line["body"]).json())


def test_files_api(oai):
    fid = upload(oai, [chat_line("a", "x")], name="mine.jsonl")
    f = oai.files.retrieve(fid)
    assert (f.object, f.purpose, f.filename, f.status) == ("file", "batch", "mine.jsonl", "processed")
    assert oai.files.content(fid).content == b'{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", ' \
        b'"body": {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 4, ' \
        b'"temperature": 0}}\n'
    assert fid in [x.id for x in oai.files.list(purpose="batch")]
    d = oai.files.delete(fid)
    assert d.deleted and d.id == fid
    with pytest.raises(openai.NotFoundError):
        oai.files.retrieve(fid)
    with pytest.raises(openai.NotFoundError):
        oai.files.content(fid)


def test_list_is_paginated(oai):
    ids = [submit(oai, [chat_line("a", "x", max_tokens=1)]).id for _ in range(3)]
    page = oai.batches.list(limit=2)
    assert [b.id for b in page.data] == ids[::-1][:2] and page.has_more
    rest = oai.batches.list(limit=2, after=page.data[-1].id)
    assert rest.data[0].id == ids[0]
    for bid in ids:
        wait_batch(oai, bid)
    with pytest.raises(openai.APIStatusError) as e:  # a finished batch stays as it is
        oai.batches.cancel(ids[0])
    assert e.value.status_code == 409


# ---------------------------------------------------------------------------- bad input


def _failed_with(oai, raw_lines: list, code: str, line: int, endpoint: str = "/v1/chat/completions"):
    b = wait_batch(oai, submit(oai, raw_lines, endpoint=endpoint).id)
    assert b.status == "failed" and b.failed_at and b.output_file_id is None, b
    errs = [(e.code, e.line) for e in b.errors.data]
    assert (code, line) in errs, errs
    return b


def test_malformed_lines_fail_the_batch(oai):
    good = chat_line("a", "hi")
    _failed_with(oai, [good, b"{not json", chat_line("c", "x")], "invalid_json_line", 2)
    _failed_with(oai, [good, b"[1, 2]"], "invalid_json_line", 2)
    _failed_with(oai, [good, {**chat_line("b", "x"), "url": "/v1/embeddings"}], "invalid_url", 2)
    _failed_with(oai, [good, completion_line("b", "x")], "invalid_url", 2)  # another endpoint's line
    _failed_with(oai, [good, {**chat_line("b", "x"), "method": "GET"}], "invalid_method", 2)
    _failed_with(oai, [good, chat_line("a", "again")], "duplicate_custom_id", 2)
    _failed_with(oai, [{**good, "custom_id": 7}], "missing_required_parameter", 1)
    _failed_with(oai, [{**good, "body": "text"}], "invalid_request", 1)
    b = _failed_with(oai, [b"{", b"{", good], "invalid_json_line", 1)
    assert [e.line for e in b.errors.data] == [1, 2]


def test_bad_batch_and_file_requests(oai):
    fid = upload(oai, [chat_line("a", "hi")])
    with pytest.raises(openai.BadRequestError) as e:
        oai.batches.create(input_file_id=fid, endpoint="/v1/embeddings", completion_window="24h")
    assert e.value.body["param"] == "endpoint"
    with pytest.raises(openai.BadRequestError):
        oai.batches.create(input_file_id=fid, endpoint="/v1/completions", completion_window="forever")
    with pytest.raises(openai.NotFoundError):
        oai.batches.create(input_file_id="file-nope", endpoint="/v1/completions", completion_window="24h")
    with pytest.raises(openai.BadRequestError) as e:
        oai.batches.create(input_file_id=fid, endpoint="/v1/completions", completion_window="24h",
                           extra_body={"priority": "urgent"})
    assert e.value.body["param"] == "priority"
    with pytest.raises(openai.BadRequestError):
        oai.files.create(file=("x.jsonl", b"\n \n"), purpose="batch")
    with pytest.raises(openai.BadRequestError):
        oai.files.create(file=("x.jsonl", b"\xff\xfe"), purpose="batch")
    with pytest.raises(openai.BadRequestError):
        oai.files.create(file=("x.jsonl", b"{}"), purpose="fine-tune")
    with pytest.raises(openai.NotFoundError):
        oai.batches.retrieve("batch_nope")


def test_rejected_bodies_become_error_lines(oai, gateway):
    """Each body the synchronous endpoint refuses: an error-file line holding that very answer."""
    base, _ = gateway
    bad = {
        "n": chat_line("n", "hi", n=17),  # n is 1 to 16
        "max_tokens": chat_line("max_tokens", "hi", max_tokens=-5),
        "model": {**chat_line("model", "hi"), "body": {**chat_line("x", "hi")["body"], "model": "other"}},
        "messages": {**chat_line("messages", "hi"), "body": {"model": "tiny", "messages": []}},
        "temperature": chat_line("temperature", "hi", temperature="hot"),
        "tools": chat_line("tools", "hi", tools=[{"type": "function"}]),
        "too_long": chat_line("too_long", "word " * 3000),  # found by the worker
    }
    good = [chat_line(f"ok-{i}", f"prompt {i}") for i in range(3)]
    lines = [good[0], *bad.values(), *good[1:], chat_line("stream", "hi", stream=True)]
    b = wait_batch(oai, submit(oai, lines).id)
    assert b.status == "completed"
    assert (b.request_counts.total, b.request_counts.completed, b.request_counts.failed) == (11, 3, 8)
    assert set(by_custom_id(lines_of(oai, b.output_file_id))) == {"ok-0", "ok-1", "ok-2"}
    errors = by_custom_id(lines_of(oai, b.error_file_id))
    assert set(errors) == {*bad, "stream"}
    for cid, line in bad.items():
        sync = _sync(base, "/v1/chat/completions", line["body"])
        got = errors[cid]
        assert got["error"] is None and got["response"]["status_code"] == sync.status_code
        assert got["response"]["body"] == sync.json(), cid
    assert errors["stream"]["response"]["body"]["error"]["param"] == "stream"


def test_oversized_file_is_refused(redis_url, prefix):
    with serve_gateway(_settings(redis_url, prefix, batch_max_file_bytes=1000)) as base:
        oai = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.APIStatusError) as e:
            oai.files.create(file=("big.jsonl", b'{"a": 1}\n' * 200), purpose="batch")
        assert e.value.status_code == 413 and e.value.body["code"] == "file_too_large"
        assert oai.files.create(file=("ok.jsonl", b'{"a": 1}\n' * 10), purpose="batch").bytes == 90


def test_cancel_mid_run_keeps_what_completed(oai):
    lines = [chat_line(f"c{i}", f"story {i}", max_tokens=24) for i in range(40)]
    b = submit(oai, lines)
    wait_batch(oai, b.id, ("in_progress",))
    wait_for(lambda: oai.batches.retrieve(b.id).request_counts.completed >= 2, 60, 0.05, "2 lines done")
    assert oai.batches.cancel(b.id).status == "cancelling"
    b = wait_batch(oai, b.id)
    assert b.status == "cancelled" and b.cancelled_at
    out = by_custom_id(lines_of(oai, b.output_file_id))
    errors = by_custom_id(lines_of(oai, b.error_file_id))
    assert len(out) == b.request_counts.completed >= 2 and len(errors) == b.request_counts.failed
    assert not set(out) & set(errors) and len(out) + len(errors) < 40  # the unfed lines did not run
    assert all(x["response"]["status_code"] == 200 for x in out.values())
    assert all(x["error"]["code"] == "batch_cancelled" for x in errors.values())
