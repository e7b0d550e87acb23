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
    """``logits`` [S, vocab] adjusted in place for ``seqs`` (same order); returns it. Sparse:
    only the (row, token) cells of tokens a sequence holds are read and written."""
    vocab = logits.shape[-1]
    _bias(logits, seqs, stop_ids, vocab)
    rep = [i for i, s in enumerate(seqs) if s.params.repetition_penalty != 1.0]
    if rep:
        cells, _ = _cells(logits, rep, [seqs[i].token_ids for i in rep], vocab)
        r, t = cells // vocab, cells % vocab
        pen = logits.new_tensor([s.params.repetition_penalty for s in seqs])[r]
        x = logits[r, t]
        logits[r, t] = torch.where(x > 0, x / pen, x * pen)
    freq = [i for i, s in enumerate(seqs) if s.params.presence_penalty or s.params.frequency_penalty]
    if freq:
        cells, counts = _cells(logits, freq, [seqs[i].output_ids for i in freq], vocab)
        r, t = cells // vocab, cells % vocab
        f = logits.new_tensor([s.params.frequency_penalty for s in seqs])[r]
        p = logits.new_tensor([s.params.presence_penalty for s in seqs])[r]
        logits[r, t] -= f * counts.to(logits.dtype) + p
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


def _cells(logits: torch.Tensor, rows: list[int], ids: list[list[int]], vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The distinct (row, token) cells of ``ids`` (``ids[k]`` belongs to logits row ``rows[k]``),
    as ``row * vocab + token``, and how often each occurs."""
    lens = _ints([len(x) for x in ids])
    flat = _ints([t for x in ids for t in x])
    row = torch.repeat_interleave(_ints(rows), lens)
    cells, counts = torch.unique(row * vocab + flat, return_counts=True)
    return cells.to(logits.device), counts.to(logits.device)
