"""The model runner: turns the scheduler's batch into one packed forward pass.

All scheduled tokens go into one row (``[1, T]``): decodes first, then prefill chunks, no
padding. Positions, cache slots and decode page lists are built with tensor ops from the
sequences' block tables; only sequences (never tokens) are looped over in Python.
"""

from __future__ import annotations

import array
import itertools

import torch

from worker import gpu_attention, sampler, shared_pages
from worker.attention import StepMeta
from worker.cache import KVCache
from worker.logprobs import prompt_span
from worker.scheduler import ScheduledSeq, SchedulerOutput

# Decode attention reads the pool in place, over a few spans of pages that cover the decoding
# sequences' own pages (the pages in between are computed and masked), while the spans are at
# most this many times those pages; past that it gathers their pages (a copy costs about two
# extra passes over the data, computing and masking a foreign page one).
IN_PLACE_FACTOR = 2.0
# The spans: split at the largest gaps between the decodes' pages, at most MAX_SPANS of them
# (each costs two more small products per layer, some 20-30 us), and only at gaps of MIN_GAP
# pages or more (reading 16 pages of SmolLM2's K and V takes about that long).
# With prefix caching on, finished sequences' pages stay cached between the live ones, so
# one span from the lowest to the highest live page grows until the step has to gather.
MAX_SPANS = 8
MIN_GAP = 16


def spans(pages: torch.Tensor) -> list[tuple[int, int]]:
    """Spans [lo, hi) of the pool that cover ``pages`` (distinct page numbers), in ascending order."""
    if not len(pages):
        return []
    t = torch.sort(torch.as_tensor(pages)).values
    gap = t[1:] - t[:-1] - 1
    cut = (gap >= MIN_GAP).nonzero().squeeze(1)  # a span ends at t[i] and the next starts at t[i + 1]
    if len(cut) > MAX_SPANS - 1:
        cut = torch.sort(cut[gap[cut].topk(MAX_SPANS - 1).indices]).values
    lo = torch.cat([t[:1], t[cut + 1]])
    hi = torch.cat([t[cut], t[-1:]]) + 1
    return list(zip(lo.tolist(), hi.tolist()))


def _ints(values: list[int]) -> torch.Tensor:
    """A CPU int64 tensor from a list of ints (8x faster than torch.tensor(list) for long lists)."""
    return torch.frombuffer(array.array("q", values), dtype=torch.int64) if values else torch.zeros(0, dtype=torch.int64)


