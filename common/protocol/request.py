"""The request: its record (:class:`Request`, :class:`SamplingParams`), the size caps, and both
halves of its wire form: :meth:`Request.to_fields` (what a producer sends) and
:func:`parse_request` (what a worker accepts). docs/protocol.md, "Request fields", is the contract.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from common.errors import INVALID_REQUEST, ProtocolError
from common.keys import Keys, priority_of
from common.protocol import outputs
from common.protocol.fields import (
    ID_RE,
    ID_RULE,
    boolean,
    check,
    field_map,
    integer,
    is_int,
    is_num,
    number,
    raw_size,
    str_keys,
    structured,
    text,
    token_ids,
)

ROLES = ("system", "user", "assistant", "tool", "developer")
INPUTS = ("prompt", "input_ids", "messages")  # exactly one of them
MAX_SALT_CHARS = 256


@dataclass
class SamplingParams:
    """How to sample one request. Torch-free; validated on construction."""

    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = no top-k
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    # outputs (common/protocol/outputs.py; docs/protocol.md, "Outputs")
    n: int = 1  # choices, each with its own random stream
    logprobs: int | None = None  # top-N logprobs per generated token (0: the chosen token's only)
    prompt_logprobs: int | None = None  # the same for each prompt token (the first gets none)
    presence_penalty: float = 0.0  # OpenAI's, over output tokens
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # transformers'/vLLM's, over prompt and output tokens
    min_tokens: int = 0  # EOS and stop tokens are masked until this many tokens are out
    logit_bias: dict[int, float] = field(default_factory=dict)
    structured_outputs: dict[str, Any] | None = None  # one of json, json_object, regex, choice, grammar
    cache_salt: str | None = None  # requests share cached prompt pages only with requests of the same salt

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        check(is_int(self.max_tokens) and self.max_tokens >= 1, "max_tokens", "must be an integer >= 1")
        check(is_num(self.temperature) and 0 <= self.temperature <= 100, "temperature", "must be in [0, 100]")
        check(is_num(self.top_p) and 0 < self.top_p <= 1, "top_p", "must be in (0, 1]")
        check(is_int(self.top_k) and self.top_k >= 0, "top_k", "must be an integer >= 0")
        check(self.seed is None or (is_int(self.seed) and 0 <= self.seed < 2**63), "seed", "must be an integer in [0, 2^63)")
        check(all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings")
        check(all(is_int(t) and t >= 0 for t in self.stop_token_ids), "stop_token_ids", "must be integers >= 0")
        check(isinstance(self.ignore_eos, bool), "ignore_eos", "must be a boolean")
        outputs.check_params(self)
        check(self.cache_salt is None or (isinstance(self.cache_salt, str) and 0 < len(self.cache_salt) <= MAX_SALT_CHARS),
              "cache_salt", f"must be a string of 1 to {MAX_SALT_CHARS} characters")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass(frozen=True)
class Limits:
    """Size caps on what a request may ask for (settings: TOKENQ_MAX_*)."""

    max_tokens: int = 4096
    max_prompt_chars: int = 200_000
    max_input_ids: int = 32_768
    max_messages: int = 512
    max_stop: int = 16
    max_stop_chars: int = 256
    max_timeout_s: float = 86_400.0
    max_request_bytes: int = 0  # the whole entry; 0: derived from the caps above

    @property
    def request_bytes(self) -> int:
        """Largest entry (field names + values) parsed at all: bigger ones are refused before any
        JSON/msgpack decoding, so a hostile entry cannot blow up into a huge Python object."""
        if self.max_request_bytes:
            return self.max_request_bytes
        # UTF-8 or JSON-escaped text (up to 6 bytes a character), ids as JSON, plus room for the rest.
        return 6 * self.max_prompt_chars + 12 * self.max_input_ids + 64 * 1024


@dataclass
class Request:
    """A parsed, validated generation request."""

    id: str
    reply_to: str
    params: SamplingParams
    priority: int = 1
    prompt: str | None = None
    input_ids: list[int] | None = None
    messages: list[dict[str, str]] | None = None
    timeout_s: float | None = None
    entry_id: str | None = None

    def to_fields(self) -> dict[str, str]:
        """Flat string fields for XADD (what a producer sends). Defaults are left out."""
        out: dict[str, str] = {"id": self.id}
        if self.prompt is not None:
            out["prompt"] = self.prompt
        elif self.input_ids is not None:
            out["input_ids"] = json.dumps(self.input_ids)
        else:
            out["messages"] = json.dumps(self.messages)
        default = SamplingParams()
        for name, value in asdict(self.params).items():
            if value != getattr(default, name):
                out[name] = json.dumps(value) if isinstance(value, (list, bool, dict)) else str(value)
        if self.timeout_s is not None:
            out["timeout_s"] = repr(float(self.timeout_s))
        return out


# ---------------------------------------------------------------------------- parsing


def _messages(v: Any, limits: Limits) -> list[dict[str, str]]:
    msgs = structured("messages", v)
    if not isinstance(msgs, list) or not msgs:
        raise ValueError("messages must be a non-empty array of {role, content} objects")
    if len(msgs) > limits.max_messages:
        raise ValueError(f"messages has {len(msgs)} entries, more than the limit of {limits.max_messages}")
    out, chars = [], 0
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ValueError(f"messages[{i}] must be an object with string 'role' and 'content'")
        if m["role"] not in ROLES:
            raise ValueError(f"messages[{i}].role must be one of {', '.join(ROLES)}")
        chars += len(m["content"])
        out.append({"role": m["role"], "content": m["content"]})
    if chars > limits.max_prompt_chars:
        raise ValueError(f"messages hold {chars} characters, more than the limit of {limits.max_prompt_chars}")
    return out


def _stop(v: Any, limits: Limits) -> list[str]:
    if isinstance(v, bytes) and v[:1] != b"[":
        stops: Any = [text("stop", v)]
    elif isinstance(v, str) and not v.startswith("["):
        stops = [v]
    else:
        stops = structured("stop", v)
    if isinstance(stops, str):
        stops = [stops]
    if not isinstance(stops, list) or len(stops) > limits.max_stop:
        raise ValueError(f"stop must be a string or an array of at most {limits.max_stop} strings")
    if not all(isinstance(s, str) and 0 < len(s) <= limits.max_stop_chars for s in stops):
        raise ValueError(f"stop strings must be non-empty and at most {limits.max_stop_chars} characters")
    return stops


def reply_key_for(fields: Mapping[Any, Any], entry_id: str, keys: Keys,
                  limits: Limits | None = None) -> tuple[str | None, str | None]:
    """Best effort (request id, reply key) of an entry, for publishing an error on a bad one.

    Either is None when it cannot be derived safely (a bad id or a reply_to outside the
    prefix): such errors go to the dead-letter stream instead. An oversized, undecodable or
    conflicting ``payload`` is left aside (only the flat ``id`` / ``reply_to`` fields count then).
    """
    try:
        if "payload" in fields or b"payload" in fields:
            if raw_size(fields) > (limits or Limits()).request_bytes:
                raise ValueError("payload too large to decode")
        f = field_map(fields)
    except ValueError:
        f = {k: v for k, v in str_keys(fields).items() if k != "payload"}
    rid: str | None = entry_id
    if "id" in f:
        try:
            rid = text("id", f["id"])
        except ValueError:
            rid = None
        if rid is not None and not ID_RE.match(rid):
            rid = None
    if "reply_to" in f:
        try:
            reply = text("reply_to", f["reply_to"])
        except ValueError:
            return rid, None
        return rid, reply if _reply_ok(reply, keys) else None
    return rid, keys.result(rid) if rid else None


def _reply_ok(reply: str, keys: Keys) -> bool:
    # The worker writes only under {prefix}:result:, or a producer could make it overwrite any key.
    return reply.startswith(keys.result_prefix) and bool(ID_RE.match(reply[len(keys.result_prefix):]))


def _input(req: Request, f: dict[str, Any], limits: Limits) -> None:
    """Exactly one of prompt, input_ids, messages, checked into ``req``."""
    given = [name for name in INPUTS if name in f]
    if len(given) != 1:
        raise ValueError("exactly one of prompt, input_ids or messages is required" + (f" (got {', '.join(given)})" if given else ""))
    if "prompt" in f:
        req.prompt = text("prompt", f["prompt"])
        if not req.prompt:
            raise ValueError("prompt is empty")
        if len(req.prompt) > limits.max_prompt_chars:
            raise ValueError(f"prompt has {len(req.prompt)} characters, more than the limit of {limits.max_prompt_chars}")
    elif "input_ids" in f:
        req.input_ids = token_ids("input_ids", f["input_ids"], limits.max_input_ids)
    else:
        req.messages = _messages(f["messages"], limits)


def _sampling(f: dict[str, Any], limits: Limits) -> SamplingParams:
    p: dict[str, Any] = {}
    if "max_tokens" in f:
        p["max_tokens"] = integer("max_tokens", f["max_tokens"], 1, limits.max_tokens)
    if "temperature" in f:
        p["temperature"] = number("temperature", f["temperature"], 0.0, 100.0)
    if "top_p" in f:
        p["top_p"] = number("top_p", f["top_p"], 1e-9, 1.0)
    if "top_k" in f:
        p["top_k"] = integer("top_k", f["top_k"], 0, 2**31 - 1)
    if "seed" in f:
        p["seed"] = integer("seed", f["seed"], 0, 2**63 - 1)
    if "stop" in f:
        p["stop"] = _stop(f["stop"], limits)
    if "stop_token_ids" in f:
        p["stop_token_ids"] = token_ids("stop_token_ids", f["stop_token_ids"], limits.max_stop)
    if "ignore_eos" in f:
        p["ignore_eos"] = boolean("ignore_eos", f["ignore_eos"])
    outputs.parse(f, p)
    if "cache_salt" in f:
        p["cache_salt"] = text("cache_salt", f["cache_salt"])
    if "max_tokens" not in p and SamplingParams.max_tokens > limits.max_tokens:
        p["max_tokens"] = limits.max_tokens  # the default, within a lower cap
    return SamplingParams(**p)


def parse_request(
    fields: Mapping[Any, Any],
    *,
    entry_id: str,
    level: str = "normal",
    keys: Keys | None = None,
    limits: Limits | None = None,
) -> Request:
    """Validate one stream entry into a :class:`Request`, or raise :class:`ProtocolError`."""
    keys = keys or Keys()
    limits = limits or Limits()
    rid, reply = reply_key_for(fields, entry_id, keys, limits)
    try:
        size = raw_size(fields)
        if size > limits.request_bytes:
            raise ValueError(f"the request entry is {size} bytes, more than the limit of {limits.request_bytes}")
        f = field_map(fields)
        if "id" in f and not ID_RE.match(text("id", f["id"])):
            raise ValueError(f"id must be {ID_RULE}")
        if "reply_to" in f and reply is None:
            raise ValueError(f"reply_to must be a key under {keys.result_prefix!r} with a valid id")
        assert rid is not None and reply is not None
        req = Request(id=rid, reply_to=reply, params=SamplingParams(), priority=priority_of(level), entry_id=entry_id)
        _input(req, f, limits)
        req.params = _sampling(f, limits)
        if "timeout_s" in f:
            req.timeout_s = number("timeout_s", f["timeout_s"], 1e-3, limits.max_timeout_s)
        return req
    except ValueError as e:
        raise ProtocolError(INVALID_REQUEST, str(e), request_id=rid, reply_to=reply) from None
