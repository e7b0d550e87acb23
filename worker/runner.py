"""The model runner: turns the scheduler's batch into one packed forward pass.

All scheduled tokens go into one row (``[1, T]``): decodes first, then prefill chunks, no
padding. Positions, cache slots and decode page lists are built with tensor ops from the
sequences' block tables; only sequences (never tokens) are looped over in Python.
"""

from __future__ import annotations

import torch

from worker.attention import StepMeta
from worker.cache import KVCache
from worker.scheduler import ScheduledSeq, SchedulerOutput


class ModelRunner:
    def __init__(self, model: torch.nn.Module, cache: KVCache):
        self.model = model
        self.cache = cache
        self.device = cache.k.device
        self.page_size = cache.page_size

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> tuple[torch.Tensor, list[ScheduledSeq]]:
        """Run the step; returns logits ``[S, vocab]`` for the sequences that sample, in that order."""
        if out.swap_out[0]:
            self.cache.swap_out(*out.swap_out)
        if out.swap_in[0]:
            self.cache.swap_in(*out.swap_in)
        batch = sorted(out.scheduled, key=lambda s: s.num_tokens > 1)  # decodes first (stable)
        if not batch:
            return torch.empty(0, 0), []
        meta, input_ids, positions, sample_rows = self._prepare(batch)
        logits = self.model(
            input_ids=input_ids[None],
            position_ids=positions[None],
            use_cache=False,
            logits_to_keep=sample_rows,
            tokenq=meta,
        ).logits[0]
        return logits, [s for s in batch if s.sample]

    def _prepare(self, batch: list[ScheduledSeq]):
        dev, ps = self.device, self.page_size
        ids: list[int] = []
        for s in batch:
            ids.extend(s.seq.token_ids[s.start:s.start + s.num_tokens])
        lens = torch.tensor([s.num_tokens for s in batch])
        starts = torch.tensor([s.start for s in batch])
        ends = torch.cumsum(lens, 0)
        T = int(ends[-1])
        # position of every token: its sequence's start + its index within the chunk
        seq_of_tok = torch.repeat_interleave(torch.arange(len(batch)), lens)
        positions = torch.arange(T) - torch.repeat_interleave(ends - lens - starts, lens)
        max_pages = max(len(s.seq.block_table) for s in batch)
        tables = torch.tensor([s.seq.block_table + [0] * (max_pages - len(s.seq.block_table)) for s in batch])
        write_pages = tables[seq_of_tok, positions // ps]
        write_offs = positions % ps

        n_dec = next((i for i, s in enumerate(batch) if s.num_tokens > 1), len(batch))
        dec_num_pages = max((len(s.seq.block_table) for s in batch[:n_dec]), default=0)
        dec_pages = tables[:n_dec, :dec_num_pages].reshape(-1)
        dec_ctx = starts[:n_dec] + 1
        prefills = []
        for i in range(n_dec, len(batch)):
            s = batch[i]
            a, b = int(ends[i]) - s.num_tokens, int(ends[i])
            pages = torch.tensor(s.seq.block_table, device=dev) if s.start else None
            prefills.append((a, b, s.start, pages))
        sample_rows = (ends - 1)[torch.tensor([s.sample for s in batch], dtype=torch.bool)]
        meta = StepMeta(
            self.cache.k,
            self.cache.v,
            write_pages.to(dev),
            write_offs.to(dev),
            n_dec,
            dec_pages.to(dev),
            dec_num_pages,
            dec_ctx.to(dev),
            prefills,
        )
        return meta, torch.tensor(ids, device=dev), positions.to(dev), sample_rows.to(dev)
