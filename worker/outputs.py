"""What the engine hands back: a request's outputs and metrics, its own stats, and the budget
the service pulls by. Plain records, no behaviour (the engine fills them)."""

from __future__ import annotations

from dataclasses import dataclass, field

from worker import logprobs


@dataclass
class RequestMetrics:
    """Monotonic timestamps (time.monotonic seconds) of a request's life in the engine."""

    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    finished_time: float | None
    num_preemptions: int


@dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    seq: int = 0  # output index of new_token_ids[0] (resumed tokens count)
    text: str = ""  # decoded text delta, when the engine has a tokenizer
    finished: bool = False
    finish_reason: str | None = None  # stop, length, cancelled, timeout, error
    error: tuple[str, str] | None = None  # (code, message) when finish_reason == "error"
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0  # all choices together
    cached_tokens: int = 0  # prompt tokens found in the prefix cache (not computed) when it was admitted
    metrics: RequestMetrics | None = None  # set on the final output
    index: int = 0  # the choice (of n) these tokens belong to
    choice_finish_reason: str | None = None  # set when this output ends its choice
    finish_reasons: list[str | None] | None = None  # per choice, on the final output
    logprobs: list[logprobs.TokenLogprob] | None = None  # one per new token, when asked for
    prompt_logprobs: list[logprobs.TokenLogprob] | None = None  # with a choice's first token (the first: logprob None)


@dataclass
class EngineStats:
    num_steps: int = 0
    num_preemptions: int = 0
    num_free_pages: int = 0
    num_total_pages: int = 0
    num_running: int = 0
    num_waiting: int = 0
    num_prompt_tokens: int = 0  # tokens computed by prefills (recomputation included)
    num_generated_tokens: int = 0
    last_step_s: float = 0.0
    last_batch_tokens: int = 0
    admissions: dict[str, int] = field(default_factory=dict)
    prefix_cache_queries: int = 0  # tokens of admitted sequences looked up in the prefix cache
    prefix_cache_hits: int = 0  # of those, tokens found cached (not computed)

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0

    @property
    def kv_cache_usage(self) -> float:
        return 1.0 - self.num_free_pages / self.num_total_pages if self.num_total_pages else 0.0


@dataclass
class Budget:
    """What the engine can still take: the service pulls no more than this from Redis."""

    free_tokens: int  # cache tokens not used, promised, or wanted by waiting requests
    free_seqs: int  # sequence slots not taken by running or waiting requests
