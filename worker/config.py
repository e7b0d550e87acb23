"""Engine configuration: the few numbers that size the cache and the batch."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EngineConfig:
    page_size: int = 16  # tokens per KV-cache page
    num_pages: int | None = None  # None: derive from kv_cache_memory
    kv_cache_memory: float = 1.0  # GiB, when num_pages is None
    max_num_seqs: int = 64  # most sequences in one step
    max_num_batched_tokens: int = 2048  # most tokens in one step (decodes + prefill chunks)
    max_model_len: int | None = None  # None: the model's own limit, capped by the cache
    admission_policy: str = "optimistic"  # or "reserve"
    preemption_mode: str = "recompute"  # or "swap"
    soft_limit: float = 0.9  # cache share above which only the most urgent level is admitted
    watermark: float = 0.01  # optimistic admission keeps this share of pages free for growth
    swap_pages: int | None = None  # host pool for swap preemption (None: as many as the device pool)
    enable_prefix_caching: bool = True  # share full prompt pages across requests (worker/prefix_cache.py)
    device: str | None = None  # None: the model's device
    check_invariants: bool = True  # assert the scheduler's invariants after every schedule()
    fast_path: bool = True  # merged, prepacked linears (worker/fastpath.py); eager where it cannot apply

    def __post_init__(self) -> None:
        if self.admission_policy not in ("optimistic", "reserve"):
            raise ValueError("admission_policy must be 'optimistic' or 'reserve'")
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValueError("preemption_mode must be 'recompute' or 'swap'")
        if self.page_size < 1 or self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("page_size, max_num_seqs and max_num_batched_tokens must be >= 1")
        if not 0 < self.soft_limit <= 1:
            raise ValueError("soft_limit must be in (0, 1]")