class ModelRunner:
    def __init__(self, model: torch.nn.Module, cache: KVCache, native_decode: bool = False,
                 native_prefill: bool = False, compiled=None, gpu_attention: bool = False):
        self.model = model
        # the compiled forward (worker/compiled.py) when there is one; else the model is called
        self.compiled = compiled
        self.cache = cache
        self.device = cache.k.device
        self.page_size = cache.page_size
        # decode attention through the native kernel (worker/native.py) rather than torch ops
        self.native_decode = native_decode
        # prefill chunks through the native prefill kernel rather than SDPA
        self.native_prefill = native_prefill
        # decodes and prefill chunks through the GPU kernels (worker/gpu_attention.py), not torch ops
        self.gpu_attention = gpu_attention
        # decode-only steps replayed as CUDA graphs (worker/cuda_graphs.py), set by the engine
        self.graphs = None

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> tuple[torch.Tensor, list[ScheduledSeq], list[tuple[ScheduledSeq, int, torch.Tensor]]]:
        """Run the step; returns logits ``[S, vocab]`` for the sequences that sample, in that order,
        and (scheduled seq, first position, logits) of the prompt positions that want logprobs.
        Where every sequence that samples is plain greedy and the compiled forward screens its
        head (worker/screened_head.py), their picks ``[S]`` (int64) come instead of the logits."""
        if out.swap_out[0]:
            self.cache.swap_out(*out.swap_out)
        if out.new_pages and not (self.native_decode or self.gpu_attention):
            # A reused page still holds its last owner's K/V. Masked slots get zero weight, but
            # a non-finite leftover (an fp16 overflow) would still turn 0 * inf into NaN in the
            # torch decode path's products over whole pages. The native and GPU kernels read no
            # slot past a sequence's context (tests/test_native.py, tests/test_gpu_attention.py),
            # nor do the prefill paths (they cut gathered pages at it), so with them the pages
            # stay as they are: zeroing them took 6 ms of a 2,048-token SmolLM2 bf16 step.
            self.cache.clear(out.new_pages)
        if out.swap_in[0]:
            self.cache.swap_in(*out.swap_in)
        batch = sorted(out.scheduled, key=lambda s: s.num_tokens > 1)  # decodes first (stable)
        if not batch:
            return torch.empty(0, 0), [], []
        extra, spans = self._prompt_rows(batch)
        if self.graphs is not None and not extra and self.graphs.fits(batch):
            h = self.graphs.run(batch)
            sampled = [s for s in batch if s.sample]
            if len(sampled) < len(batch):  # a one-token chunk short of its prompt's end samples nothing
                h = h.index_select(0, torch.tensor([i for i, s in enumerate(batch) if s.sample], device=self.device))
            return self.graphs.fwd.head(h), sampled, []
        meta, input_ids, positions, sample_rows = self._prepare(batch)
        keep = torch.cat([sample_rows, _ints(extra).to(self.device)]) if extra else sample_rows
        sampled = [s for s in batch if s.sample]
        if self.native_decode and self.compiled is not None and self.compiled.screened is not None and sampled \
                and not extra and sampler.plain_greedy([s.seq for s in sampled]):
            return self.compiled.picks(input_ids, positions, keep, meta), sampled, []
        if self.compiled is not None:
            logits = self.compiled(input_ids, positions, keep, meta)
        else:
            logits = self.model(
                input_ids=input_ids[None],
                position_ids=positions[None],
                use_cache=False,
                logits_to_keep=keep,
                tokenq=meta,
            ).logits[0]
        n = len(sample_rows)
        prompt = [(s, lo, logits[n + r:n + r + c]) for s, lo, r, c in spans]
        return logits[:n], sampled, prompt

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

        tables = gpu = None
        if self.native_decode:
            dec, tables = self._decode_pages([], None), self._decode_tables(decodes, starts[:n_dec] + 1)
        elif self.gpu_attention:
            dec, gpu = self._decode_pages([], None), self._gpu_tables(decodes, dev)
        else:
            dec = self._decode_pages(decodes, starts[:n_dec] + 1)
        prefills = []
        a = n_dec
        for s in chunks:
            pages = _ints(s.seq.block_table).to(dev) if s.start and not (self.native_prefill or self.gpu_attention) else None
            prefills.append((a, a + s.num_tokens, s.start, pages))
            a += s.num_tokens
        pre_tables = self._prefill_tables(chunks) if self.native_prefill and chunks else None
        pre_gpu = self._gpu_prefill_tables(chunks, dev) if self.gpu_attention and chunks else None
        sample_rows = (ends - 1)[torch.tensor([s.sample for s in batch], dtype=torch.bool)]
        meta = StepMeta(self.cache.k, self.cache.v, write_pages.to(dev), write_offs.to(dev), n_dec, *dec[:5], prefills, dec[5],
                        tables, pre_tables, gpu, pre_gpu)
        return meta, _ints(ids).to(dev), positions.to(dev), sample_rows.to(dev)

    def _decode_tables(self, decodes: list[ScheduledSeq], ctx: torch.Tensor):
        """The native kernel's view of the decodes: their block tables one after the other,
        where each starts ([n + 1]), and the slots each attends ([n])."""
        tables = [s.seq.block_table for s in decodes]
        offsets = _ints([0, *itertools.accumulate(map(len, tables))])
        return _ints(list(itertools.chain.from_iterable(tables))), offsets, ctx

    @staticmethod
    def _padded(tables: list[list[int]], width: int | None = None, rows: int | None = None, pad: int = 0) -> torch.Tensor:
        """Block tables as one int32 [rows, width] tensor, padded with ``pad`` (by default as many
        rows as tables, as wide as the longest)."""
        n = len(tables)
        counts = [len(t) for t in tables]
        out = torch.full((rows or n, width or max(counts, default=1)), pad, dtype=torch.int32)
        if n:
            c = _ints(counts)
            row = torch.repeat_interleave(torch.arange(n), c)
            col = torch.arange(len(row)) - torch.repeat_interleave(torch.cumsum(c, 0) - c, c)
            out[row, col] = _ints(list(itertools.chain.from_iterable(tables))).to(torch.int32)
        return out

    @classmethod
    def _gpu_tables(cls, decodes: list[ScheduledSeq], dev, width: int | None = None, rows: int | None = None, pad: int = 0):
        """The GPU decode kernel's view of the decodes: block tables [rows, width] (see _padded) and
        the slots each attends [rows] (padding rows: 1), on ``dev``."""
        tables = cls._padded([s.seq.block_table for s in decodes], width, rows, pad)
        ctx = torch.ones(tables.shape[0], dtype=torch.int32)
        ctx[:len(decodes)] = _ints([s.start + 1 for s in decodes]).to(torch.int32)
        return tables.to(dev), ctx.to(dev)

    @classmethod
    def _gpu_prefill_tables(cls, chunks: list[ScheduledSeq], dev):
        """The GPU prefill kernel's view of the chunks: block tables, each one's cached prefix,
        length and first row among the step's prefill rows, and the kernel's (chunk, block) grid."""
        lens = [s.num_tokens for s in chunks]
        per_chunk = torch.tensor([[s.start for s in chunks], lens, list(itertools.accumulate([0] + lens[:-1]))],
                                 dtype=torch.int32).to(dev)
        work = torch.tensor(gpu_attention.work(lens), dtype=torch.int32).to(dev)
        return cls._padded([s.seq.block_table for s in chunks]).to(dev), *per_chunk, work

    @staticmethod
    def _prefill_tables(chunks: list[ScheduledSeq]):
        """The native prefill kernel's view of the chunks: the pages each one's slots lie in (up
        to its last position) one after the other, where each starts, its cached prefix, its length."""
        tables = [s.seq.block_table for s in chunks]
        offsets = _ints([0, *itertools.accumulate(map(len, tables))])
        return (_ints(list(itertools.chain.from_iterable(tables))), offsets, _ints([s.start for s in chunks]),
                _ints([s.num_tokens for s in chunks]))

    def _decode_pages(self, decodes: list[ScheduledSeq], ctx: torch.Tensor):
        """The decode pages of the step (see StepMeta): (src, spans, acc, pos, ctx per page, shared groups).

        In place over a few spans of the pool (``spans``, see MAX_SPANS) when they are at most
        ``IN_PLACE_FACTOR`` times the decodes' own pages (the pages there outside any decode
        are computed and masked, which costs less than copying); else the decodes' pages,
        gathered (``src``). With prefix caching on, the pages of finished sequences stay
        cached between and below the live ones (an allocation takes never-cached pages first),
        and reading them would cost what caching saves when nothing hits: the spans skip the
        largest runs of them."""
        dev, ps = self.device, self.page_size
        n = len(decodes)
        if not n:
            z = torch.zeros(0, dtype=torch.long, device=dev)
            return None, [], z, z.view(0, ps), z, []
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
        cover = spans(flat)
        read = sum(hi - lo for lo, hi in cover)
        if read <= IN_PLACE_FACTOR * len(flat_list):
            src = None
            # decode page list = the spans' pages one after the other: page p of span i at
            # first[i] + p - lo[i]
            lo = _ints([a for a, _ in cover])
            length = _ints([b - a for a, b in cover])
            first = torch.cumsum(length, 0) - length
            span_of = torch.searchsorted(lo, flat, right=True) - 1
            at = first[span_of] + flat - lo[span_of]
            acc_r = torch.full((read,), n, dtype=torch.long)
            acc_r[at] = acc
            rank_r = torch.zeros(read, dtype=torch.long)
            rank_r[at] = rank
            acc, rank = acc_r, rank_r
        else:
            src, cover = flat.to(dev), []
        pos = rank[:, None] * ps + torch.arange(ps)[None, :]
        ctx_p = torch.cat([ctx, ctx.new_zeros(1)])[acc]
        return src, cover, acc.to(dev), pos.to(dev), ctx_p.to(dev), shared
