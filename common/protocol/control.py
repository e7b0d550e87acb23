"""Control messages on ``{prefix}:control`` (today: ``cancel``): the encoder a producer uses and
the decoder a worker uses. docs/protocol.md, "Control", is the contract.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from common.protocol.fields import ID_RE, str_keys, text

CONTROL_MAXLEN = 10_000  # the control stream is trimmed (approximately) to this many entries
CANCEL_MEMORY_S = 600.0  # a cancel still applies to an entry pulled up to this long after it


def cancel_fields(request_id: str) -> dict[str, str]:
    """The control entry that cancels ``request_id`` (ValueError for an id that is not one)."""
    if not isinstance(request_id, str) or not ID_RE.match(request_id):
        raise ValueError(f"not a valid request id: {request_id!r}")
    return {"type": "cancel", "id": request_id}


def parse_control(fields: Mapping[Any, Any]) -> tuple[str, str] | None:
    """A control entry as (type, request id), or None when it is not one we understand."""
    f = str_keys(fields)
    try:
        kind, rid = text("type", f.get("type", b"")), text("id", f.get("id", b""))
    except ValueError:
        return None
    return (kind, rid) if kind == "cancel" and ID_RE.match(rid) else None
