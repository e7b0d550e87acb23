"""Every Redis key name of the protocol (docs/protocol.md, "Keys"), from one place."""

from __future__ import annotations

import re
from dataclasses import dataclass

# Priority levels in order of urgency; the integer is the engine's priority (lower = sooner).
LEVELS: tuple[str, ...] = ("high", "normal", "low")
PRIORITIES: dict[str, int] = {level: i for i, level in enumerate(LEVELS)}
DEFAULT_PREFIX = "tokenq"


def priority_of(level: str | int) -> int:
    """Map a level name (or its integer) to the engine's priority; ValueError if unknown."""
    if isinstance(level, int) and not isinstance(level, bool):
        if 0 <= level < len(LEVELS):
            return level
    elif isinstance(level, str) and level in PRIORITIES:
        return PRIORITIES[level]
    raise ValueError(f"unknown priority {level!r}; expected one of {', '.join(LEVELS)}")


@dataclass(frozen=True)
class Keys:
    prefix: str = DEFAULT_PREFIX

    def requests(self, level: str) -> str:
        return f"{self.prefix}:requests:{level}"

    @property
    def request_streams(self) -> list[str]:
        return [self.requests(level) for level in LEVELS]

    @property
    def group(self) -> str:
        return f"{self.prefix}:workers"

    def result(self, request_id: str) -> str:
        return f"{self.prefix}:result:{request_id}"

    @property
    def result_prefix(self) -> str:
        return f"{self.prefix}:result:"

    @property
    def control(self) -> str:
        return f"{self.prefix}:control"

    @property
    def dead(self) -> str:
        return f"{self.prefix}:dead"

    def worker(self, name: str) -> str:
        return f"{self.prefix}:worker:{name}"

    @property
    def worker_pattern(self) -> str:
        """SCAN MATCH pattern of every heartbeat key (the prefix glob-escaped)."""
        return f"{_glob_escape(self.prefix)}:worker:*"

    @property
    def request_pattern(self) -> str:
        """SCAN MATCH pattern of every key that looks like a request stream, levels or not."""
        return f"{_glob_escape(self.prefix)}:requests:*"

    @property
    def sweep(self) -> str:
        """A short lock: one worker at a time sweeps the unread entries for expired deadlines."""
        return f"{self.prefix}:sweep"

    def level_of_stream(self, stream: str) -> str | None:
        """The level a request stream key belongs to, or None for a key that is not one."""
        head = f"{self.prefix}:requests:"
        if stream.startswith(head) and stream[len(head):] in PRIORITIES:
            return stream[len(head):]
        return None


def _glob_escape(text: str) -> str:
    return re.sub(r"([*?\[\]\\])", r"\\\1", text)
