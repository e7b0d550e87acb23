"""Batch jobs through the official ``openai`` client: a real gateway (uvicorn), a real worker on the
tiny model, Redis. Output lines hold what the synchronous endpoint answers; statuses, counts,
listing, cancelling, the feed bound and the batch's priority."""

from __future__ import annotations

import httpx
import openai
import pytest
from batch_helpers import by_custom_id, chat_line, completion_line, lines_of, submit, upload, wait_batch
from producer_helpers import serve_gateway, shared_worker, wait_for

from common.keys import Keys
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
    """Equal but for the fields that name one call (its id and time)."""
    def strip(b: dict) -> dict:
        return {k: v for k, v in b.items() if k not in ("id", "created")}
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
