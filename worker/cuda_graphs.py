"""Decode steps as CUDA graphs: the compiled decoder captured once per batch size, replayed.

A decode step of n sequences launches the same few hundred kernels every time (SmolLM2: 30
layers of GEMMs, fused elementwise loops and the attention kernel); on a GPU, launching them
from Python costs more than running them at small batches. Each step is therefore padded up
to the next of a few sizes (``sizes``: 2, 4, 8, then every multiple of 8, as vLLM does), and
each size's whole decoder, the attention kernel (worker/gpu_attention.py) included, is captured
once at start and replayed with new inputs.

What a replay reads lives in static device buffers that each step overwrites (copied from the
host): token ids, positions, the page and offset each new K/V is written to, context lengths
and block tables padded to the engine's longest sequence. Padding rows are
one-token sequences on a scratch page the allocator never hands out (the cache holds one page
more than the allocator knows of): their K/V go there and their outputs are dropped. The
LM head runs after the replay, on the rows that sample only.

Mixed and prefill steps, and steps that want prompt logprobs, run the compiled graph as it
is (no capture: their shapes vary with every step).
"""

from __future__ import annotations

import itertools
import time

import torch

from worker.attention import StepMeta
from worker.cache import KVCache
from worker.runner import ModelRunner, _ints


def sizes(max_seqs: int) -> list[int]:
    """Batch sizes captured: 2, 4, 8, then multiples of 8 up to max_seqs (rounded up). One
    sequence runs as two (the compiled graph specialises sizes 0 and 1; worker/compiled.py)."""
    out = []
    for s in itertools.chain((2, 4, 8), itertools.count(16, 8)):
        out.append(s)
        if s >= max_seqs:
            return out


class DecodeGraphs:
    """CUDA graphs of ``fwd`` (a worker.compiled.CompiledForward) over ``cache``, one per size."""

    FIELDS = 3  # write pages, write offsets, context lengths; then the tables

    def __init__(self, fwd, cache: KVCache, max_seqs: int, width: int, scratch: int, capture: bool = True):
        """``fwd.hidden(ids, positions, meta)`` is the forward captured; ``scratch`` the page padding
        rows write to. ``capture=False`` runs it on the same buffers without graphs (the tests' CPU
        check of everything but the capture)."""
        self.fwd, self.cache, self.width, self.scratch = fwd, cache, width, scratch
        self.sizes = sizes(max_seqs)
        self.max = self.sizes[-1]
        dev = cache.k.device
        # ids and positions are the compiled graph's inputs: buffers of their own (inputs that
        # alias one another would be a case of their own to Dynamo); the rest, one buffer
        self.ids = torch.zeros(self.max, dtype=torch.long, device=dev)
        self.positions = torch.zeros(self.max, dtype=torch.long, device=dev)
        self.buf = torch.zeros(self.max * (self.FIELDS + width), dtype=torch.long, device=dev)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.capture_s = 0.0
        self.steps = 0  # decode steps run on the buffers
        if capture:
            t = time.perf_counter()
            pool = torch.cuda.graph_pool_handle()
            for nb in reversed(self.sizes):  # the largest first: the smaller ones reuse its memory
                self._capture(nb, pool)
            self.capture_s = time.perf_counter() - t

    def _fill(self, nb: int, batch=()) -> None:
        """The buffers for a step of ``batch`` (decodes) padded to nb rows: built on the host,
        copied over (three copies)."""
        ps = self.cache.page_size
        n = len(batch)
        ids, pos = torch.zeros(nb, dtype=torch.long), torch.zeros(nb, dtype=torch.long)
        ids[:n] = _ints([s.seq.token_ids[s.start] for s in batch])
        pos[:n] = _ints([s.start for s in batch])
        h = torch.zeros(self.FIELDS, nb, dtype=torch.long)
        h[0] = self.scratch
        h[0, :n] = _ints([s.seq.block_table[s.start // ps] for s in batch])
        h[1, :n] = pos[:n] % ps
        tables, ctx = ModelRunner._gpu_tables(list(batch), "cpu", self.width, nb, self.scratch)
        h[2] = ctx
        self.ids[:nb].copy_(ids)
        self.positions[:nb].copy_(pos)
        self.buf[:nb * (self.FIELDS + self.width)].copy_(torch.cat([h.view(-1), tables.view(-1).long()]))

    def _meta(self, nb: int) -> tuple[torch.Tensor, torch.Tensor, StepMeta]:
        """(ids, positions, the step's StepMeta) for nb rows: views of the buffers."""
        f = self.buf[:nb * self.FIELDS].view(self.FIELDS, nb)
        tables = self.buf[nb * self.FIELDS:nb * (self.FIELDS + self.width)].view(nb, self.width)
        z = torch.zeros(0, dtype=torch.long, device=self.buf.device)
        meta = StepMeta(self.cache.k, self.cache.v, f[0], f[1], nb, None, [], z, z.view(0, self.cache.page_size), z, [],
                        dec_gpu=(tables, f[2]))
        return self.ids[:nb], self.positions[:nb], meta

    def _capture(self, nb: int, pool) -> None:
        self._fill(nb)
        ids, pos, meta = self._meta(nb)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up off the capture (cuBLAS workspaces, Triton's first launches)
            for _ in range(2):
                self.fwd.hidden(ids, pos, meta)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = self.fwd.hidden(ids, pos, meta)
        self.graphs[nb] = (graph, out)

    def fits(self, batch) -> bool:
        """Whether the step is decodes only, within the largest size and the tables' width."""
        return len(batch) <= self.max and all(s.num_tokens == 1 and len(s.seq.block_table) <= self.width for s in batch)

    def run(self, batch) -> torch.Tensor:
        """The step's hidden states [len(batch), hidden] (decodes only; see fits)."""
        n = len(batch)
        nb = next(s for s in self.sizes if s >= n)
        self._fill(nb, batch)
        self.steps += 1
        if not self.graphs:  # not captured
            return self.fwd.hidden(*self._meta(nb))[:n]
        graph, out = self.graphs[nb]
        graph.replay()
        return out[:n]
