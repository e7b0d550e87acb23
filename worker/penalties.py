"""Logit adjustments before sampling, vectorised over the rows that ask for them.

In vLLM's order: logit_bias, min_tokens (EOS and stop tokens masked), then the repetition
penalty (transformers' and vLLM's: over prompt and output tokens, a positive logit divided by
it, a negative one multiplied), then frequency and presence penalties (OpenAI's: over output
tokens, ``logit -= frequency * count + presence * (count > 0)``).

Counts come from ``Sequence.token_ids`` split at ``num_prompt_tokens``, which preemption and
resumption never move: a recomputed sequence penalises exactly the tokens it did before.
"""

from __future__ import annotations

import array

import torch

from worker.sequence import Sequence


def _ints(values) -> torch.Tensor:
    return torch.frombuffer(array.array("q", values), dtype=torch.int64) if values else torch.zeros(0, dtype=torch.int64)


def needed(seqs: list[Sequence]) -> bool:
    return any(_active(s) for s in seqs)


def _active(s: Sequence) -> bool:
    p = s.params
    return bool(p.logit_bias or p.min_tokens > s.num_output_tokens or p.repetition_penalty != 1.0
                or p.presence_penalty or p.frequency_penalty)


def apply(logits: torch.Tensor, seqs: list[Sequence], stop_ids: set[int]) -> torch.Tensor:
    """``logits`` [S, vocab] adjusted in place for ``seqs`` (same order); returns it."""
    vocab = logits.shape[-1]
    _bias(logits, seqs, stop_ids, vocab)
    rep = [i for i, s in enumerate(seqs) if s.params.repetition_penalty != 1.0]
    if rep:
        seen = _presence(logits, [seqs[i].token_ids for i in rep], vocab) > 0
        pen = logits.new_tensor([seqs[i].params.repetition_penalty for i in rep])[:, None]
        x = logits[rep]
        logits[rep] = torch.where(seen, torch.where(x > 0, x / pen, x * pen), x)
    freq = [i for i, s in enumerate(seqs) if s.params.presence_penalty or s.params.frequency_penalty]
    if freq:
        counts = _presence(logits, [seqs[i].output_ids for i in freq], vocab)
        f = logits.new_tensor([seqs[i].params.frequency_penalty for i in freq])[:, None]
        p = logits.new_tensor([seqs[i].params.presence_penalty for i in freq])[:, None]
        logits[freq] -= f * counts + p * (counts > 0)
    return logits


def _bias(logits: torch.Tensor, seqs: list[Sequence], stop_ids: set[int], vocab: int) -> None:
    """logit_bias (added) and min_tokens (stop tokens to -inf) as one sparse update each."""
    rows, toks, vals, ban_r, ban_t = [], [], [], [], []
    for i, s in enumerate(seqs):
        p = s.params
        for t, b in p.logit_bias.items():
            if t < vocab:
                rows.append(i)
                toks.append(t)
                vals.append(b)
        if p.min_tokens > s.num_output_tokens:
            stops = set(p.stop_token_ids) | (set() if p.ignore_eos else stop_ids)
            ban = [t for t in stops if t < vocab]
            ban_r += [i] * len(ban)
            ban_t += ban
    dev = logits.device
    if rows:
        logits.index_put_((_ints(rows).to(dev), _ints(toks).to(dev)), logits.new_tensor(vals), accumulate=True)
    if ban_r:
        logits[_ints(ban_r).to(dev), _ints(ban_t).to(dev)] = float("-inf")


def _presence(logits: torch.Tensor, ids: list[list[int]], vocab: int) -> torch.Tensor:
    """[len(ids), vocab] token counts (in the logits' dtype), built with one scatter."""
    lens = _ints([len(x) for x in ids])
    flat = _ints([t for x in ids for t in x]).to(logits.device)
    row = torch.repeat_interleave(torch.arange(len(ids)), lens).to(logits.device)
    counts = torch.zeros(len(ids), vocab, dtype=logits.dtype, device=logits.device)
    return counts.index_put_((row, flat), torch.ones_like(flat, dtype=logits.dtype), accumulate=True)
