"""Helpers shared by the engine, scheduler and sampling tests: reference generation with
transformers, and a driver that steps a real Engine while recording what it scheduled."""

from __future__ import annotations

import copy
import random
from dataclasses import dataclass, field

import torch
from tiny import tiny_model

from common.protocol import SamplingParams
from worker.engine import Engine, EngineConfig
from worker.outputs import RequestOutput

FAMILIES = ["llama", "qwen2", "qwen3", "mistral"]

# Tiny models on shared 2-core machines: a second intra-op thread only adds waiting (OpenMP
# threads wait for a core another process holds), which made these tests ~10x slower.
torch.set_num_threads(1)


def greedy(max_tokens: int = 16, **kw) -> SamplingParams:
    kw.setdefault("ignore_eos", True)
    return SamplingParams(max_tokens=max_tokens, temperature=0, **kw)


def model_pair(family: str = "llama", dtype=torch.float64, seed: int = 0):
    """(model for the engine, untouched deep copy for transformers' generate)."""
    model = tiny_model(family, dtype=dtype, seed=seed)
    return model, copy.deepcopy(model)


def reference(model, prompt: list[int], max_tokens: int, eos: bool = False) -> list[int]:
    """Greedy output of transformers' own generate on the prompt alone."""
    ids = torch.tensor([prompt], device=model.device)
    kw = {} if eos else {"eos_token_id": None}
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False,
                         pad_token_id=0, **kw)
    return out[0, len(prompt):].tolist()


def random_prompts(rng: random.Random, n: int, lengths=(1, 300), vocab: int = 512) -> list[list[int]]:
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(*lengths))] for _ in range(n)]


@dataclass
class StepRecord:
    scheduled: list[tuple[str, int, int, bool]]  # (request id, start, tokens, samples)
    running: list[str]
    waiting: list[str]
    swapped_out: int
    swapped_in: int
    preemptions: int  # engine total after this schedule


@dataclass
class Run:
    outputs: dict[str, list[RequestOutput]] = field(default_factory=dict)
    added: list[str] = field(default_factory=list)  # requests added by drive() (streams checked)
    steps: list[StepRecord] = field(default_factory=list)
    first_token_step: dict[str, int] = field(default_factory=dict)
    finish_step: dict[str, int] = field(default_factory=dict)

    def tokens(self, rid: str) -> list[int]:
        return [t for o in self.outputs[rid] for t in o.new_token_ids]

    def choice(self, rid: str, index: int) -> list[int]:
        return [t for o in self.outputs[rid] if o.index == index for t in o.new_token_ids]

    def text(self, rid: str) -> str:
        return "".join(o.text for o in self.outputs[rid])

    def final(self, rid: str) -> RequestOutput:
        return self.outputs[rid][-1]

    def reason(self, rid: str) -> str | None:
        return self.final(rid).finish_reason


def record(engine: Engine, run: Run) -> None:
    """Observe every schedule() of the engine (the real one runs unchanged)."""
    sched = engine.scheduler
    real = sched.schedule

    def schedule(now):
        out = real(now)
        run.steps.append(StepRecord(
            [(s.seq.request_id, s.start, s.num_tokens, s.sample) for s in out.scheduled],
            [s.request_id for s in sched.running],
            [s.request_id for s in sched.waiting],
            len(out.swap_out[0]),
            len(out.swap_in[0]),
            sched.num_preemptions,
        ))
        return out

    sched.schedule = schedule


def drive(engine: Engine, arrivals: dict[int, list[tuple]] | None = None, aborts: dict[int, list[str]] | None = None,
          max_steps: int = 20000, check_pages: bool = True) -> Run:
    """Step ``engine`` until it is idle. ``arrivals[step]`` holds add_request argument tuples
    (request id, prompt, params[, priority]) added just before that step; ``aborts[step]``
    request ids aborted just before it. Checks that every request's stream is well formed."""
    arrivals = dict(arrivals or {})
    aborts = dict(aborts or {})
    run = Run()
    record(engine, run)
    step = 0
    while engine.has_unfinished() or any(k >= step for k in arrivals) or any(k >= step for k in aborts):
        for args in arrivals.pop(step, []):
            rid = args[0]
            assert rid not in run.outputs, f"{rid} added twice"
            run.outputs[rid] = []
            run.added.append(rid)
            engine.add_request(*args)
        for rid in aborts.pop(step, []):
            engine.abort(rid)
        for o in engine.step():  # (requests added before drive() are recorded, not checked)
            run.outputs.setdefault(o.request_id, [])
            if o.new_token_ids and o.request_id not in run.first_token_step:
                run.first_token_step[o.request_id] = step
            if o.finished:
                run.finish_step[o.request_id] = step
            run.outputs[o.request_id].append(o)
        step += 1
        assert step < max_steps, "the engine does not finish"
    check_streams(run)
    if check_pages:
        assert_idle(engine)
    return run


def check_streams(run: Run) -> None:
    """Every request ends with exactly one final output, and its tokens come contiguously from
    seq 0: nothing already produced is re-emitted, changed, or skipped."""
    for rid in run.added:
        outs = run.outputs[rid]
        assert outs, f"{rid}: no output at all"
        finals = [i for i, o in enumerate(outs) if o.finished]
        assert finals == [len(outs) - 1], f"{rid}: final outputs at {finals} of {len(outs)}"
        n: dict[int, int] = {}  # per choice (n > 1): its own seq numbers
        for o in outs:
            if o.new_token_ids:
                assert o.seq == n.get(o.index, 0), f"{rid}[{o.index}]: seq {o.seq}, expected {n.get(o.index, 0)}"
            n[o.index] = n.get(o.index, 0) + len(o.new_token_ids)
        total = sum(n.values())
        assert outs[-1].num_output_tokens == total, f"{rid}: says {outs[-1].num_output_tokens} tokens, streamed {total}"


def assert_idle(engine: Engine) -> None:
    """Nothing left in the engine and every page back in the pools."""
    assert not engine.has_unfinished()
    st = engine.stats
    assert st.num_running == st.num_waiting == 0
    assert st.num_free_pages == st.num_total_pages == engine.allocator.num_pages
    assert engine.allocator.reserved == 0
    host = engine.scheduler.host_alloc
    if host is not None:
        assert host.num_free == host.num_pages


def make_engine(model, tokenizer=None, **cfg) -> Engine:
    cfg.setdefault("check_invariants", True)
    return Engine(model, tokenizer, EngineConfig(**cfg))
