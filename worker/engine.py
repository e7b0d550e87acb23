"""The in-process engine: requests in, one packed forward pass per ``step()``, tokens out.

It knows nothing of Redis. The service drives it from a loop: ``add_request``, ``step``,
``abort``, and reads ``budget()`` to pull only the work it can admit soon.
"""

from __future__ import annotations

import itertools
import logging
import random
import time
from dataclasses import dataclass, field

import torch

from common.protocol import SamplingParams
from worker import attention, fallback, fastpath, prefix_cache, probe, sampler
from worker.admission import Decision, decide
from worker.cache import BlockAllocator, KVCache
from worker.config import EngineConfig
from worker.detokenizer import IncrementalDetokenizer
from worker.models import check_supported, max_exact_len
from worker.runner import ModelRunner
from worker.scheduler import Scheduler
from worker.sequence import Sequence

log = logging.getLogger("tokenq.engine")


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
    num_output_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens found in the prefix cache (not computed) when it was admitted
    metrics: RequestMetrics | None = None  # set on the final output


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


def _text_config(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config


class Engine:
    def __init__(self, model: torch.nn.Module, tokenizer=None, config: EngineConfig | None = None):
        cfg = self.config = config or EngineConfig()
        mcfg = _text_config(model.config)
        check_supported(mcfg, model)
        attention.register()
        fallback.adopt(model)
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.device = torch.device(cfg.device) if cfg.device else next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        num_kv = getattr(mcfg, "num_key_value_heads", None) or mcfg.num_attention_heads
        head_dim = getattr(mcfg, "head_dim", None) or mcfg.hidden_size // mcfg.num_attention_heads
        shape = dict(num_layers=mcfg.num_hidden_layers, page_size=cfg.page_size, num_kv_heads=num_kv, head_dim=head_dim)
        num_pages = cfg.num_pages or max(1, int(cfg.kv_cache_memory * 2**30) // KVCache.bytes_per_page(**shape, dtype=self.dtype))
        host_pages = 0
        if cfg.preemption_mode == "swap":
            host_pages = cfg.swap_pages if cfg.swap_pages is not None else num_pages
        probe.probe(model, mcfg, shape["num_layers"], num_kv, head_dim, cfg.page_size, self.device, self.dtype)
        self.cache = KVCache(num_pages=num_pages, dtype=self.dtype, device=self.device, host_pages=host_pages, **shape)
        self.allocator = BlockAllocator(num_pages, cfg.page_size)
        host_alloc = BlockAllocator(host_pages, cfg.page_size) if host_pages else None
        model_len = max_exact_len(mcfg)
        self.max_model_len = min(cfg.max_model_len or model_len, model_len, num_pages * cfg.page_size)
        self.scheduler = Scheduler(cfg, self.allocator, self.max_model_len, host_alloc)
        self.runner = ModelRunner(fastpath.forward_model(self.model, self.device, cfg.fast_path), self.cache)
        self.vocab_size = mcfg.vocab_size
        self.eos_token_ids = self._eos_ids(model, tokenizer)
        self._seqs: dict[str, Sequence] = {}
        self._arrivals = itertools.count()
        self._aborted: list[RequestOutput] = []
        self._stats = EngineStats(num_total_pages=num_pages)
        log.info(
            "engine: %d pages x %d tokens (%.2f GiB), max_model_len %d, %s/%s, device %s %s",
            num_pages, cfg.page_size, num_pages * KVCache.bytes_per_page(**shape, dtype=self.dtype) / 2**30,
            self.max_model_len, cfg.admission_policy, cfg.preemption_mode, self.device, self.dtype,
        )

    @staticmethod
    def _eos_ids(model, tokenizer) -> set[int]:
        eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        if eos is None and tokenizer is not None:
            eos = tokenizer.eos_token_id
        if eos is None:
            return set()
        return set(eos) if isinstance(eos, (list, tuple)) else {int(eos)}

    # ------------------------------------------------------------------ requests

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams | None = None,
        priority: int = 1,
        *,
        timeout_s: float | None = None,
        generated_ids: list[int] | None = None,
        arrival_time: float | None = None,
    ) -> None:
        """Queue a request. ``generated_ids`` resumes one whose first tokens were produced
        elsewhere (a dead worker): they count as output and are not emitted again."""
        params = params or SamplingParams()
        if request_id in self._seqs:
            raise ValueError(f"request {request_id!r} is already in the engine")
        if not prompt_token_ids:
            raise ValueError("the prompt is empty")
        generated = list(generated_ids or [])
        ids = list(prompt_token_ids) + generated
        bad = next((t for t in ids if not isinstance(t, int) or not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ValueError(f"token id {bad!r} is outside the vocabulary [0, {self.vocab_size})")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need an engine with a tokenizer")
        seq = Sequence(
            request_id=request_id,
            token_ids=ids,
            num_prompt_tokens=len(prompt_token_ids),
            params=params,
            priority=priority,
            arrival=next(self._arrivals),
            arrival_time=time.monotonic() if arrival_time is None else arrival_time,
            seed=params.seed if params.seed is not None else random.getrandbits(63),
            timeout_s=timeout_s,
        )
        if self.tokenizer is not None:
            seq.detok = IncrementalDetokenizer(self.tokenizer, list(prompt_token_ids), params.stop)
            if generated:
                seq.detok.add(generated)
                seq.detok.delta(final=False)  # that text was published already (as far as it was complete)
        self._seqs[request_id] = seq
        self.scheduler.add(seq)

    def abort(self, request_id: str) -> bool:
        """Stop a waiting or running request now; its final output comes with the next step."""
        seq = self._seqs.pop(request_id, None)
        if seq is None:
            return False
        self.scheduler.finish(seq, "cancelled")
        seq.finished_time = time.monotonic()
        self._aborted.append(self._output(seq, [], finished=True))
        return True

    def has_unfinished(self) -> bool:
        return bool(self._seqs) or bool(self._aborted)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._seqs

    # ------------------------------------------------------------------ budget

    def budget(self) -> Budget:
        s = self.scheduler
        free_pages = self.allocator.num_available - s.pages_waiting()
        return Budget(
            free_tokens=max(0, free_pages) * self.config.page_size,
            free_seqs=max(0, self.config.max_num_seqs - len(s.running) - len(s.waiting)),
        )

    def cached_tokens(self, prompt_token_ids: list[int], cache_salt: str | None = None) -> int:
        """Prompt tokens a request would find in the prefix cache now (what it would not compute)."""
        if not self.config.enable_prefix_caching:
            return 0
        return len(prefix_cache.lookup(list(prompt_token_ids), cache_salt, self.allocator)) * self.config.page_size

    def can_admit(self, num_prompt_tokens: int, max_tokens: int, priority: int = 1) -> Decision:
        """What admission would decide for such a request if it were next in line now."""
        probe = Sequence("", [0] * num_prompt_tokens, num_prompt_tokens, SamplingParams(max_tokens=max_tokens), priority, 0, 0.0, 0)
        return decide(probe, self.allocator, self.config, self.max_model_len, len(self.scheduler.running)).decision

    # ------------------------------------------------------------------ the step

    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        t0 = time.monotonic()
        out = self.scheduler.schedule(t0)
        outputs, self._aborted = self._aborted, []
        for seq in out.finished:  # rejected or timed out without running
            self._seqs.pop(seq.request_id, None)
            seq.finished_time = t0
            outputs.append(self._output(seq, [], finished=True))
        st = self._stats
        if out.scheduled:
            logits, sampled = self.runner.execute(out)
            for s in out.scheduled:
                s.seq.num_computed = s.start + s.num_tokens
                self.scheduler.commit(s.seq)
                if s.num_tokens > 1 or s.start < s.seq.num_prompt_tokens:
                    st.num_prompt_tokens += s.num_tokens
            tokens = sampler.sample(logits, [s.seq for s in sampled]) if sampled else []
            now = time.monotonic()
            for s, tok in zip(sampled, tokens):
                outputs.append(self._append(s.seq, tok, now))
            st.num_generated_tokens += len(tokens)
            st.num_steps += 1
        st.last_batch_tokens = out.num_batched_tokens
        st.last_step_s = time.monotonic() - t0
        return outputs

    def _append(self, seq: Sequence, tok: int, now: float) -> RequestOutput:
        first = seq.num_output_tokens
        seq.token_ids.append(tok)
        if seq.first_token_time is None:
            seq.first_token_time = now
        p = seq.params
        reason = None
        if seq.detok is not None:
            seq.detok.add([tok])
        if not p.ignore_eos and tok in self.eos_token_ids:
            reason = "stop"
        elif tok in p.stop_token_ids:
            reason = "stop"
        elif seq.detok is not None and seq.detok.stopped:
            reason = "stop"
        elif seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            reason = "length"
        if reason is not None:
            self.scheduler.finish(seq, reason)
            self._seqs.pop(seq.request_id, None)
            seq.finished_time = now
        return self._output(seq, [tok], finished=reason is not None, first=first)

    def _output(self, seq: Sequence, new: list[int], finished: bool, first: int | None = None) -> RequestOutput:
        o = RequestOutput(
            request_id=seq.request_id,
            new_token_ids=new,
            seq=seq.num_output_tokens if first is None else first,
            text=seq.detok.delta(final=finished) if seq.detok is not None else "",
            finished=finished,
            finish_reason=seq.finish_reason if finished else None,
            error=seq.error,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_output_tokens=seq.num_output_tokens,
            cached_tokens=seq.cached_tokens or 0,
        )
        if finished:
            o.metrics = RequestMetrics(seq.arrival_time, seq.first_scheduled_time, seq.first_token_time, seq.finished_time, seq.num_preemptions)
        return o

    @property
    def stats(self) -> EngineStats:
        st = self._stats
        st.num_preemptions = self.scheduler.num_preemptions
        st.num_free_pages = self.allocator.num_free
        st.num_running = len(self.scheduler.running)
        st.num_waiting = len(self.scheduler.waiting)
        st.admissions = {d.value: n for d, n in self.scheduler.admissions.items()}
        st.prefix_cache_queries = self.scheduler.prefix_queries
        st.prefix_cache_hits = self.scheduler.prefix_hits
        return st

    # ------------------------------------------------------------------ offline use

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams] | None = None, priority: int = 1) -> list[list[int]]:
        """Run every prompt to completion; returns the output token ids of each, in order."""
        plist = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        ids = [f"generate-{next(self._arrivals)}-{i}" for i in range(len(prompts))]
        for rid, prompt, p in zip(ids, prompts, plist):
            self.add_request(rid, prompt, p, priority)
        results: dict[str, list[int]] = {rid: [] for rid in ids}
        errors = []
        while any(rid in self._seqs for rid in ids) or self._aborted:
            for o in self.step():
                if o.request_id in results:
                    results[o.request_id].extend(o.new_token_ids)
                    if o.error:
                        errors.append(f"{o.request_id}: {o.error[1]}")
        if errors:
            raise ValueError("; ".join(errors))
        return [results[rid] for rid in ids]
