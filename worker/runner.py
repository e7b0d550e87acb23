"""The model runner: turns the scheduler's batch into one packed forward pass.

All scheduled tokens go into one row (``[1, T]``): decodes first, then prefill chunks, no
padding. Positions, cache slots and decode page lists are built with tensor ops from the
sequences' block tables; only sequences (never tokens) are looped over in Python.
"""

from __future__ import annotations

import array
import itertools

import torch

from worker import shared_pages
from worker.attention import StepMeta
from worker.cache import KVCache
from worker.logprobs import prompt_span
from worker.scheduler import ScheduledSeq, SchedulerOutput

# Decode attention reads the pool's pages [lo, hi) in place (lo and hi: the lowest and highest
# page a decode holds, + 1) while that span is at most this many times the decoding sequences'
# own pages; past that it gathers their pages (a copy costs about two extra passes over the
# data, computing and masking a foreign page one).
IN_PLACE_FACTOR = 2.0


def _ints(values: list[int]) -> torch.Tensor:
    """A CPU int64 tensor from a list of ints (8x faster than torch.tensor(list) for long lists)."""
    return torch.frombuffer(array.array("q", values), dtype=torch.int64) if values else torch.zeros(0, dtype=torch.int64)


class ModelRunner:
    def __init__(self, model: torch.nn.Module, cache: KVCache):
        self.model = model
        self.cache = cache
        self.device = cache.k.device
        self.page_size = cache.page_size

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> tuple[torch.Tensor, list[ScheduledSeq], list[tuple[ScheduledSeq, int, torch.Tensor]]]:
        """Run the step; returns logits ``[S, vocab]`` for the sequences that sample, in that order,
        and (scheduled seq, first position, logits) of the prompt positions that want logprobs."""
        if out.swap_out[0]:
            self.cache.swap_out(*out.swap_out)
        if out.new_pages:
            # A reused page still holds its last owner's K/V. Masked slots get zero weight, but
            # a non-finite leftover (an fp16 overflow) would still turn 0 * inf into NaN.
            self.cache.clear(out.new_pages)
        if out.swap_in[0]:
            self.cache.swap_in(*out.swap_in)
        batch = sorted(out.scheduled, key=lambda s: s.num_tokens > 1)  # decodes first (stable)
        if not batch:
            return torch.empty(0, 0), [], []
        meta, input_ids, positions, sample_rows = self._prepare(batch)
        extra, spans = self._prompt_rows(batch)
        keep = torch.cat([sample_rows, _ints(extra).to(self.device)]) if extra else sample_rows
        logits = self.model(
            input_ids=input_ids[None],
            position_ids=positions[None],
            use_cache=False,
            logits_to_keep=keep,
            tokenq=meta,
        ).logits[0]
        n = len(sample_rows)
        prompt = [(s, lo, logits[n + r:n + r + c]) for s, lo, r, c in spans]
        return logits[:n], [s for s in batch if s.sample], prompt

    @staticmethod
    def _prompt_rows(batch: list[ScheduledSeq]):
        """Rows (in the packed batch) of prompt positions whose logprobs are wanted, and per
        sequence (scheduled seq, first position, first of its rows among them, count)."""
        rows: list[int] = []
        spans = []
        a = 0
        for s in batch:
            lo, hi = prompt_span(s.seq, s.start, s.num_tokens)
            if hi > lo:
                spans.append((s, lo, len(rows), hi - lo))
                rows.extend(range(a + lo - s.start, a + hi - s.start))
            a += s.num_tokens
        return rows, spans

    def _prepare(self, batch: list[ScheduledSeq]):
        dev, ps = self.device, self.page_size
        n_dec = next((i for i, s in enumerate(batch) if s.num_tokens > 1), len(batch))
        decodes, chunks = batch[:n_dec], batch[n_dec:]
        # decodes: one token each, written at (its page for position start, start % page_size)
        ids = [s.seq.token_ids[s.start] for s in decodes]
        dec_starts = [s.start for s in decodes]
        wp = [_ints([s.seq.block_table[s.start // ps] for s in decodes])]
        for s in chunks:
            ids.extend(s.seq.token_ids[s.start:s.start + s.num_tokens])
        lens = _ints([1] * n_dec + [s.num_tokens for s in chunks])
        starts = _ints(dec_starts + [s.start for s in chunks])
        ends = torch.cumsum(lens, 0)
        T = len(ids)
        # position of every token: its sequence's start + its index within the chunk
        positions = torch.arange(T) - torch.repeat_interleave(ends - lens - starts, lens)
        # prefill chunks: the pages their positions fall in (vectorised per chunk)
        a = n_dec
        for s in chunks:
            first = s.start // ps
            pages = _ints(s.seq.block_table[first:(s.start + s.num_tokens - 1) // ps + 1])
            wp.append(pages[positions[a:a + s.num_tokens] // ps - first])
            a += s.num_tokens
        write_pages = torch.cat(wp)
        write_offs = positions % ps

        dec = self._decode_pages(decodes, starts[:n_dec] + 1)
        prefills = []
        a = n_dec
        for s in chunks:
            pages = _ints(s.seq.block_table).to(dev) if s.start else None
            prefills.append((a, a + s.num_tokens, s.start, pages))
            a += s.num_tokens
        sample_rows = (ends - 1)[torch.tensor([s.sample for s in batch], dtype=torch.bool)]
        meta = StepMeta(self.cache.k, self.cache.v, write_pages.to(dev), write_offs.to(dev), n_dec, *dec[:5], prefills, dec[5])
        return meta, _ints(ids).to(dev), positions.to(dev), sample_rows.to(dev)

    def _decode_pages(self, decodes: list[ScheduledSeq], ctx: torch.Tensor):
        """The decode pages of the step (see StepMeta): (src, span, acc, pos, ctx per page, shared groups).

        In place over the pool's pages ``span = (lo, hi)`` when they are at most
        ``IN_PLACE_FACTOR`` times the decodes' own pages (the pages there outside any decode
        are computed and masked, which costs less than copying); else the decodes' pages,
        gathered. The span starts at the lowest page a decode holds, not at page 0: with
        prefix caching on, the pages of finished sequences stay cached below the live ones
        (an allocation takes never-cached pages first), and reading them would cost what
        caching saves when nothing hits."""
        dev, ps = self.device, self.page_size
        n = len(decodes)
        if not n:
            z = torch.zeros(0, dtype=torch.long, device=dev)
            return None, (0, 0), z, z.view(0, ps), z, []
        flat_list = list(itertools.chain.from_iterable(s.seq.block_table for s in decodes))
        counts = _ints([len(s.seq.block_table) for s in decodes])
        flat = _ints(flat_list)
        acc = torch.repeat_interleave(torch.arange(n), counts)
        rank = torch.arange(len(flat_list)) - torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)
        shared = []
        if len(set(flat_list)) != len(flat_list):  # pages several decodes hold (a cached prefix): read once for all
            keep, shared = shared_pages.split(flat, acc, rank, ctx, n, ps, dev)
            flat, acc, rank = flat[keep], acc[keep], rank[keep]
            flat_list = flat.tolist()
        lo, hi = min(flat_list, default=0), max(flat_list, default=-1) + 1
        span = (lo, max(lo, hi))
        if hi - lo <= IN_PLACE_FACTOR * len(flat_list):
            src = None
            acc_r = torch.full((span[1] - lo,), n, dtype=torch.long)
            acc_r[flat - lo] = acc
            rank_r = torch.zeros(span[1] - lo, dtype=torch.long)
            rank_r[flat - lo] = rank
            acc, rank = acc_r, rank_r
        else:
            src = flat.to(dev)
        pos = rank[:, None] * ps + torch.arange(ps)[None, :]
        ctx_p = torch.cat([ctx, ctx.new_zeros(1)])[acc]
        return src, span, acc.to(dev), pos.to(dev), ctx_p.to(dev), shared
