"""Field coercion: one wire value (bytes from Redis, or an already decoded msgpack value) into
a checked Python value, raising ValueError with a message naming the field.

A request entry is flat string fields, or a ``payload`` field holding a msgpack map of the same
names, or both (docs/protocol.md, "Fields"): :func:`field_map` merges them.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from typing import Any

import msgpack

# Ids end up inside Redis key names and log lines: keep them to a safe alphabet.
ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:\-]{0,127}$")
ID_RULE = "1-128 characters of letters, digits and ._:- (starting with a letter or digit)"


def check(ok: bool, name: str, why: str) -> None:
    if not ok:
        raise ValueError(f"{name} {why}")


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_num(v: Any) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) and math.isfinite(v)


def text(name: str, v: Any) -> str:
    if isinstance(v, bytes):
        try:
            return v.decode("utf-8")
        except UnicodeDecodeError:
            raise ValueError(f"{name} is not valid UTF-8") from None
    if isinstance(v, str):
        return v
    raise ValueError(f"{name} must be a string")


def integer(name: str, v: Any, lo: int, hi: int) -> int:
    if not is_int(v):
        s = text(name, v).strip()
        if not re.fullmatch(r"[+-]?\d{1,20}", s):
            raise ValueError(f"{name} must be an integer, got {s[:40]!r}")
        v = int(s)
    if not lo <= v <= hi:
        raise ValueError(f"{name} must be in [{lo}, {hi}], got {v}")
    return v


def number(name: str, v: Any, lo: float, hi: float) -> float:
    if not is_num(v):
        s = text(name, v).strip()
        try:
            v = float(s) if len(s) <= 40 else math.nan
        except ValueError:
            raise ValueError(f"{name} must be a number, got {s[:40]!r}") from None
    if not (math.isfinite(v) and lo <= v <= hi):
        raise ValueError(f"{name} must be in [{lo}, {hi}], got {v}")
    return float(v)


def boolean(name: str, v: Any) -> bool:
    if isinstance(v, bool):
        return v
    s = text(name, v).strip().lower()
    if s in ("1", "true", "yes"):
        return True
    if s in ("0", "false", "no"):
        return False
    raise ValueError(f"{name} must be a boolean (true/false/1/0), got {s[:40]!r}")


def structured(name: str, v: Any) -> Any:
    """A list/map field: already decoded (payload), JSON text, or msgpack bytes."""
    if isinstance(v, (list, dict)):
        return v
    if isinstance(v, bytes) and v[:1] not in (b"[", b"{", b'"', b" ", b"\n"):
        try:
            return msgpack.unpackb(v, raw=False, strict_map_key=True)
        except Exception as e:
            raise ValueError(f"{name} is neither JSON nor msgpack: {type(e).__name__}") from None
    s = text(name, v)
    try:
        return json.loads(s)
    except (ValueError, RecursionError) as e:
        raise ValueError(f"{name} is not valid JSON: {str(e)[:80]}") from None


def ints_below(ids: Any, bound: int) -> bool:
    """Whether ``ids`` (non-empty) holds only plain ints in [0, bound): exactly int, not bool (JSON
    gives int, float, str, bool, None, list or dict). At C speed over the whole list: a check per
    id was a tenth of a ms a 512-token prompt, at intake (the protocol's and the engine's)."""
    return set(map(type, ids)) == {int} and min(ids) >= 0 and max(ids) < bound


def token_ids(name: str, v: Any, limit: int) -> list[int]:
    ids = structured(name, v)
    if not isinstance(ids, list) or not ids:
        raise ValueError(f"{name} must be a non-empty array of token ids")
    if len(ids) > limit:
        raise ValueError(f"{name} has {len(ids)} tokens, more than the limit of {limit}")
    if not ints_below(ids, 2**31):
        raise ValueError(f"{name} must hold integers in [0, 2^31)")
    return ids


def str_keys(fields: Mapping[Any, Any]) -> dict[str, Any]:
    """Field names as str; undecodable names are left out (unknown fields are ignored anyway)."""
    out: dict[str, Any] = {}
    for k, v in fields.items():
        if isinstance(k, bytes):
            try:
                k = k.decode("utf-8")
            except UnicodeDecodeError:
                continue
        if isinstance(k, str):
            out[k] = v
    return out


def str_fields(fields: Mapping[Any, Any]) -> dict[str, str]:
    """Names and values as text (undecodable bytes replaced), for the worker's own entries."""
    return {(k.decode("utf-8", "replace") if isinstance(k, bytes) else k):
            (v.decode("utf-8", "replace") if isinstance(v, bytes) else v) for k, v in fields.items()}


def field_map(fields: Mapping[Any, Any]) -> dict[str, Any]:
    """The entry's fields by name, a msgpack ``payload`` merged with the flat fields beside it.

    A name given both ways must carry the same value (``"4"`` flat equals ``4`` packed): a
    conflict is a ValueError, since either choice could send the result where nobody reads.
    """
    out = str_keys(fields)
    if "payload" not in out:
        return out
    raw = out.pop("payload")
    try:
        payload = msgpack.unpackb(raw, raw=False, strict_map_key=True) if isinstance(raw, bytes) else None
    except Exception as e:
        raise ValueError(f"payload is not valid msgpack: {type(e).__name__}") from None
    if not isinstance(payload, dict) or not all(isinstance(k, str) for k in payload):
        raise ValueError("payload must be a msgpack map with string keys")
    for name, value in payload.items():
        if name in out and not _same(out[name], value):
            raise ValueError(f"{name} is given both as a field and in the payload, with different values")
        out[name] = value
    return out


def _same(flat: Any, packed: Any) -> bool:
    """Whether a flat (text) field and a payload value say the same thing."""
    if isinstance(flat, bytes) and isinstance(packed, bytes):
        return flat == packed
    try:
        s = text("field", flat)
        if isinstance(packed, (str, bytes)):
            return s == text("field", packed)
        if isinstance(packed, bool):
            return boolean("field", s) == packed
        if is_num(packed):
            return number("field", s, -math.inf, math.inf) == packed
        return json.loads(s) == packed
    except (ValueError, RecursionError):
        return False


def raw_size(fields: Mapping[Any, Any]) -> int:
    return sum(len(k) + len(v) for k, v in fields.items() if isinstance(k, (bytes, str)) and isinstance(v, (bytes, str)))
