#!/usr/bin/env python
"""Exactness check for engine speed work: greedy ``Engine.generate`` must equal
transformers' ``generate`` on each prompt alone, token for token, in float64, on tiny
Llama / Qwen2 / Qwen3 (mixed full and sliding-window layers) / Mistral (sliding window),
with batch shapes that exercise every attention path: chunked prefill, many decodes at
once (in-place and gathered decode pages), and preemption (a cache too small for all;
recompute and swap).

    python scripts/bench_parity.py            # all families, about a minute
    python scripts/bench_parity.py llama      # one family
"""

from __future__ import annotations

import copy
import os
import random
import sys
import time
import zlib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402
from tiny import tiny_model  # noqa: E402

from common.protocol import SamplingParams  # noqa: E402
from worker import runner  # noqa: E402
from worker.engine import Engine, EngineConfig  # noqa: E402

DEFAULT_FACTOR = runner.IN_PLACE_FACTOR

FAMILIES = ("llama", "qwen2", "qwen3", "mistral")
# (name, engine config, prompts, prompt lengths, max_tokens range, decode pages in place: None = engine's choice)
PREEMPT = dict(page_size=8, num_pages=36, max_num_seqs=6, max_num_batched_tokens=48)
CASES = [
    ("chunked+preempt", PREEMPT, 10, (1, 150), (20, 80), None),
    ("  ... gathered", PREEMPT, 10, (1, 150), (20, 80), False),
    ("  ... in place", PREEMPT, 10, (1, 150), (20, 80), True),
    ("  ... swap", dict(PREEMPT, preemption_mode="swap", swap_pages=64), 10, (1, 150), (20, 80), None),
    ("many decodes", dict(page_size=16, num_pages=600, max_num_seqs=32, max_num_batched_tokens=512), 32, (1, 120), (1, 30), None),
    ("page 1 / 3", dict(page_size=3, num_pages=400, max_num_seqs=8, max_num_batched_tokens=40), 8, (1, 90), (1, 25), None),
]


def reference(model, prompt, n):
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False, pad_token_id=0,
                         eos_token_id=None)
    return out[0, len(prompt):].tolist()


def check(family: str, seed: int = 0) -> list[str]:
    model = tiny_model(family, dtype=torch.float64, seed=seed)
    ref_model = copy.deepcopy(model)
    failures = []
    for name, cfg, n, plen, olen, in_place in CASES:
        runner.IN_PLACE_FACTOR = {None: DEFAULT_FACTOR, False: 0.0, True: float("inf")}[in_place]
        rng = random.Random(zlib.crc32(f"{family} {n} {plen} {olen} {seed}".encode()))  # same prompts for every variant
        prompts = [[rng.randrange(3, 512) for _ in range(rng.randint(*plen))] for _ in range(n)]
        outs = [rng.randint(*olen) for _ in range(n)]
        engine = Engine(model, None, EngineConfig(check_invariants=True, **cfg))
        got = engine.generate(prompts, [SamplingParams(max_tokens=o, temperature=0, ignore_eos=True) for o in outs])
        bad = [i for i, (p, o) in enumerate(zip(prompts, outs)) if got[i] != reference(ref_model, p, o)]
        pre = engine.stats.num_preemptions
        status = "ok" if not bad else f"MISMATCH in requests {bad}"
        print(f"{family:8s} {name:16s} {n} requests, {engine.stats.num_steps} steps, {pre} preemptions: {status}", flush=True)
        if bad:
            failures.append(f"{family} {name}: {bad}")
    runner.IN_PLACE_FACTOR = DEFAULT_FACTOR
    return failures


def main(argv=None) -> int:
    fams = (argv if argv is not None else sys.argv[1:]) or FAMILIES
    t = time.time()
    failures = [f for fam in fams for f in check(fam)]
    print(f"{'FAILED' if failures else 'all equal'} ({time.time() - t:.0f} s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
