"""The keyword arguments of a request, declared once (:class:`RequestOptions`) and turned into
XADD fields by :func:`build_request`. ``Client.submit``, ``AsyncClient.submit``,
``producer.jobs.generate`` and the gateway all take these names.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, TypedDict

from common.keys import LEVELS, Keys, priority_of
from common.protocol import outputs
from common.protocol.fields import ID_RE, ID_RULE
from common.protocol.request import INPUTS, Limits, Request, SamplingParams, parse_request


class RequestOptions(TypedDict, total=False):
    """Everything a request can say besides ``prompt`` (docs/protocol.md, "Request fields").

    Unset (or None) sampling options take the protocol's defaults; ``priority`` is ``high``,
    ``normal`` (default) or ``low`` (or 0-2); ``id`` defaults to a random one.
    """

    input_ids: Iterable[int] | None
    messages: list[Mapping[str, Any]] | None
    max_tokens: int | None
    temperature: float | None
    top_p: float | None
    top_k: int | None
    seed: int | None
    stop: str | list[str] | None
    stop_token_ids: list[int] | None
    ignore_eos: bool | None
    # outputs (docs/protocol.md, "Outputs")
    n: int | None
    logprobs: int | None
    prompt_logprobs: int | None
    presence_penalty: float | None
    frequency_penalty: float | None
    repetition_penalty: float | None
    min_tokens: int | None
    logit_bias: Mapping[int, float] | None
    structured_outputs: Mapping[str, Any] | None  # exactly one of json, json_object, regex, choice, grammar
    response_format: Mapping[str, Any] | None  # OpenAI's; becomes structured_outputs
    cache_salt: str | None
    priority: str | int
    timeout_s: float | None
    id: str | None


REQUEST_KEYWORDS: tuple[str, ...] = ("prompt", *RequestOptions.__annotations__)
SAMPLING_KEYWORDS: tuple[str, ...] = tuple(SamplingParams.__dataclass_fields__)


def new_id() -> str:
    import uuid

    return uuid.uuid4().hex


def build_request(*, keys: Keys, limits: Limits, prompt: str | None = None,
                  **options: Any) -> tuple[str, str, dict[str, str]]:
    """(request id, request stream key, XADD fields), validated exactly as a worker will parse them.

    ``options`` are :class:`RequestOptions`. Raises TypeError for an unknown keyword and
    ValueError with a message naming the bad argument before anything is sent.
    """
    unknown = [k for k in options if k not in REQUEST_KEYWORDS]
    if unknown:
        raise TypeError(f"build_request() got an unexpected keyword argument {unknown[0]!r}")
    level = _level(options.get("priority", "normal"))
    req = Request(id="", reply_to="", params=SamplingParams())
    _inputs(req, {"prompt": prompt, "input_ids": options.get("input_ids"), "messages": options.get("messages")})
    rid = new_id() if options.get("id") is None else options["id"]
    if not isinstance(rid, str) or not ID_RE.match(rid):
        raise ValueError(f"id must be {ID_RULE}")
    timeout_s = options.get("timeout_s")
    if timeout_s is not None and not (isinstance(timeout_s, (int, float)) and not isinstance(timeout_s, bool)):
        raise ValueError("timeout_s must be a number of seconds")
    req.params = _params(options)
    req.id, req.reply_to, req.timeout_s = rid, keys.result(rid), timeout_s
    try:
        fields = req.to_fields()
    except (TypeError, ValueError) as e:
        raise ValueError(f"cannot encode the request: {e}") from None
    try:  # the worker's own parser: same limits, same messages
        parse_request(fields, entry_id="0-1", level=level, keys=keys, limits=limits)
    except ValueError as e:
        raise ValueError(getattr(e, "message", str(e))) from None
    return rid, keys.submit_stream(level), fields


def _level(priority: str | int) -> str:
    try:
        return LEVELS[priority_of(priority)]
    except ValueError as e:
        raise ValueError(str(e)) from None


def _params(options: Mapping[str, Any]) -> SamplingParams:
    sampling = {k: options[k] for k in SAMPLING_KEYWORDS if options.get(k) is not None}
    if options.get("response_format") is not None:
        if "structured_outputs" in sampling:
            raise ValueError("give structured_outputs or response_format, not both")
        sampling["structured_outputs"] = outputs.from_response_format(dict(options["response_format"]))
    if isinstance(sampling.get("logit_bias"), Mapping):
        sampling["logit_bias"] = dict(sampling["logit_bias"])
    if isinstance(sampling.get("structured_outputs"), Mapping):
        sampling["structured_outputs"] = dict(sampling["structured_outputs"])
    if "stop" in sampling and not isinstance(sampling["stop"], (str, list, tuple)):
        raise ValueError("stop must be a string or a list of strings")
    return SamplingParams(**sampling)  # type checks: ValueError naming the field


def _inputs(req: Request, given: dict[str, Any]) -> None:
    names = [n for n in INPUTS if given[n] is not None]
    if len(names) != 1:
        raise ValueError("exactly one of prompt, input_ids or messages is required"
                         + (f" (got {', '.join(names)})" if names else ""))
    prompt, input_ids, messages = given["prompt"], given["input_ids"], given["messages"]
    if prompt is not None and not isinstance(prompt, str):
        raise ValueError(f"prompt must be a string, got {type(prompt).__name__}")
    if input_ids is not None:
        if isinstance(input_ids, (str, bytes)):
            raise ValueError("input_ids must be a list of token ids")
        input_ids = list(input_ids)
    if messages is not None:
        if not isinstance(messages, list):
            raise ValueError("messages must be a list of {role, content} dicts")
        messages = [dict(m) if isinstance(m, Mapping) else m for m in messages]
    req.prompt, req.input_ids, req.messages = prompt, input_ids, messages
