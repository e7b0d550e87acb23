"""What a request may ask of its outputs beyond sampling: logprobs, penalties, logit bias, n
choices, structured output. Torch-free validation (SamplingParams calls :func:`check_params`, parse_request :func:`parse`),
and the wire form of logprobs. docs/protocol.md, "Outputs", is the contract.

The fields travel under the same names flat (redis-cli) or in a msgpack ``payload``;
list/map values are JSON text when flat. Each field's parser and its encoder live here.
"""

from __future__ import annotations

import json
from typing import Any

from common.protocol.fields import check, integer, is_int, is_num, number, structured

MAX_LOGPROBS = 20
MAX_N = 16
MAX_LOGIT_BIAS = 1024  # entries of one request's logit_bias
MAX_CHOICES = 256  # strings of structured_outputs.choice
STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar")


FIELDS = ("n", "logprobs", "prompt_logprobs", "presence_penalty", "frequency_penalty", "repetition_penalty",
          "min_tokens", "logit_bias", "structured_outputs")


def check_params(p: Any) -> None:
    """The output fields of a SamplingParams, checked (and normalised) in place."""
    check(is_int(p.n) and 1 <= p.n <= MAX_N, "n", f"must be an integer in [1, {MAX_N}]")
    for name in ("logprobs", "prompt_logprobs"):
        v = getattr(p, name)
        check(v is None or (is_int(v) and 0 <= v <= MAX_LOGPROBS), name, f"must be an integer in [0, {MAX_LOGPROBS}]")
    for name in ("presence_penalty", "frequency_penalty"):
        check(is_num(getattr(p, name)) and -2 <= getattr(p, name) <= 2, name, "must be in [-2, 2]")
    check(is_num(p.repetition_penalty) and 0 < p.repetition_penalty <= 10, "repetition_penalty", "must be in (0, 10]")
    check(is_int(p.min_tokens) and 0 <= p.min_tokens <= p.max_tokens, "min_tokens", "must be an integer in [0, max_tokens]")
    p.logit_bias = logit_bias(p.logit_bias)
    if p.structured_outputs is not None:
        p.structured_outputs = structured_outputs(p.structured_outputs)


def parse(f: dict[str, Any], p: dict[str, Any]) -> None:
    """The output fields of a request entry (flat strings or payload values) into ``p``."""
    if "n" in f:
        p["n"] = integer("n", f["n"], 1, MAX_N)
    for name in ("logprobs", "prompt_logprobs"):
        if name in f:
            p[name] = integer(name, f[name], 0, MAX_LOGPROBS)
    for name, lo, hi in (("presence_penalty", -2, 2), ("frequency_penalty", -2, 2), ("repetition_penalty", 1e-9, 10)):
        if name in f:
            p[name] = number(name, f[name], lo, hi)
    if "min_tokens" in f:
        p["min_tokens"] = integer("min_tokens", f["min_tokens"], 0, 2**31 - 1)
    if "logit_bias" in f:
        p["logit_bias"] = logit_bias(structured("logit_bias", f["logit_bias"]))
    if "structured_outputs" in f and "response_format" in f:
        raise ValueError("give structured_outputs or response_format, not both")
    if "structured_outputs" in f:
        p["structured_outputs"] = structured_outputs(structured("structured_outputs", f["structured_outputs"]))
    elif "response_format" in f:
        p["structured_outputs"] = from_response_format(structured("response_format", f["response_format"]))


def logit_bias(v: Any) -> dict[int, float]:
    """{token id: bias in [-100, 100]}; keys may be strings of digits (JSON, msgpack maps)."""
    if not isinstance(v, dict):
        raise ValueError("logit_bias must be an object mapping token ids to biases")
    if len(v) > MAX_LOGIT_BIAS:
        raise ValueError(f"logit_bias has {len(v)} entries, more than the limit of {MAX_LOGIT_BIAS}")
    out: dict[int, float] = {}
    for k, b in v.items():
        tid = k if isinstance(k, int) and not isinstance(k, bool) else int(k) if isinstance(k, str) and k.isdigit() and len(k) < 11 else -1
        if not 0 <= tid < 2**31:
            raise ValueError(f"logit_bias keys must be token ids (integers >= 0), got {str(k)[:40]!r}")
        if not (is_num(b) and -100 <= b <= 100):
            raise ValueError(f"logit_bias[{tid}] must be a number in [-100, 100]")
        out[tid] = float(b)
    return out


