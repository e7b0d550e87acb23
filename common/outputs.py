"""What a request may ask of its outputs beyond sampling: logprobs, penalties, logit bias, n
choices, structured output. Torch-free validation, and the wire form of logprobs.

The fields travel under the same names flat (redis-cli) or in a msgpack ``payload``;
list/map values are JSON text when flat. Each field's parser and its encoder live here.
"""

from __future__ import annotations

import json
import math
from typing import Any

MAX_LOGPROBS = 20
MAX_N = 16
MAX_LOGIT_BIAS = 1024  # entries of one request's logit_bias
MAX_CHOICES = 256  # strings of structured_outputs.choice
STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar")


def _num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


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
        if not (_num(b) and -100 <= b <= 100):
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
