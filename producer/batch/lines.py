"""One input line of a batch in, one output line out, judged exactly as the synchronous endpoint does.

Input lines are ``{"custom_id", "method", "url", "body"}``. :func:`check_line` is the validation
pass (a line that fails it fails the whole batch, as OpenAI does); :func:`prepare_line` turns a
line's body into queue requests with the gateway's own request checks, so a body the synchronous
endpoint would reject becomes an error-file line carrying that very 400 body; :func:`response_line`
builds the output line with the gateway's own response body.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

# Everything the batch takes from the synchronous endpoint comes through these names, so that the
# two judge a body and build a response in one way.
from producer.gateway.errors import APIError, bad, error_body, generation_error, not_started, param_of
from producer.gateway.models import ChatCompletionRequest, CompletionRequest
from producer.gateway.replies import Reply
from producer.types import GenerationError, Result

MAX_CUSTOM_ID = 512


@dataclass
class Line:
    """A line that passed validation: its place in the file, its custom_id and its request body."""

    index: int
    custom_id: str
    body: dict[str, Any]


@dataclass
class Prepared:
    """What feeding one line does: queue ``requests`` (id, stream, fields), or write ``error_line``."""

    line: Line
    requests: list[tuple[str, str, dict[str, str]]] = field(default_factory=list)
    error_line: str | None = None


def request_ids(batch_id: str, index: int, n: int) -> list[str]:
    """The queue ids of line ``index``: fixed by the line, so a runner taking a batch over finds them."""
    base = f"{batch_id}-{index}"
    return [base] if n == 1 else [f"{base}-{j}" for j in range(n)]


def check_line(raw: str | bytes, endpoint: str) -> tuple[Line | None, tuple[str, str, str | None] | None]:
    """(the line, None) or (None, (code, message, param)); (None, None) for a blank line."""
    if not raw.strip():
        return None, None
    try:
        obj = json.loads(raw)
    except (ValueError, RecursionError):
        return None, ("invalid_json_line", "this line is not valid JSON", None)
    if not isinstance(obj, dict):
        return None, ("invalid_json_line", "this line must be a JSON object", None)
    cid = obj.get("custom_id")
    if not isinstance(cid, str) or not cid or len(cid) > MAX_CUSTOM_ID:
        return None, ("missing_required_parameter",
                      f"custom_id must be a non-empty string of at most {MAX_CUSTOM_ID} characters", "custom_id")
    if obj.get("method") != "POST":
        return None, ("invalid_method", "method must be POST", "method")
    url = obj.get("url")
    if url != endpoint:
        return None, ("invalid_url", f"url {url!r} does not match the batch's endpoint {endpoint!r}", "url")
    if not isinstance(obj.get("body"), dict):
        return None, ("invalid_request", "body must be a JSON object", "body")
    return Line(-1, cid, obj["body"]), None


def _check_model(model: Any, model_name: str) -> str:
    if model is None:
        return model_name
    if model != model_name:
        raise APIError(404, f"the model {model!r} does not exist; this gateway serves {model_name!r}",
                       "invalid_request_error", "model", "model_not_found")
    return model


def prepare_line(line: Line, *, batch_id: str, chat: bool, priority: str, model_name: str,
                 prepare: Callable[..., tuple[str, str, dict[str, str]]]) -> Prepared:
    """The queue requests of a line, checked as POST /v1/(chat/)completions checks them.

    ``prepare`` is the client's request builder (``build_request``: the worker's own parser).
    The line's own ``priority`` and ``request_id`` give way to the batch's.
    """
    raw = line.body
    try:
        if isinstance(raw.get("model"), str):
            _check_model(raw["model"], model_name)  # an unknown model is a 404 before any other fault
        body = (ChatCompletionRequest if chat else CompletionRequest).parse(raw)
        _check_model(body.model, model_name)
        if body.stream:
            raise bad("stream is not supported in a batch", "stream")
        items = body.requests()
        out = []
        for j, (it, rid) in enumerate(zip(items, request_ids(batch_id, line.index, len(items)))):
            try:
                out.append(prepare(**{**it, "priority": priority, "id": rid}))
            except (TypeError, ValueError) as e:  # as the synchronous endpoint words it
                msg = str(e) if len(items) == 1 else f"prompt {j}: {e}"
                raise bad(msg, param_of(str(e))) from None
    except APIError as e:
        return Prepared(line, error_line=http_error_line(batch_id, line, e, None))
    return Prepared(line, requests=out)


# ---------------------------------------------------------------------------- output lines


def line_id(batch_id: str, index: int) -> str:
    return f"batch_req_{batch_id.removeprefix('batch_')}_{index}"


def _dump(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)


def http_error_line(batch_id: str, line: Line, e: APIError, request_ids: list[str] | None) -> str:
    """An error-file line holding the HTTP error the synchronous endpoint would have answered."""
    body = error_body(e.message, e.type, e.param, e.code)
    return _dump({"id": line_id(batch_id, line.index), "custom_id": line.custom_id,
                  "response": {"status_code": e.status, "request_id": ",".join(request_ids or []) or None,
                               "body": body}, "error": None})


def batch_error_line(batch_id: str, line: Line, code: str, message: str) -> str:
    """An error-file line for a request that did not run (``batch_expired``, ``batch_cancelled``)."""
    return _dump({"id": line_id(batch_id, line.index), "custom_id": line.custom_id, "response": None,
                  "error": {"code": code, "message": message}})


@dataclass
class _Queued:
    id: str  # what Reply needs of a handle


def response_line(batch_id: str, line: Line, ends: list[Result | GenerationError], *, chat: bool, model_name: str,
                  usage: Callable[[list[Result]], dict[str, int]]) -> tuple[bool, str]:
    """(succeeded, output line) for a line whose requests all ended (results or errors, in order);
    ``usage`` is the gateway's token count (``Metrics.usage``)."""
    ids = [e.id if isinstance(e, Result) else (e.request_id or "") for e in ends]
    for e in ends:
        if isinstance(e, GenerationError):
            return False, http_error_line(batch_id, line, generation_error(e), ids)
        if e.finish_reason == "timeout":
            return False, http_error_line(batch_id, line, not_started(e.id), ids)
    results: list[Result] = ends  # type: ignore[assignment]
    reply = Reply(chat, line.body.get("model") or model_name, [_Queued(i) for i in ids])  # type: ignore[misc]
    return True, _dump({"id": line_id(batch_id, line.index), "custom_id": line.custom_id,
                        "response": {"status_code": 200, "request_id": ",".join(ids),
                                     "body": reply.whole(results, usage(results))},
                        "error": None})
