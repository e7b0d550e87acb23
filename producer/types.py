"""What producers get back: chunks, results, errors, and the reader state both clients share.

Torch-free and I/O-free: :class:`ResultReader` turns raw result-stream entries (docs/protocol.md)
into chunks, keeps the last entry id (so reading can resume) and drops any ``seq`` it has
already seen (so a request resumed by another worker after a crash never repeats tokens).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from common.protocol import CONTROL_MAXLEN, ResultEntry, build_request, cancel_fields, decode_result

log = logging.getLogger("tokenq.producer")

START_ID = "0-0"


# ---------------------------------------------------------------------------- errors


class GenerationError(Exception):
    """A request ended with an ``error`` entry (or could not be completed).

    ``code`` is the protocol's error code (``invalid_request``, ``too_long``, ``internal``),
    or ``timeout`` / ``cancelled`` for the subclasses below.
    """

    def __init__(self, code: str, message: str, request_id: str | None = None):
        super().__init__(f"{code}: {message}" + (f" (request {request_id})" if request_id else ""))
        self.code = code
        self.message = message
        self.request_id = request_id

    def __reduce__(self):  # picklable (RQ stores exceptions; multiprocessing too)
        return (type(self), (self.code, self.message, self.request_id))


class GenerationTimeout(GenerationError, TimeoutError):
    """The worker gave up on the request (``finish_reason timeout``: not started within
    ``timeout_s``), or a client-side wait (``result(timeout=...)``) ran out."""


class GenerationCancelled(GenerationError):
    """The request was cancelled (``finish_reason cancelled``)."""


# ---------------------------------------------------------------------------- results


@dataclass
class Chunk:
    """Newly generated tokens: ``token_ids`` start at output index ``seq``; ``text`` is their text delta."""

    seq: int
    token_ids: list[int]
    text: str
    index: int = 0  # the choice (n > 1)
    logprobs: list[dict] | None = None  # one per token (docs/protocol.md, "Outputs")
    prompt_logprobs: list[dict] | None = None  # with choice 0's first chunk
    finish_reason: str | None = None  # n > 1: this choice ended with this chunk


@dataclass
class Choice:
    """One of a request's n outputs."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    logprobs: list[dict] | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # of the prompt tokens, those the worker found in its prefix cache

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def to_dict(self) -> dict[str, int]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.total_tokens, "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}


@dataclass
class Timings:
    """Seconds, as the worker measured them: waiting in the queue, to the first token, in all."""

    queue_s: float | None = None
    ttft_s: float | None = None
    total_s: float | None = None


@dataclass
class Result:
    id: str
    text: str
    token_ids: list[int]
    finish_reason: str
    usage: Usage = field(default_factory=Usage)
    timings: Timings = field(default_factory=Timings)
    logprobs: list[dict] | None = None  # choice 0's, when asked for
    prompt_logprobs: list[dict] | None = None
    choices: list[Choice] = field(default_factory=list)  # every choice (text, token_ids above: choice 0's)

    def check(self) -> Result:
        """Raise :class:`GenerationTimeout` / :class:`GenerationCancelled` for a request that did not
        run to a normal end (``stop`` or ``length``); return self otherwise."""
        if self.finish_reason == "timeout":
            raise GenerationTimeout("timeout", "the request was not started within its timeout_s", self.id)
        if self.finish_reason == "cancelled":
            raise GenerationCancelled("cancelled", f"the request was cancelled after {len(self.token_ids)} tokens",
                                      self.id)
        return self

    def to_dict(self) -> dict[str, Any]:
        """A plain JSON-able dict (what ``tokenq submit --json`` prints and RQ jobs return)."""
        return {
            "id": self.id,
            "text": self.text,
            "token_ids": list(self.token_ids),
            "finish_reason": self.finish_reason,
            "usage": self.usage.to_dict(),
            "timings": asdict(self.timings),
        } | ({"logprobs": self.logprobs} if self.logprobs is not None else {}) | (
            {"prompt_logprobs": self.prompt_logprobs} if self.prompt_logprobs is not None else {}) | (
            {"choices": [c.to_dict() for c in self.choices]} if len(self.choices) > 1 else {})


# ---------------------------------------------------------------------------- reading


def stream_entries(reply: Any, key: str) -> list[tuple[str, Mapping[Any, Any]]]:
    """The (entry id, fields) pairs of one stream in an XREAD reply (RESP2 list or RESP3 dict)."""
    if not reply:
        return []
    if isinstance(reply, dict):
        items = reply.items()
    else:
        items = [(k, v) for k, v in reply]
    out = []
    for k, entries in items:
        name = k.decode() if isinstance(k, bytes) else k
        if name != key:
            continue
        if entries and len(entries) == 1 and isinstance(entries[0], list):
            entries = entries[0]  # redis-py's RESP3 parser nests the entry list one level deeper
        for eid, fields in entries or ():
            if eid is None or fields is None:
                continue
            out.append((eid.decode() if isinstance(eid, bytes) else eid, fields))
    return out


