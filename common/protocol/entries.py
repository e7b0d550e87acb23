"""Result-stream entries (``token``, ``done``, ``error``) and dead letters: encoders and the
decoder side by side. docs/protocol.md, "Result entries" and "Dead letters", is the contract.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from common.protocol import outputs
from common.protocol.fields import str_fields

FINISH_REASONS = ("stop", "length", "cancelled", "timeout")
FINAL_TYPES = ("done", "error")
MESSAGE_CHARS = 1000  # error messages are cut to this length
DEAD_MAXLEN = 100_000  # the dead-letter stream is trimmed (approximately) to this many entries


def token_entry(seq: int, ids: list[int], text: str, *, index: int | None = None, finish_reason: str | None = None,
                logprobs: list | None = None, prompt_logprobs: list | None = None) -> dict[str, str]:
    """A token entry. With n > 1: ``index`` (the choice) and, on a choice's last entry, its
    ``finish_reason``; ``logprobs`` / ``prompt_logprobs`` in common/protocol/outputs.py's wire form."""
    e = {"type": "token", "seq": str(seq), "ids": json.dumps(ids), "text": text}
    if index is not None:
        e["index"] = str(index)
    if finish_reason is not None:
        e["finish_reason"] = finish_reason
    if logprobs is not None:
        e["logprobs"] = outputs.encode_logprobs(logprobs)
    if prompt_logprobs is not None:
        e["prompt_logprobs"] = outputs.encode_logprobs(prompt_logprobs)
    return e


def done_entry(
    request_id: str,
    finish_reason: str,
    *,
    prompt_tokens: int,
    completion_tokens: int,
    queue_s: float,
    ttft_s: float | None,
    total_s: float,
    finish_reasons: list[str] | None = None,
    cached_tokens: int = 0,
) -> dict[str, str]:
    """The final entry; with n > 1, ``finish_reason`` is choice 0's, ``finish_reasons`` all of
    them, and completion_tokens counts every choice."""
    assert finish_reason in FINISH_REASONS, finish_reason
    extra = {"finish_reasons": json.dumps(finish_reasons)} if finish_reasons else {}
    return {
        "type": "done",
        "id": request_id,
        "finish_reason": finish_reason,
        "prompt_tokens": str(prompt_tokens),
        "completion_tokens": str(completion_tokens),
        "cached_tokens": str(cached_tokens),
        "queue_s": f"{queue_s:.6f}",
        "ttft_s": "" if ttft_s is None else f"{ttft_s:.6f}",
        "total_s": f"{total_s:.6f}",
    } | extra


def error_entry(request_id: str | None, code: str, message: str) -> dict[str, str]:
    return {"type": "error", "id": request_id or "", "code": code, "message": message[:MESSAGE_CHARS]}


def dead_entry(request_id: str | None, stream: str, entry_id: str, code: str, message: str) -> dict[str, str]:
    """An entry of ``{prefix}:dead``: a request that could not be answered on its result stream,
    or gave up after ``max_attempts`` deliveries."""
    return {"id": request_id or "", "stream": stream, "entry_id": entry_id, "code": code,
            "message": message[:MESSAGE_CHARS]}


@dataclass
class ResultEntry:
    """One decoded entry of a result stream."""

    type: str
    seq: int = 0
    ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens the worker found in its prefix cache
    queue_s: float | None = None
    ttft_s: float | None = None
    total_s: float | None = None
    code: str | None = None
    message: str | None = None
    index: int = 0  # the choice (n > 1)
    logprobs: list[dict] | None = None
    prompt_logprobs: list[dict] | None = None
    finish_reasons: list[str] | None = None  # done, n > 1: one per choice

    @property
    def final(self) -> bool:
        return self.type in FINAL_TYPES


def decode_result(fields: Mapping[Any, Any]) -> ResultEntry:
    f = str_fields(fields)
    kind = f.get("type", "")
    if kind == "token":
        return ResultEntry("token", seq=int(f["seq"]), ids=json.loads(f["ids"]), text=f.get("text", ""),
                           index=int(f.get("index") or 0), finish_reason=f.get("finish_reason"),
                           logprobs=outputs.decode_logprobs(f.get("logprobs")),
                           prompt_logprobs=outputs.decode_logprobs(f.get("prompt_logprobs")))
    if kind == "done":
        opt = lambda k: float(f[k]) if f.get(k) else None  # noqa: E731
        return ResultEntry(
            "done",
            finish_reason=f.get("finish_reason"),
            prompt_tokens=int(f.get("prompt_tokens") or 0),
            completion_tokens=int(f.get("completion_tokens") or 0),
            cached_tokens=int(f.get("cached_tokens") or 0),
            queue_s=opt("queue_s"),
            ttft_s=opt("ttft_s"),
            total_s=opt("total_s"),
            finish_reasons=json.loads(f["finish_reasons"]) if f.get("finish_reasons") else None,
        )
    if kind == "error":
        return ResultEntry("error", code=f.get("code"), message=f.get("message"))
    raise ValueError(f"unknown result entry type {kind!r}")