def structured_outputs(v: Any) -> dict[str, Any]:
    """vLLM's structured_outputs: exactly one of json (a schema, as an object or JSON text),
    json_object (true), regex, choice (strings) or grammar (EBNF); plus disable_any_whitespace
    (default true: JSON whitespace is bounded, so a weak model cannot pad until max_tokens)."""
    if not isinstance(v, dict):
        raise ValueError("structured_outputs must be an object")
    given = [k for k in STRUCTURED_KINDS if v.get(k) not in (None, False)]
    if len(given) != 1:
        raise ValueError(f"structured_outputs needs exactly one of {', '.join(STRUCTURED_KINDS)}"
                         + (f" (got {', '.join(given)})" if given else ""))
    unknown = set(v) - set(STRUCTURED_KINDS) - {"disable_any_whitespace"}
    if unknown:
        raise ValueError(f"structured_outputs has unknown keys: {', '.join(sorted(map(str, unknown)))[:200]}")
    kind = given[0]
    val = v[kind]
    if kind == "json":
        if isinstance(val, str):
            try:
                val = json.loads(val)
            except ValueError as e:
                raise ValueError(f"structured_outputs.json is not valid JSON: {str(e)[:80]}") from None
        if not isinstance(val, (dict, bool)):
            raise ValueError("structured_outputs.json must be a JSON schema (an object)")
    elif kind == "json_object":
        if val is not True:
            raise ValueError("structured_outputs.json_object must be true")
    elif kind == "choice":
        if not (isinstance(val, list) and 0 < len(val) <= MAX_CHOICES and all(isinstance(c, str) and c for c in val)):
            raise ValueError(f"structured_outputs.choice must be 1-{MAX_CHOICES} non-empty strings")
    elif not (isinstance(val, str) and val):
        raise ValueError(f"structured_outputs.{kind} must be a non-empty string")
    out = {kind: val}
    ws = v.get("disable_any_whitespace", True)
    if not isinstance(ws, bool):
        raise ValueError("structured_outputs.disable_any_whitespace must be a boolean")
    if not ws:
        out["disable_any_whitespace"] = False
    return out


def from_response_format(v: Any) -> dict[str, Any] | None:
    """OpenAI's response_format as structured_outputs (None for {"type": "text"})."""
    if not isinstance(v, dict) or v.get("type") not in ("text", "json_object", "json_schema"):
        raise ValueError('response_format must be {"type": "text" | "json_object" | "json_schema", ...}')
    if v["type"] == "text":
        return None
    if v["type"] == "json_object":
        return {"json_object": True}
    js = v.get("json_schema")
    if not isinstance(js, dict) or not isinstance(js.get("schema", {}), dict):
        raise ValueError('response_format json_schema must be {"json_schema": {"name": ..., "schema": {...}}}')
    return structured_outputs({"json": js.get("schema", {})})


# ---------------------------------------------------------------------------- logprobs on the wire
# A token's logprobs: {"id": 5, "token": "Hi", "logprob": -0.1, "top": [{"id": .., "token": .., "logprob": ..}]}
# ("token" only where the worker has a tokenizer; "top" holds the N most likely tokens, best first).


def encode_logprobs(entries: list[dict[str, Any] | None]) -> str:
    return json.dumps(entries, ensure_ascii=False, allow_nan=True)


def decode_logprobs(text: str | None) -> list[dict[str, Any] | None] | None:
    return json.loads(text) if text else None