def prepare_many(keys: Any, limits: Any, requests: list[Mapping[str, Any]]) -> list[tuple[str, str, dict[str, str]]]:
    """``build_request`` for each dict of submit() arguments; ValueError naming the index of a bad one."""
    prepared = []
    for i, kw in enumerate(requests):
        if not isinstance(kw, Mapping):
            raise ValueError(f"requests[{i}] must be a dict of submit() arguments")
        try:
            prepared.append(build_request(keys=keys, limits=limits, **kw))
        except (TypeError, ValueError) as e:  # TypeError: an unknown argument name
            raise ValueError(f"requests[{i}]: {e}") from None
    return prepared


class ResultReader:
    """The state of reading one result stream; shared by the sync and asyncio handles."""

    def __init__(self, request_id: str, key: str, last_id: str = START_ID, next_seq: int = 0):
        self.request_id = request_id
        self.key = key
        self.last_id = last_id
        self.next_seqs = {0: next_seq}  # per choice: output tokens received so far (by this reader or the one it resumes)
        self.choices: dict[int, Choice] = {}
        self.prompt_logprobs: list[dict] | None = None
        self.final: ResultEntry | None = None
        self.pending: deque[Chunk] = deque()  # received, not yet handed to an iterator
        self.duplicates = 0

    @property
    def next_seq(self) -> int:
        return self.next_seqs[0]

    def _choice(self, index: int) -> Choice:
        return self.choices.setdefault(index, Choice(index, "", []))

    @property
    def token_ids(self) -> list[int]:
        return self._choice(0).token_ids

    @property
    def done(self) -> bool:
        return self.final is not None

    @property
    def text(self) -> str:
        return self._choice(0).text

    def feed(self, entries: list[tuple[str, Mapping[Any, Any]]]) -> None:
        for eid, fields in entries:
            self.last_id = eid
            if self.final is not None:
                continue  # nothing after the final entry counts
            try:
                e = decode_result(fields)
            except (ValueError, KeyError, TypeError) as exc:
                log.warning("ignoring malformed entry %s on %s: %s", eid, self.key, exc)
                continue
            if e.type == "token":
                self._token(e)
            else:
                self.final = e

    def _token(self, e: ResultEntry) -> None:
        expected = self.next_seqs.get(e.index, 0)
        if e.seq < expected:  # already have it (a resumed request re-sent it)
            self.duplicates += 1
            return
        if e.seq > expected:
            log.warning("gap on %s: expected seq %d, got %d", self.key, expected, e.seq)
        self.next_seqs[e.index] = e.seq + len(e.ids)
        c = self._choice(e.index)
        c.token_ids.extend(e.ids)
        c.text += e.text
        if e.logprobs is not None:
            c.logprobs = (c.logprobs or []) + e.logprobs
        if e.finish_reason:
            c.finish_reason = e.finish_reason
        if e.prompt_logprobs is not None:
            self.prompt_logprobs = e.prompt_logprobs
        self.pending.append(Chunk(e.seq, list(e.ids), e.text, e.index, e.logprobs, e.prompt_logprobs, e.finish_reason))

    def error(self) -> GenerationError | None:
        if self.final is not None and self.final.type == "error":
            return GenerationError(self.final.code or "internal", self.final.message or "", self.request_id)
        return None

    def result(self) -> Result:
        err = self.error()
        if err is not None:
            raise err
        assert self.final is not None
        f = self.final
        reason = f.finish_reason or "stop"
        reasons = f.finish_reasons or [reason]
        for i, r in enumerate(reasons):  # every choice, each with its end (a cancelled one may have no tokens)
            c = self._choice(i)
            c.finish_reason = r
            c.token_ids, c.logprobs = list(c.token_ids), None if c.logprobs is None else list(c.logprobs)
        first = self._choice(0)
        return Result(
            id=self.request_id,
            text=first.text,
            token_ids=list(first.token_ids),
            finish_reason=reason,
            usage=Usage(f.prompt_tokens, f.completion_tokens or len(first.token_ids), f.cached_tokens),
            timings=Timings(f.queue_s, f.ttft_s, f.total_s),
            logprobs=first.logprobs,
            prompt_logprobs=self.prompt_logprobs,
            choices=[self.choices[i] for i in sorted(self.choices)],
        )


__all__ = ["CONTROL_MAXLEN", "START_ID", "Choice", "Chunk", "GenerationCancelled", "GenerationError", "GenerationTimeout",
           "Result", "ResultReader", "Timings", "Usage", "build_request", "cancel_fields",
           "prepare_many", "stream_entries"]
