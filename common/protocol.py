"""The wire protocol of DESIGN.md §2 as code: request parsing and validation, result entries.

A request is a Redis stream entry of flat string fields (so redis-cli can send one), or a
single ``payload`` field holding a msgpack map of the same names. Everything here is
torch-free and pure: it turns field maps into records and back, and raises
:class:`ProtocolError` with a code and a message a client can act on.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import msgpack

from common.errors import INVALID_REQUEST, ProtocolError
from common.keys import Keys, priority_of

# Ids end up inside Redis key names and log lines: keep them to a safe alphabet.
ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:\-]{0,127}$")
ROLES = ("system", "user", "assistant", "tool", "developer")
FINISH_REASONS = ("stop", "length", "cancelled", "timeout")
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
    cache_salt: str | None = None  # requests share cached prompt pages only with requests of the same salt

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        _check(_is_int(self.max_tokens) and self.max_tokens >= 1, "max_tokens", "must be an integer >= 1")
        _check(_is_num(self.temperature) and 0 <= self.temperature <= 100, "temperature", "must be in [0, 100]")
        _check(_is_num(self.top_p) and 0 < self.top_p <= 1, "top_p", "must be in (0, 1]")
        _check(_is_int(self.top_k) and self.top_k >= 0, "top_k", "must be an integer >= 0")
        _check(self.seed is None or (_is_int(self.seed) and 0 <= self.seed < 2**63), "seed", "must be an integer in [0, 2^63)")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings")
        _check(all(_is_int(t) and t >= 0 for t in self.stop_token_ids), "stop_token_ids", "must be integers >= 0")
        _check(isinstance(self.ignore_eos, bool), "ignore_eos", "must be a boolean")
        _check(self.cache_salt is None or (isinstance(self.cache_salt, str) and 0 < len(self.cache_salt) <= MAX_SALT_CHARS),
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
                out[name] = json.dumps(value) if isinstance(value, (list, bool)) else str(value)
        if self.timeout_s is not None:
            out["timeout_s"] = repr(float(self.timeout_s))
        return out


# ---------------------------------------------------------------------------- parsing


def _check(ok: bool, name: str, why: str) -> None:
    if not ok:
        raise ValueError(f"{name} {why}")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) and math.isfinite(v)


def _text(name: str, v: Any) -> str:
    if isinstance(v, bytes):
        try:
            return v.decode("utf-8")
        except UnicodeDecodeError:
            raise ValueError(f"{name} is not valid UTF-8") from None
    if isinstance(v, str):
        return v
    raise ValueError(f"{name} must be a string")


def _int(name: str, v: Any, lo: int, hi: int) -> int:
    if not _is_int(v):
        s = _text(name, v).strip()
        if not re.fullmatch(r"[+-]?\d{1,20}", s):
            raise ValueError(f"{name} must be an integer, got {s[:40]!r}")
        v = int(s)
    if not lo <= v <= hi:
        raise ValueError(f"{name} must be in [{lo}, {hi}], got {v}")
    return v


def _float(name: str, v: Any, lo: float, hi: float) -> float:
    if not _is_num(v):
        s = _text(name, v).strip()
        try:
            v = float(s) if len(s) <= 40 else math.nan
        except ValueError:
            raise ValueError(f"{name} must be a number, got {s[:40]!r}") from None
    if not (math.isfinite(v) and lo <= v <= hi):
        raise ValueError(f"{name} must be in [{lo}, {hi}], got {v}")
    return float(v)


def _bool(name: str, v: Any) -> bool:
    if isinstance(v, bool):
        return v
    s = _text(name, v).strip().lower()
    if s in ("1", "true", "yes"):
        return True
    if s in ("0", "false", "no"):
        return False
    raise ValueError(f"{name} must be a boolean (true/false/1/0), got {s[:40]!r}")


def _structured(name: str, v: Any) -> Any:
    """A list/map field: already decoded (payload), JSON text, or msgpack bytes."""
    if isinstance(v, (list, dict)):
        return v
    if isinstance(v, bytes) and v[:1] not in (b"[", b"{", b'"', b" ", b"\n"):
        try:
            return msgpack.unpackb(v, raw=False, strict_map_key=True)
        except Exception as e:
            raise ValueError(f"{name} is neither JSON nor msgpack: {type(e).__name__}") from None
    s = _text(name, v)
    try:
        return json.loads(s)
    except (ValueError, RecursionError) as e:
        raise ValueError(f"{name} is not valid JSON: {str(e)[:80]}") from None


def _token_ids(name: str, v: Any, limit: int) -> list[int]:
    ids = _structured(name, v)
    if not isinstance(ids, list) or not ids:
        raise ValueError(f"{name} must be a non-empty array of token ids")
    if len(ids) > limit:
        raise ValueError(f"{name} has {len(ids)} tokens, more than the limit of {limit}")
    if not all(_is_int(t) and 0 <= t < 2**31 for t in ids):
        raise ValueError(f"{name} must hold integers in [0, 2^31)")
    return ids


def _messages(v: Any, limits: Limits) -> list[dict[str, str]]:
    msgs = _structured("messages", v)
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
        stops: Any = [_text("stop", v)]
    elif isinstance(v, str) and not v.startswith("["):
        stops = [v]
    else:
        stops = _structured("stop", v)
    if isinstance(stops, str):
        stops = [stops]
    if not isinstance(stops, list) or len(stops) > limits.max_stop:
        raise ValueError(f"stop must be a string or an array of at most {limits.max_stop} strings")
    if not all(isinstance(s, str) and 0 < len(s) <= limits.max_stop_chars for s in stops):
        raise ValueError(f"stop strings must be non-empty and at most {limits.max_stop_chars} characters")
    return stops


def _field_map(fields: Mapping[Any, Any]) -> dict[str, Any]:
    """Field names as str (undecodable names are ignored: unknown fields are ignored)."""
    out: dict[str, Any] = {}
    for k, v in fields.items():
        if isinstance(k, bytes):
            try:
                k = k.decode("utf-8")
            except UnicodeDecodeError:
                continue
        if isinstance(k, str):
            out[k] = v
    if "payload" in out:
        try:
            payload = msgpack.unpackb(out["payload"], raw=False, strict_map_key=True) if isinstance(out["payload"], bytes) else None
        except Exception as e:
            raise ValueError(f"payload is not valid msgpack: {type(e).__name__}") from None
        if not isinstance(payload, dict) or not all(isinstance(k, str) for k in payload):
            raise ValueError("payload must be a msgpack map with string keys")
        out = payload
    return out


def _raw_size(fields: Mapping[Any, Any]) -> int:
    return sum(len(k) + len(v) for k, v in fields.items() if isinstance(k, (bytes, str)) and isinstance(v, (bytes, str)))


def reply_key_for(fields: Mapping[Any, Any], entry_id: str, keys: Keys,
                  limits: Limits | None = None) -> tuple[str | None, str | None]:
    """Best effort (request id, reply key) of an entry, for publishing an error on a bad one.

    Either is None when it cannot be derived safely (a bad id or a reply_to outside the
    prefix): such errors go to the dead-letter stream instead. An oversized ``payload`` is
    not decoded (only flat ``id`` / ``reply_to`` fields count then).
    """
    try:
        if "payload" in fields or b"payload" in fields:
            if _raw_size(fields) > (limits or Limits()).request_bytes:
                raise ValueError("payload too large to decode")
        f = _field_map(fields)
    except ValueError:
        f = {k.decode("utf-8", "replace") if isinstance(k, bytes) else k: v for k, v in fields.items() if k != b"payload" and k != "payload"}
    rid: str | None = entry_id
    if "id" in f:
        try:
            rid = _text("id", f["id"])
        except ValueError:
            rid = None
        if rid is not None and not ID_RE.match(rid):
            rid = None
    if "reply_to" in f:
        try:
            reply = _text("reply_to", f["reply_to"])
        except ValueError:
            return rid, None
        return rid, reply if _reply_ok(reply, keys) else None
    return rid, keys.result(rid) if rid else None


def _reply_ok(reply: str, keys: Keys) -> bool:
    # The worker writes only under {prefix}:result:, or a producer could make it overwrite any key.
    return reply.startswith(keys.result_prefix) and bool(ID_RE.match(reply[len(keys.result_prefix):]))


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
        size = _raw_size(fields)
        if size > limits.request_bytes:
            raise ValueError(f"the request entry is {size} bytes, more than the limit of {limits.request_bytes}")
        f = _field_map(fields)
        if "id" in f:
            rid_text = _text("id", f["id"])
            if not ID_RE.match(rid_text):
                raise ValueError("id must be 1-128 characters of letters, digits and ._:- (starting with a letter or digit)")
        if "reply_to" in f and reply is None:
            raise ValueError(f"reply_to must be a key under {keys.result_prefix!r} with a valid id")
        assert rid is not None and reply is not None
        req = Request(id=rid, reply_to=reply, params=SamplingParams(), priority=priority_of(level), entry_id=entry_id)
        given = [name for name in ("prompt", "input_ids", "messages") if name in f]
        if len(given) != 1:
            raise ValueError("exactly one of prompt, input_ids or messages is required" + (f" (got {', '.join(given)})" if given else ""))
        if "prompt" in f:
            req.prompt = _text("prompt", f["prompt"])
            if not req.prompt:
                raise ValueError("prompt is empty")
            if len(req.prompt) > limits.max_prompt_chars:
                raise ValueError(f"prompt has {len(req.prompt)} characters, more than the limit of {limits.max_prompt_chars}")
        elif "input_ids" in f:
            req.input_ids = _token_ids("input_ids", f["input_ids"], limits.max_input_ids)
        else:
            req.messages = _messages(f["messages"], limits)
        p: dict[str, Any] = {}
        if "max_tokens" in f:
            p["max_tokens"] = _int("max_tokens", f["max_tokens"], 1, limits.max_tokens)
        if "temperature" in f:
            p["temperature"] = _float("temperature", f["temperature"], 0.0, 100.0)
        if "top_p" in f:
            p["top_p"] = _float("top_p", f["top_p"], 1e-9, 1.0)
        if "top_k" in f:
            p["top_k"] = _int("top_k", f["top_k"], 0, 2**31 - 1)
        if "seed" in f:
            p["seed"] = _int("seed", f["seed"], 0, 2**63 - 1)
        if "stop" in f:
            p["stop"] = _stop(f["stop"], limits)
        if "stop_token_ids" in f:
            p["stop_token_ids"] = _token_ids("stop_token_ids", f["stop_token_ids"], limits.max_stop)
        if "ignore_eos" in f:
            p["ignore_eos"] = _bool("ignore_eos", f["ignore_eos"])
        if "cache_salt" in f:
            p["cache_salt"] = _text("cache_salt", f["cache_salt"])
        if "max_tokens" not in p and SamplingParams.max_tokens > limits.max_tokens:
            p["max_tokens"] = limits.max_tokens  # the default, within a lower cap
        req.params = SamplingParams(**p)
        if "timeout_s" in f:
            req.timeout_s = _float("timeout_s", f["timeout_s"], 1e-3, limits.max_timeout_s)
        return req
    except ValueError as e:
        raise ProtocolError(INVALID_REQUEST, str(e), request_id=rid, reply_to=reply) from None


def parse_control(fields: Mapping[Any, Any]) -> tuple[str, str] | None:
    """A control entry as (type, request id), or None when it is not one we understand."""
    f = {(k.decode("utf-8", "replace") if isinstance(k, bytes) else k): v for k, v in fields.items()}
    try:
        kind, rid = _text("type", f.get("type", b"")), _text("id", f.get("id", b""))
    except ValueError:
        return None
    return (kind, rid) if kind == "cancel" and ID_RE.match(rid) else None


# ---------------------------------------------------------------------------- results


def token_entry(seq: int, ids: list[int], text: str) -> dict[str, str]:
    return {"type": "token", "seq": str(seq), "ids": json.dumps(ids), "text": text}


def done_entry(
    request_id: str,
    finish_reason: str,
    *,
    prompt_tokens: int,
    completion_tokens: int,
    queue_s: float,
    ttft_s: float | None,
    total_s: float,
) -> dict[str, str]:
    assert finish_reason in FINISH_REASONS, finish_reason
    return {
        "type": "done",
        "id": request_id,
        "finish_reason": finish_reason,
        "prompt_tokens": str(prompt_tokens),
        "completion_tokens": str(completion_tokens),
        "queue_s": f"{queue_s:.6f}",
        "ttft_s": "" if ttft_s is None else f"{ttft_s:.6f}",
        "total_s": f"{total_s:.6f}",
    }


def error_entry(request_id: str | None, code: str, message: str) -> dict[str, str]:
    return {"type": "error", "id": request_id or "", "code": code, "message": message[:1000]}


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
    queue_s: float | None = None
    ttft_s: float | None = None
    total_s: float | None = None
    code: str | None = None
    message: str | None = None

    @property
    def final(self) -> bool:
        return self.type in ("done", "error")


def decode_result(fields: Mapping[Any, Any]) -> ResultEntry:
    f = {(k.decode() if isinstance(k, bytes) else k): (v.decode("utf-8", "replace") if isinstance(v, bytes) else v) for k, v in fields.items()}
    kind = f.get("type", "")
    if kind == "token":
        return ResultEntry("token", seq=int(f["seq"]), ids=json.loads(f["ids"]), text=f.get("text", ""))
    if kind == "done":
        opt = lambda k: float(f[k]) if f.get(k) else None  # noqa: E731
        return ResultEntry(
            "done",
            finish_reason=f.get("finish_reason"),
            prompt_tokens=int(f.get("prompt_tokens") or 0),
            completion_tokens=int(f.get("completion_tokens") or 0),
            queue_s=opt("queue_s"),
            ttft_s=opt("ttft_s"),
            total_s=opt("total_s"),
        )
    if kind == "error":
        return ResultEntry("error", code=f.get("code"), message=f.get("message"))
    raise ValueError(f"unknown result entry type {kind!r}")
