"""Admission control: may this waiting request enter the batch now?

One decision per waiting request, judged in tokens (pages), not in request counts:

* REJECT: it can never run here (prompt + max_tokens beyond ``max_model_len``, which is
  never more than the whole cache). Rejecting at once keeps an impossible request from
  wedging the head of the queue forever.
* DEFER: it could run, but not now: its pages are not free, or it is not of the most
  urgent level and would push cache use past the soft limit (headroom kept for urgent work).
* ADMIT: otherwise.

Policies: ``optimistic`` asks for the pages of the tokens it has (prompt, plus output
kept across a preemption) and a small watermark, grows on demand and may be preempted
later; ``reserve`` asks for prompt + max_tokens up front and is never preempted.

With prefix caching, pages of its prefix that running sequences hold already cost nothing
(``held``): it shares them. Cached pages nobody holds count as free, so taking one costs
a page like any other.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from common.errors import TOO_LONG
from worker.cache import BlockAllocator, pages_for
from worker.config import EngineConfig
from worker.sequence import Sequence


class Decision(enum.Enum):
    ADMIT = "admit"
    DEFER = "defer"
    REJECT = "reject"


@dataclass(frozen=True)
class Verdict:
    decision: Decision
    reason: str = ""
    code: str | None = None  # the error code for REJECT


ADMIT = Verdict(Decision.ADMIT)


def pages_to_admit(seq: Sequence, cfg: EngineConfig, page_size: int, held: int = 0) -> int:
    """Pages the sequence must be given (or promised) to be admitted, ``held`` of its prefix
    pages being shared with running sequences."""
    if cfg.admission_policy == "reserve":
        return pages_for(seq.num_prompt_tokens + seq.params.max_tokens, page_size) - held
    return pages_for(seq.num_tokens, page_size) - held


def decide(seq: Sequence, alloc: BlockAllocator, cfg: EngineConfig, max_model_len: int, num_running: int,
           held: int = 0) -> Verdict:
    total = seq.num_prompt_tokens + seq.params.max_tokens
    if total > max_model_len:
        return Verdict(
            Decision.REJECT,
            f"prompt ({seq.num_prompt_tokens} tokens) + max_tokens ({seq.params.max_tokens}) = {total} "
            f"exceeds the limit of {max_model_len} tokens (model length and KV cache)",
            TOO_LONG,
        )
    need = pages_to_admit(seq, cfg, alloc.page_size, held)
    # An empty engine admits whatever can fit at all: headroom rules must never stall progress.
    if num_running == 0:
        return ADMIT if need <= alloc.num_available else Verdict(Decision.DEFER, "pages not free")
    headroom = int(cfg.watermark * alloc.num_pages) if cfg.admission_policy == "optimistic" else 0
    if need + headroom > alloc.num_available:
        return Verdict(Decision.DEFER, f"needs {need} pages (+{headroom} watermark), {alloc.num_available} free")
    if seq.priority > 0 and alloc.num_used + alloc.reserved + need > cfg.soft_limit * alloc.num_pages:
        return Verdict(Decision.DEFER, f"would pass the soft limit of {cfg.soft_limit:.0%} of the cache")
    return ADMIT
