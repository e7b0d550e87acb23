"""The in-process engine: requests in, one packed forward pass per ``step()``, tokens out.

It knows nothing of Redis. The service drives it from a loop: ``add_request``, ``step``,
``abort``, and reads ``budget()`` to pull only the work it can admit soon.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import random
import time

import torch

from common.protocol import SamplingParams
from common.protocol.fields import ints_below
from worker import (
    attention,
    compiled,
    cuda_graphs,
    fallback,
    fastpath,
    gpu_attention,
    logprobs,
    native,
    prefix_cache,
    probe,
    sampler,
    structured,
)
from worker.admission import Decision, decide
from worker.cache import BlockAllocator, KVCache, kv_heads_and_dim
from worker.config import EngineConfig
from worker.detokenizer import IncrementalDetokenizer
from worker.models import check_supported, max_exact_len
from worker.outputs import Budget, EngineStats, RequestMetrics, RequestOutput
from worker.runner import ModelRunner
from worker.scheduler import Scheduler
from worker.sequence import Sequence, Status

log = logging.getLogger("tokenq.engine")


def _choice_seed(seed: int, index: int) -> int:
    """Choice 0 keeps the request's seed (n=1 is unchanged); the others get their own streams."""
    return seed if index == 0 else (seed + index * 0x9E3779B97F4A7C15) % 2**63


