"""The worker heartbeat hash ``{prefix}:worker:{name}``: written by a worker every
``heartbeat_s``, read by ``tokenq status`` and the gateway's /health. docs/protocol.md,
"Heartbeat", is the contract.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from common.protocol.fields import str_fields

TEXT_FIELDS = ("name", "model", "device")


@dataclass
class Heartbeat:
    name: str
    model: str
    device: str
    pid: int
    pages_total: int
    pages_free: int
    running: int
    waiting: int
    tokens_per_s: float
    last_step_s: float
    last_step: float  # Unix time of the write
    steps: int
    preemptions: int
    served: int
    started: float  # Unix time the worker started
    stopping: bool
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache, since start
    prefix_cache_hits: int = 0  # of those, tokens found cached

    def to_fields(self) -> dict[str, str | int]:
        out: dict[str, str | int] = {}
        for k, v in asdict(self).items():
            if isinstance(v, bool):
                out[k] = int(v)
            elif isinstance(v, float):
                out[k] = f"{v:.4f}" if k == "last_step_s" else (f"{v:.1f}" if k == "tokens_per_s" else f"{v:.3f}")
            else:
                out[k] = v
        return out


def ttl_s(heartbeat_s: float) -> int:
    """How long a heartbeat hash outlives its last write: a few missed beats, then it is gone."""
    return max(10, int(heartbeat_s * 5))


def parse_heartbeat(fields: Mapping[Any, Any]) -> dict[str, Any]:
    """A heartbeat hash as a dict, numbers as numbers (for --json); unknown fields kept as text."""
    return {k: _value(k, v) for k, v in str_fields(fields).items()}


def _value(name: str, text: str) -> Any:
    if name in TEXT_FIELDS:
        return text
    if re.fullmatch(r"[+-]?\d{1,18}", text):
        return int(text)
    try:
        v = float(text)
    except ValueError:
        return text
    return v if math.isfinite(v) else text
