"""Helpers for the batch tests: JSONL input files, uploads and waits through the official client."""

from __future__ import annotations

import io
import json
import time
from typing import Any

FINAL = ("completed", "failed", "expired", "cancelled")


def jsonl(lines: list[Any]) -> bytes:
    return b"".join((x if isinstance(x, bytes) else json.dumps(x).encode()) + b"\n" for x in lines)


def chat_line(cid: str, content: str, max_tokens: int = 4, **body: Any) -> dict[str, Any]:
    return {"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
                     "temperature": 0, **body}}


def completion_line(cid: str, prompt: Any, max_tokens: int = 4, **body: Any) -> dict[str, Any]:
    return {"custom_id": cid, "method": "POST", "url": "/v1/completions",
            "body": {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **body}}


def upload(oai, lines: list[Any], name: str = "input.jsonl") -> str:
    return oai.files.create(file=(name, io.BytesIO(jsonl(lines))), purpose="batch").id


def submit(oai, lines: list[Any], endpoint: str = "/v1/chat/completions", **kw: Any):
    return oai.batches.create(input_file_id=upload(oai, lines), endpoint=endpoint, completion_window="24h", **kw)


def wait_batch(oai, batch_id: str, statuses: tuple[str, ...] = FINAL, timeout: float = 120.0, seen: list | None = None):
    deadline = time.monotonic() + timeout
    while True:
        b = oai.batches.retrieve(batch_id)
        if seen is not None and (not seen or seen[-1] != b.status):
            seen.append(b.status)
        if b.status in statuses:
            return b
        if time.monotonic() > deadline:
            raise AssertionError(f"batch {batch_id} still {b.status} after {timeout} s: {b}")
        time.sleep(0.1)


def lines_of(oai, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    return [json.loads(x) for x in oai.files.content(file_id).content.decode().splitlines()]


def by_custom_id(lines: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    out = {x["custom_id"]: x for x in lines}
    assert len(out) == len(lines), "a custom_id appears twice"
    return out