def _text_config(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _outside(ids, vocab_size: int):
    """The first id of ``ids`` that is not an int in [0, vocab_size), else None (plain ints
    checked at once: fields.ints_below)."""
    if not ids or ints_below(ids, vocab_size):
        return None
    return next((t for t in ids if not isinstance(t, int) or not 0 <= t < vocab_size), None)


class Engine:
    def __init__(self, model: torch.nn.Module, tokenizer=None, config: EngineConfig | None = None):
        cfg = self.config = config or EngineConfig()
        mcfg = _text_config(model.config)
        check_supported(mcfg, model)
        attention.register()
        fallback.adopt(model)
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.token_text = logprobs.token_texts(tokenizer) if tokenizer is not None else None  # for logprobs' token strings
        self.device = torch.device(cfg.device) if cfg.device else next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        num_kv, head_dim = kv_heads_and_dim(mcfg)
        shape = dict(num_layers=mcfg.num_hidden_layers, page_size=cfg.page_size, num_kv_heads=num_kv, head_dim=head_dim)
        num_pages = cfg.num_pages or max(1, int(cfg.kv_cache_memory * 2**30) // KVCache.bytes_per_page(**shape, dtype=self.dtype))
        host_pages = 0
        if cfg.preemption_mode == "swap":
            host_pages = cfg.swap_pages if cfg.swap_pages is not None else num_pages
        probe.probe(model, mcfg, shape["num_layers"], num_kv, head_dim, cfg.page_size, self.device, self.dtype)
        # On CUDA, attention runs through the GPU kernels, and the cache holds one page more than
        # the allocator hands out: the scratch page that CUDA graphs' padding rows write to.
        no_gpu = gpu_attention.why_not(self.device, self.dtype, head_dim, model) if cfg.fast_path else "the fast path is off"
        scratch = 1 if no_gpu is None else 0
        # (its zeros written beside the compile below: ready() at the end)
        self.cache = KVCache(num_pages=num_pages + scratch, dtype=self.dtype, device=self.device, host_pages=host_pages,
                             zero_later=True, **shape)
        self.allocator = BlockAllocator(num_pages, cfg.page_size)
        host_alloc = BlockAllocator(host_pages, cfg.page_size) if host_pages else None
        model_len = max_exact_len(mcfg)
        self.max_model_len = min(cfg.max_model_len or model_len, model_len, num_pages * cfg.page_size)
        self.scheduler = Scheduler(cfg, self.allocator, self.max_model_len, host_alloc)
        fast = fastpath.forward_model(self.model, self.device, cfg.fast_path)
        native_decode = cfg.fast_path and native.usable(self.device, self.dtype)  # (waits for the linears' build)
        native_prefill = native_decode and native.prefill_usable(self.device, self.dtype, head_dim)
        fwd = self._compile(fast, shape, native_decode, native_prefill)  # (its first step waits for the steps' build)
        if native_decode and native.load() is None:  # they did not build (the linears did): torch ops attend
            native_decode = native_prefill = False
        self.runner = ModelRunner(fast, self.cache, native_decode, native_prefill, compiled=fwd,
                                  gpu_attention=no_gpu is None)
        if self.device.type == "cuda":
            self._capture(num_pages, no_gpu)
        log.info("decode attention: %s", "native kernel (worker/native.py)" if self.runner.native_decode else
                 "GPU kernel (worker/gpu_attention.py)" if self.runner.gpu_attention else
                 "torch ops" + (f" ({no_gpu})" if self.device.type == "cuda" else f" ({native.error()})" if native.error() else ""))
        log.info("prefill attention: %s", "native kernel (worker/native.py)" if native_prefill else
                 "GPU kernel (worker/gpu_attention.py)" if self.runner.gpu_attention else
                 "SDPA" + (f" ({native.error()})" if native.error() else
                           " (the native kernel covers float32/bf16, head sizes 32/64/128/256, on AVX-512 or AVX2)" if native_decode else ""))
        self.vocab_size = mcfg.vocab_size
        self.eos_token_ids = self._eos_ids(model, tokenizer)
        self._seqs: dict[str, list[Sequence]] = {}  # request id -> its choices (n of them)
        self._pending: list[Sequence] = []  # not in the scheduler yet: their grammar compiles, or choice 0 prefills
        self._grammar_pool: structured.Grammars | None = None
        self._arrivals = itertools.count()
        self._aborted: list[RequestOutput] = []
        self._stats = EngineStats(num_total_pages=num_pages)
        self.cache.ready()
        log.info(
            "engine: %d pages x %d tokens (%.2f GiB), max_model_len %d, %s/%s, device %s %s",
            num_pages, cfg.page_size, num_pages * KVCache.bytes_per_page(**shape, dtype=self.dtype) / 2**30,
            self.max_model_len, cfg.admission_policy, cfg.preemption_mode, self.device, self.dtype,
        )

    def _compile(self, fast, shape: dict, native_decode: bool, native_prefill: bool) -> compiled.CompiledForward | None:
        """The compiled forward, warmed up and checked, or None (logged either way)."""
        if not self.config.fast_path:
            fwd, how = None, "the fast path is turned off"
        else:
            fwd, how = compiled.get(self.model, self.max_model_len, self.device, fast, shape, native_decode, native_prefill)
        # every decode batch size met once (compiled.warm_sizes), and a step at the token budget: now
        # rather than in the first steps served
        if fwd is not None and self.device.type == "cpu":
            warm = compiled.warm_sizes(fwd, shape, self.device, self.dtype, (native_decode, native_prefill),
                                       range(1, self.config.max_num_seqs + 1))
            how += f"; {self.config.max_num_seqs} batch sizes warmed in {warm:.1f} s" if warm else ""
            budget = self.config.max_num_batched_tokens
            warm = compiled.warm_budget(fwd, shape, self.device, self.dtype, (native_decode, native_prefill), budget,
                                        self.max_model_len)
            how += f"; a step of {budget} prompt tokens in {warm:.1f} s"
        log.info("compiled forward: %s (%s)", "on" if fwd is not None else "off", how)
        return fwd

    def _capture(self, scratch: int, no_gpu: str | None) -> None:
        """CUDA graphs of the decode steps (worker/cuda_graphs.py), or why not (logged either way)."""
        why = no_gpu or ("the compiled forward is off" if self.runner.compiled is None else None)
        if why is None:
            try:
                width = -(-self.max_model_len // self.config.page_size)
                graphs = cuda_graphs.DecodeGraphs(self.runner.compiled, self.cache, self.config.max_num_seqs, width, scratch)
                self.runner.graphs = graphs
                log.info("cuda graphs: on (%d decode batch sizes up to %d captured in %.1f s)", len(graphs.sizes),
                         graphs.max, graphs.capture_s)
                return
            except Exception as e:  # noqa: BLE001 - decode steps run the compiled graph uncaptured
                why = f"capture failed: {type(e).__name__}: {e}"
        log.info("cuda graphs: off (%s)", why)

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
        generated_ids: list[int] | list[list[int]] | None = None,
        ended: dict[int, str] | None = None,
        arrival_time: float | None = None,
    ) -> None:
        """Queue a request. ``generated_ids`` resumes one whose first tokens were produced
        elsewhere (a dead worker): they count as output and are not emitted again; with n > 1,
        one list per choice, and ``ended`` the choices that had finished (index: reason)."""
        params = params or SamplingParams()
        if request_id in self._seqs:
            raise ValueError(f"request {request_id!r} is already in the engine")
        if not prompt_token_ids:
            raise ValueError("the prompt is empty")
        gen = list(generated_ids or [])
        per_choice = gen if gen and isinstance(gen[0], list) else [gen]
        per_choice += [[]] * (params.n - len(per_choice))
        bad = next((t for ids in [prompt_token_ids, *per_choice, params.logit_bias]
                    if (t := _outside(ids, self.vocab_size)) is not None), None)
        if bad is not None:
            raise ValueError(f"token id {bad!r} is outside the vocabulary [0, {self.vocab_size})")
        if (params.stop or params.structured_outputs) and self.tokenizer is None:
            raise ValueError(f"{'stop strings' if params.stop else 'structured output'} need an engine with a tokenizer")
        seed = params.seed if params.seed is not None else random.getrandbits(63)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        grammar = self._grammars().submit(params.structured_outputs) if params.structured_outputs else None
        group = []
        for i, generated in enumerate(per_choice[:params.n]):
            seq = Sequence(
                request_id=request_id, token_ids=list(prompt_token_ids) + generated, num_prompt_tokens=len(prompt_token_ids),
                params=params, priority=priority, arrival=next(self._arrivals), arrival_time=arrival,
                seed=_choice_seed(seed, i), timeout_s=timeout_s, index=i,
            )
            if self.tokenizer is not None:
                seq.detok = IncrementalDetokenizer(self.tokenizer, list(prompt_token_ids), params.stop)
                if generated:
                    seq.detok.add(generated)
                    seq.detok.delta(final=False)  # that text was published already (as far as it was complete)
            if grammar is not None:
                seq.grammar = structured.GrammarState(grammar)
            group.append(seq)
            if ended and i in ended:
                seq.status, seq.finish_reason = Status.FINISHED, ended[i]
            elif grammar is not None or (i and self._share_prompt):
                self._pending.append(seq)  # joins the scheduler when ready (_ready)
            else:
                self.scheduler.add(seq)
        self._seqs[request_id] = group
        if all(s.status is Status.FINISHED for s in group):  # resumed with every choice ended
            self._aborted += self._close_group(group[-1], arrival)

    def _grammars(self) -> structured.Grammars:
        if self._grammar_pool is None:
            self._grammar_pool = structured.Grammars(self.tokenizer, self.vocab_size, self.eos_token_ids)
        return self._grammar_pool

    @property
    def _share_prompt(self) -> bool:
        # With prefix caching, choices 1.. wait for choice 0's prefill and then find its prompt pages cached.
        return bool(getattr(self.config, "enable_prefix_caching", False))

    def _ready(self, seq: Sequence) -> bool:
        if seq.grammar is not None and not seq.grammar.future.done():
            return False
        if seq.index and self._share_prompt:
            lead = self._seqs[seq.request_id][0]
            return lead.status is Status.FINISHED or lead.num_output_tokens > 0
        return True

    def _start_pending(self, now: float) -> list[RequestOutput]:
        """Pending sequences that are ready join the scheduler (or fail, with an invalid grammar)."""
        outputs = []
        for seq in [s for s in self._pending if self._ready(s)]:
            if seq not in self._pending:
                continue  # a sibling choice's failed grammar ended it just now
            self._pending.remove(seq)
            try:
                if seq.grammar is not None:
                    seq.grammar.start(seq.output_ids)
            except Exception as e:  # ValueError: the spec does not compile (or resumed tokens do not fit)
                code = "invalid_request" if isinstance(e, ValueError) else "internal"
                for other in self._seqs.get(seq.request_id, []):
                    if other in self._pending:
                        self._pending.remove(other)
                    self._end(other, "error")
                    other.error = (code, str(e))
                outputs += self._close_group(seq, now)
                continue
            self.scheduler.add(seq)
        return outputs

    def abort(self, request_id: str) -> bool:
        """Stop a waiting or running request now; its final output comes with the next step."""
        group = self._seqs.get(request_id)
        if group is None:
            return False
        for seq in group:
            if seq in self._pending:
                self._pending.remove(seq)
            self._end(seq, "cancelled")
        self._aborted += self._close_group(group[0], time.monotonic())
        return True

    def _end(self, seq: Sequence, reason: str) -> None:
        if seq.status is not Status.FINISHED:
            if seq.status is Status.WAITING and seq not in self.scheduler.waiting:
                seq.status, seq.finish_reason = Status.FINISHED, reason  # still pending (see _ready)
            else:
                self.scheduler.finish(seq, reason)

    def _close_group(self, seq: Sequence, now: float, new: list[int] | None = None, first: int | None = None,
                     lp=None) -> list[RequestOutput]:
        """The output of ``seq`` when its choice just ended: final when it was the last one."""
        seq.finished_time = now
        done = all(s.status is Status.FINISHED for s in self._seqs[seq.request_id])
        o = self._output(seq, new or [], finished=done, first=first, lp=lp)
        if done:
            del self._seqs[seq.request_id]
        return [o]

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
            free_seqs=max(0, self.config.max_num_seqs - len(s.running) - len(s.waiting) - len(self._pending)),
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
        outputs, self._aborted = self._aborted, []
        if self._pending:
            outputs += self._start_pending(t0)
        out = self.scheduler.schedule(t0)
        for seq in out.finished:  # rejected or timed out without running
            outputs += self._close_group(seq, t0)
        st = self._stats
        if out.scheduled:
            logits, sampled, prompt = self.runner.execute(out)
            for s in out.scheduled:
                seq = s.seq
                seq.num_computed = s.start + s.num_tokens
                self.scheduler.commit(seq)
                if s.num_tokens > 1 or s.start < seq.num_prompt_tokens:
                    st.num_prompt_tokens += s.num_tokens
            for s, lo, rows in prompt:
                self._score_prompt(s.seq, lo, rows)
            seqs = [s.seq for s in sampled]
            masks = structured.apply_masks if structured.has_grammar(seqs) else None
            res = sampler.sample_step(logits, seqs, self.eos_token_ids, masks) if sampled else None
            now = time.monotonic()
            for seq, tok, lp in zip(seqs, res.tokens if res else [], res.logprobs if res else []):
                outputs += self._append(seq, tok, now, lp)
            st.num_generated_tokens += len(seqs)
            st.num_steps += 1
        elif self._pending and not outputs:
            # only grammars compiling: wait for one (briefly) instead of spinning the loop
            concurrent.futures.wait([s.grammar.future for s in self._pending if s.grammar is not None], timeout=0.005,
                                    return_when=concurrent.futures.FIRST_COMPLETED)
        st.last_batch_tokens = out.num_batched_tokens
        st.last_step_s = time.monotonic() - t0
        return outputs

    def _score_prompt(self, seq: Sequence, lo: int, rows: torch.Tensor) -> None:
        if seq.prompt_logprobs is None:
            seq.prompt_logprobs = []
        assert lo == len(seq.prompt_logprobs), f"{seq.request_id}: prompt logprobs from {lo}, have {len(seq.prompt_logprobs)}"
        targets = torch.tensor(seq.token_ids[lo + 1:lo + 1 + len(rows)], device=rows.device)
        seq.prompt_logprobs += logprobs.gather(logprobs.log_softmax(rows), targets, [seq.params.prompt_logprobs] * len(rows))

    def _append(self, seq: Sequence, tok: int, now: float, lp=None) -> list[RequestOutput]:
        first = seq.num_output_tokens
        seq.token_ids.append(tok)
        if seq.first_token_time is None:
            seq.first_token_time = now
        p = seq.params
        reason = None
        if seq.detok is not None:
            seq.detok.add([tok])
        if seq.grammar is not None:
            try:
                seq.grammar.accept(tok)
            except ValueError as e:  # cannot happen with the mask applied; end it rather than go on outside the grammar
                log.warning("%s: %s", seq.request_id, e)
                reason = "stop"
        if reason is not None:
            pass
        elif not p.ignore_eos and tok in self.eos_token_ids:
            reason = "stop"
        elif tok in p.stop_token_ids:
            reason = "stop"
        elif seq.detok is not None and seq.detok.stopped:
            reason = "stop"
        elif seq.grammar is not None and seq.grammar.terminated:
            reason = "stop"
        elif first + 1 >= p.max_tokens or len(seq.token_ids) >= self.max_model_len:
            reason = "length"
        if reason is None:
            return [self._output(seq, [tok], finished=False, first=first, lp=lp)]
        self.scheduler.finish(seq, reason)
        return self._close_group(seq, now, [tok], first, lp)

    def _output(self, seq: Sequence, new: list[int], finished: bool, first: int | None = None, lp=None) -> RequestOutput:
        group = self._seqs.get(seq.request_id) or [seq]
        ended = seq.status is Status.FINISHED
        # n = 1 (nearly every request): its own figures, without a pass over the group; this
        # runs once per sequence per step (a tenth of a 256-sequence step's host time went here)
        single = len(group) == 1
        o = RequestOutput(
            request_id=seq.request_id,
            new_token_ids=new,
            seq=seq.num_output_tokens if first is None else first,
            text=seq.detok.delta(final=ended) if seq.detok is not None else "",
            finished=finished,
            error=seq.error if single else next((s.error for s in group if s.error), None),
            num_prompt_tokens=seq.num_prompt_tokens,
            num_output_tokens=seq.num_output_tokens if single else sum(s.num_output_tokens for s in group),
            cached_tokens=seq.cached_tokens or 0,
            index=seq.index,
            choice_finish_reason=seq.finish_reason if ended else None,
            logprobs=[lp] if lp is not None else None,
        )
        if new and first == 0 and seq.index == 0 and seq.params.prompt_logprobs is not None:
            # the first prompt token has nothing before it to be scored by
            o.prompt_logprobs = [logprobs.TokenLogprob(seq.token_ids[0], None), *(seq.prompt_logprobs or [])]
        if finished:
            o.finish_reason = "error" if o.error else group[0].finish_reason
            o.finish_reasons = [s.finish_reason for s in group]
            first_sched = min((s.first_scheduled_time for s in group if s.first_scheduled_time is not None), default=None)
            first_tok = min((s.first_token_time for s in group if s.first_token_time is not None), default=None)
            o.metrics = RequestMetrics(seq.arrival_time, first_sched, first_tok, seq.finished_time, sum(s.num_preemptions for s in group))
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
