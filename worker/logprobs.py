"""Log-probabilities of chosen tokens and their top-N alternatives, for the whole batch at once.

They are the model's own distribution: log-softmax of the raw logits, before penalties,
bias, grammar masks, temperature and top-k/top-p (what vLLM returns by default), in at least
float32 (float64 when the model runs in float64).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch


@dataclass
class TokenLogprob:
    id: int
    logprob: float | None  # None only for a prompt's first token
    top: list[tuple[int, float]] = field(default_factory=list)  # the N most likely, best first

    def wire(self, text=None) -> dict:
        """The protocol form (common/outputs.py); ``text(id)`` adds token strings."""
        d: dict = {"id": self.id, "logprob": self.logprob}
        if text is not None:
            d["token"] = text(self.id)
        d["top"] = [{"id": i, "token": text(i), "logprob": lp} if text else {"id": i, "logprob": lp} for i, lp in self.top]
        return d


def log_softmax(logits: torch.Tensor) -> torch.Tensor:
    x = logits if logits.dtype == torch.float64 else logits.float()
    return torch.log_softmax(x, dim=-1)


def gather(lsm: torch.Tensor, chosen: torch.Tensor, top_n: list[int]) -> list[TokenLogprob]:
    """Row i: the logprob of ``chosen[i]`` and the ``top_n[i]`` most likely tokens."""
    if not top_n:
        return []
    picked = lsm.gather(1, chosen[:, None])[:, 0].tolist()
    k = max(top_n)
    if k:
        vals, idx = lsm.topk(k, dim=-1)
        vals, idx = vals.tolist(), idx.tolist()
    ids = chosen.tolist()
    return [TokenLogprob(ids[r], picked[r], list(zip(idx[r][:n], vals[r][:n])) if n else []) for r, n in enumerate(top_n)]


def prompt_span(seq, start: int, num_tokens: int) -> tuple[int, int]:
    """Positions [lo, hi) of a step's chunk whose logits score prompt tokens lo+1..hi. Only
    positions not scored yet: a preempted sequence recomputing its prompt scores nothing twice,
    and one with output tokens (published with the first of them, or resumed) nothing at all."""
    if seq.params.prompt_logprobs is None or seq.num_output_tokens or seq.index:  # n > 1: choice 0 scores it
        return 0, 0
    lo = max(start, len(seq.prompt_logprobs or ()))
    return lo, min(start + num_tokens, seq.num_prompt_tokens - 1)


def token_texts(tokenizer):
    """id -> the token's own text (cached: the same few thousand ids come back every step)."""
    return functools.lru_cache(maxsize=65536)(lambda i: tokenizer.decode([i]))
