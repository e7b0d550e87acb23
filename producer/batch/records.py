"""The records of the Batch API as OpenAI shapes them: file objects, batch objects, error objects.

A record lives in one Redis hash of plain string fields (so a Lua script can update a count or
a status without decoding JSON); :func:`file_object` and :func:`batch_object` turn those hashes
into the JSON the API returns.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping
from typing import Any

ENDPOINTS = ("/v1/chat/completions", "/v1/completions")
STATUSES = ("validating", "failed", "in_progress", "finalizing", "completed", "expired", "cancelling", "cancelled")
ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")  # a runner still has work to do
TIMESTAMPS = ("in_progress_at", "finalizing_at", "completed_at", "failed_at", "expired_at", "cancelling_at",
              "cancelled_at")
WINDOW_RE = re.compile(r"^([1-9][0-9]{0,5})([smh])$")
WINDOW_UNITS = {"s": 1, "m": 60, "h": 3600}
MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512  # OpenAI's limits


def new_file_id() -> str:
    return "file-" + uuid.uuid4().hex


def new_batch_id() -> str:
    return "batch_" + uuid.uuid4().hex


def window_seconds(window: str) -> int | None:
    """Seconds of a completion window: OpenAI's ``24h``, or (a tokenq extension) any ``<n>s|m|h``."""
    m = WINDOW_RE.match(window) if isinstance(window, str) else None
    return None if m is None else int(m.group(1)) * WINDOW_UNITS[m.group(2)]


def check_metadata(metadata: Any) -> str | None:
    """Why ``metadata`` is not OpenAI's map of at most 16 short strings, or None when it is."""
    if metadata is None:
        return None
    if not isinstance(metadata, dict):
        return "metadata must be an object of strings"
    if len(metadata) > MAX_METADATA_PAIRS:
        return f"metadata holds at most {MAX_METADATA_PAIRS} pairs"
    for k, v in metadata.items():
        if not isinstance(v, str) or len(k) > MAX_METADATA_KEY or len(v) > MAX_METADATA_VALUE:
            return (f"metadata keys are at most {MAX_METADATA_KEY} characters and values strings of at most "
                    f"{MAX_METADATA_VALUE}")
    return None


def _s(v: Any) -> str:
    return v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v)


def decode_hash(raw: Mapping[Any, Any]) -> dict[str, str]:
    return {_s(k): _s(v) for k, v in raw.items()}


def _int_or_none(h: Mapping[str, str], name: str) -> int | None:
    v = h.get(name)
    return int(v) if v not in (None, "") else None


# ---------------------------------------------------------------------------- files


def file_fields(file_id: str, *, filename: str, purpose: str, size: int, created_at: int,
                expires_at: int) -> dict[str, str]:
    return {"id": file_id, "filename": filename, "purpose": purpose, "bytes": str(size),
            "created_at": str(created_at), "expires_at": str(expires_at)}


def file_object(h: Mapping[str, str]) -> dict[str, Any]:
    return {"id": h["id"], "object": "file", "bytes": int(h.get("bytes") or 0), "created_at": int(h["created_at"]),
            "expires_at": _int_or_none(h, "expires_at"), "filename": h.get("filename", ""),
            "purpose": h.get("purpose", "batch"), "status": "processed", "status_details": None}


# ---------------------------------------------------------------------------- batches


def batch_fields(batch_id: str, *, input_file_id: str, endpoint: str, window: str, metadata: dict | None,
                 priority: str, created_at: int, expires_at: int, model: str) -> dict[str, str]:
    """The hash of a new batch; ``out_file``/``err_file`` are the ids its output files will take."""
    return {"id": batch_id, "input_file_id": input_file_id, "endpoint": endpoint, "completion_window": window,
            "metadata": json.dumps(metadata) if metadata is not None else "", "priority": priority, "model": model,
            "status": "validating", "created_at": str(created_at), "expires_at": str(expires_at),
            "out_file": new_file_id(), "err_file": new_file_id(),
            "total": "0", "completed": "0", "failed": "0", "next": "0",
            "out_lines": "0", "err_lines": "0", "out_bytes": "0", "err_bytes": "0"}


def batch_object(h: Mapping[str, str]) -> dict[str, Any]:
    status = h["status"]
    done = status in ("completed", "cancelled", "expired", "failed")
    errors = json.loads(h["errors"]) if h.get("errors") else None
    out = {
        "id": h["id"], "object": "batch", "endpoint": h["endpoint"],
        "errors": {"object": "list", "data": errors} if errors else None,
        "input_file_id": h["input_file_id"], "completion_window": h["completion_window"], "status": status,
        # Output files exist once the batch has ended, and only when they hold a line.
        "output_file_id": h["out_file"] if done and int(h.get("out_lines") or 0) else None,
        "error_file_id": h["err_file"] if done and int(h.get("err_lines") or 0) else None,
        "created_at": int(h["created_at"]), "expires_at": _int_or_none(h, "expires_at"),
        **{name: _int_or_none(h, name) for name in TIMESTAMPS},
        "request_counts": {"total": int(h.get("total") or 0), "completed": int(h.get("completed") or 0),
                           "failed": int(h.get("failed") or 0)},
        "metadata": json.loads(h["metadata"]) if h.get("metadata") else None,
        "priority": h.get("priority", "low"),  # tokenq's field: the queue level its requests take
    }
    return out


def batch_error(code: str, message: str, line: int | None = None, param: str | None = None) -> dict[str, Any]:
    """One entry of a failed batch's ``errors.data`` (``line`` counts from 1)."""
    return {"code": code, "message": message, "param": param, "line": line}
