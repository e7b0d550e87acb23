#!/usr/bin/env python
"""What the output features cost a decode step: a batch of plain requests against a batch
that mixes plain, penalised (repetition, presence, frequency, logit_bias), logprob (top 5,
plus prompt logprobs) and grammar (xgrammar) requests, side by side in one run.

Both batches hold ``--seqs`` sequences (default 64) on the same engine config and weights
(SmolLM2-135M by default); after every prompt is in, ``--steps`` decode steps are timed
(all sequences decoding, none finishing), and the two batches alternate ``--repeat`` times.
It prints the median step time of each and their ratio (the goal: mixed within 1.10x).

    flock /tmp/bench.lock python scripts/bench_outputs.py
    flock /tmp/bench.lock python scripts/bench_outputs.py --model tiny --seqs 16   # quick
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from worker.tuning import set_openmp_env, tune_process  # noqa: E402

set_openmp_env()
import torch  # noqa: E402

from common.protocol import SamplingParams  # noqa: E402
from worker import sampler  # noqa: E402
from worker.engine import Engine, EngineConfig  # noqa: E402

# No end before the timed steps: a fixed-length regex and EOS ignored.
GRAMMAR = {"regex": "[a-z ,.]{400}"}


def load(name: str):
    if name == "tiny":
        sys.path.insert(0, str(ROOT / "tests"))
        from tiny import tiny_model, tiny_tokenizer

        return tiny_model(dtype=torch.float32), tiny_tokenizer()
    from worker.models import load as load_model

    return load_model(name, device="cpu", dtype="float32")


def params(kind: str, i: int, max_tokens: int) -> SamplingParams:
    base = dict(max_tokens=max_tokens, temperature=0.8, seed=i, ignore_eos=True)
    if kind == "penalised":
        base.update(repetition_penalty=1.2, presence_penalty=0.5, frequency_penalty=0.3, logit_bias={13: 2.0, 42: -5.0})
    elif kind == "logprobs":
        base.update(logprobs=5, prompt_logprobs=5)
    elif kind == "grammar":
        base.update(structured_outputs=GRAMMAR)
    return SamplingParams(**base)


SAMPLING: list[float] = []  # seconds of each sampler.sample_step call (penalties, masks, logprobs, sampling)


def _time_sampling() -> None:
    real = sampler.sample_step

    def timed(*args, **kw):
        t = time.perf_counter()
        out = real(*args, **kw)
        SAMPLING.append(time.perf_counter() - t)
        return out

    sampler.sample_step = timed


def run(engine: Engine, prompts: list[list[int]], kinds: list[str], steps: int, tag: str) -> tuple[float, float]:
    """Median seconds per decode step with every sequence decoding, and of its sampling stage."""
    for i, (p, k) in enumerate(zip(prompts, kinds)):
        engine.add_request(f"{tag}-{i}", p, params(k, i, steps + 64))
    # prefill (and grammar compiles) until every sequence has its first token
    started: set[str] = set()
    while len(started) < len(prompts):
        started |= {o.request_id for o in engine.step() if o.new_token_ids}
    times = []
    SAMPLING.clear()
    for _ in range(steps):
        t = time.perf_counter()
        outs = engine.step()
        times.append(time.perf_counter() - t)
        assert len(outs) == len(prompts), ("a sequence finished or waited inside the timed steps", [(o.request_id, o.finish_reason, o.error) for o in outs if o.finished])
    sampling = statistics.median(SAMPLING)
    for i in range(len(prompts)):
        engine.abort(f"{tag}-{i}")
    engine.step()
    return statistics.median(times), sampling


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2", help="a model name/dir, or 'tiny'")
    ap.add_argument("--seqs", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    tune_process()
    _time_sampling()
    model, tok = load(a.model)
    cfg = EngineConfig(num_pages=a.seqs * (a.prompt_len + a.steps + 32) // 16 + 8, page_size=16, max_num_seqs=a.seqs,
                       max_num_batched_tokens=max(2048, a.seqs * a.prompt_len))
    engine = Engine(model, tok, cfg)
    rng = random.Random(0)
    vocab = engine.vocab_size
    prompts = [[rng.randrange(100, vocab) for _ in range(a.prompt_len)] for _ in range(a.seqs)]
    mixed = [("plain", "penalised", "logprobs", "grammar")[i % 4] for i in range(a.seqs)]
    # compiles the grammar (cached from then on: the timed runs never wait for it), warms the caches
    engine.add_request("warm", prompts[0], params("grammar", 0, 4))
    while engine.has_unfinished():
        engine.step()
    run(engine, prompts[:4], mixed[:4], 2, "warm")
    plain_t, mixed_t = [], []
    for r in range(a.repeat):
        plain_t.append(run(engine, prompts, ["plain"] * a.seqs, a.steps, f"p{r}"))
        mixed_t.append(run(engine, prompts, mixed, a.steps, f"m{r}"))
    (p, ps), (m, ms) = (tuple(statistics.median(x) for x in zip(*t)) for t in (plain_t, mixed_t))
    print(f"model {a.model}, {a.seqs} sequences decoding, prompt {a.prompt_len} tokens, {a.steps} steps x {a.repeat} rounds, "
          f"{torch.get_num_threads()} threads")
    print("| batch | step ms (median) | ratio | of it, sampling stage ms |")
    print("| --- | --- | --- | --- |")
    print(f"| plain | {p * 1e3:.1f} | 1.00 | {ps * 1e3:.2f} |")
    print(f"| mixed (1/4 each: plain, penalised, logprobs, grammar) | {m * 1e3:.1f} | {m / p:.3f} | {ms * 1e3:.2f} |")


if __name__ == "__main__":
    main()
