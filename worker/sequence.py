"""The engine's record of one request: its tokens, its pages and where it stands."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from common.protocol import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"  # not admitted yet, or preempted (recompute: no pages; swap: pages on host)
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    request_id: str
    token_ids: list[int]  # prompt + output so far (output = token_ids[num_prompt_tokens:])
    num_prompt_tokens: int
    params: SamplingParams
    priority: int  # lower = more urgent
    arrival: int  # admission order tie-breaker; kept across preemptions so nobody overtakes
    arrival_time: float  # monotonic seconds
    seed: int  # resolved sampling seed (random when the request gave none)
    timeout_s: float | None = None
    status: Status = Status.WAITING
    num_computed: int = 0  # tokens whose K/V are in the cache (device pages, or host pages when swapped)
    block_table: list[int] = field(default_factory=list)  # device pages, in order
    host_pages: list[int] | None = None  # set while swapped out
    reserved_pages: int = 0  # pages promised under the 'reserve' policy but not taken yet
    num_preemptions: int = 0
    page_hashes: list[bytes] = field(default_factory=list)  # names of its first full pages (prefix caching)
    num_committed_pages: int = 0  # pages of block_table named in the allocator's index so far
    cached_tokens: int | None = None  # prompt tokens found in the prefix cache at first admission
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    finish_reason: str | None = None
    error: tuple[str, str] | None = None  # (code, message) when rejected
    detok: object | None = None  # worker.detokenizer.IncrementalDetokenizer when a tokenizer is set
    index: int = 0  # which of the request's n choices this is
    prompt_logprobs: list | None = None  # worker.logprobs.TokenLogprob of prompt tokens 1.. so far
    grammar: object | None = None  # worker.structured.GrammarState for structured output

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def order(self) -> tuple[int, int]:
        """Urgency order: priority first, then arrival. Smaller is more urgent."""
        return (self.priority, self.arrival)
