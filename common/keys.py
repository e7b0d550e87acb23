"""Every Redis key name of the protocol (docs/protocol.md, "Keys"), from one place."""

from __future__ import annotations

import random
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
    shards: int = 1  # request streams per level: shard 0 is requests:<level>, shard i requests:<level>:<i>

    def requests(self, level: str, shard: int = 0) -> str:
        return f"{self.prefix}:requests:{level}" if shard == 0 else f"{self.prefix}:requests:{level}:{shard}"

    def level_streams(self, level: str) -> list[str]:
        """Every shard of one level's request stream (on a cluster, each in its own slot)."""
        return [self.requests(level, i) for i in range(self.shards)]

    def submit_stream(self, level: str) -> str:
        """The shard a producer sends one entry to: one at random (spreads ingest evenly)."""
        return self.requests(level, random.randrange(self.shards) if self.shards > 1 else 0)

    @property
    def request_streams(self) -> list[str]:
        return [s for level in LEVELS for s in self.level_streams(level)]

    @property
    def group(self) -> str:
        return f"{self.prefix}:workers"

    def result(self, request_id: str) -> str:
        return f"{self.prefix}:result:{request_id}"

    def fence(self, request_id: str) -> str:
        return fence_key(self.result(request_id))

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

    # Batch jobs (producer/batch): files, batch records and what a batch runner keeps per batch.
    def file(self, file_id: str) -> str:
        return f"{self.prefix}:file:{file_id}"

    def file_lines(self, file_id: str) -> str:
        return f"{self.prefix}:file:{file_id}:lines"

    @property
    def files(self) -> str:
        return f"{self.prefix}:files"

    def batch(self, batch_id: str) -> str:
        return f"{self.prefix}:batch:{batch_id}"

    def batch_inflight(self, batch_id: str) -> str:
        return f"{self.prefix}:batch:{batch_id}:inflight"

    def batch_lease(self, batch_id: str) -> str:
        return f"{self.prefix}:batch:{batch_id}:lease"

    @property
    def batches(self) -> str:
        return f"{self.prefix}:batches"

    @property
    def batches_active(self) -> str:
        return f"{self.prefix}:batches:active"

    def level_of_stream(self, stream: str) -> str | None:
        """The level a request stream key belongs to, or None for a key that is not one."""
        head = f"{self.prefix}:requests:"
        if not stream.startswith(head):
            return None
        level, _, shard = stream[len(head):].partition(":")
        if level in PRIORITIES and (not shard or (shard.isdigit() and 0 < int(shard) < self.shards)):
            return level
        return None


def hash_tag(key: str) -> str | None:
    """The part of ``key`` Redis Cluster hashes when it is not the whole key: the text between
    the first ``{`` and the first ``}`` after it, if not empty (None otherwise)."""
    start = key.find("{")
    end = key.find("}", start + 1) if start >= 0 else -1
    return key[start + 1:end] if end > start + 1 else None


def fence_key(result_key: str) -> str:
    """The fence of a result stream, in the stream's own cluster slot without renaming it: the
    whole result key as the hash tag (ids hold no braces), or the key's own tag if it has one.
    """
    return f"{result_key}:fence" if hash_tag(result_key) is not None else f"{{{result_key}}}:fence"


def _glob_escape(text: str) -> str:
    return re.sub(r"([*?\[\]\\])", r"\\\1", text)
