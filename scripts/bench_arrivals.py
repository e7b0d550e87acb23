"""Requests arriving while others run: steps of every size, as a serving worker sees them.

bench.py's workloads arrive all at once, so their steps have few distinct sizes: full
prefill steps, then decodes of 64, 63, ... sequences (every decode size is run at the
engine's start). Here a request arrives before each step with probability 1/2 (prompts 16-512
tokens, outputs 16-128), so mixed steps come in almost every size up to the step budget.
oneDNN builds a kernel for each new row count of each GEMM shape, and its cache holds 1,024:
the engine pads steps of sizes not run at start to a multiple of ``compiled.ROW_STEP`` rows
(worker/compiled.py). This runs the workload with that padding (16) and without it (1), each
in a process of its own (oneDNN's cache is per process), one after the other, and prints
output tok/s per round.

    python scripts/bench_arrivals.py [--configs tiny,smollm2] [--dtype bfloat16] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time


def serve(config: str, dtype: str, row_step: int, rounds: int, requests: int, seed: int) -> list[dict]:
    """In this process: the engine on ``rounds`` rounds of arriving requests; per round its figures."""
    import torch
    from bench import build_model

    from common.protocol import SamplingParams
    from worker import compiled
    from worker.config import EngineConfig
    from worker.engine import Engine

    compiled.ROW_STEP = row_step
    model, _ = build_model(config, dtype=getattr(torch, dtype))
    engine = Engine(model, None, EngineConfig(num_pages=requests * 40, max_num_seqs=64, max_num_batched_tokens=2048,
                                              check_invariants=False))
    rng = random.Random(seed)
    vocab = model.config.vocab_size
    out = []
    for r in range(rounds):
        t, tokens, added, steps, sizes = time.perf_counter(), 0, 0, 0, set()
        while added < requests or engine.has_unfinished():
            if added < requests and rng.random() < 0.5:
                prompt = [rng.randrange(vocab) for _ in range(rng.randint(16, 512))]
                engine.add_request(f"{r}-{added}", prompt, SamplingParams(max_tokens=rng.randint(16, 128), temperature=0.0,
                                                                          ignore_eos=True))
                added += 1
            tokens += sum(len(o.new_token_ids) for o in engine.step())
            sizes.add(engine.stats.last_batch_tokens)
            steps += 1
        wall = time.perf_counter() - t
        out.append({"round": r, "tokens": tokens, "steps": steps, "sizes": len(sizes), "wall_s": wall, "tok_s": tokens / wall})
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default="tiny,smollm2")
    ap.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--requests", type=int, default=150, help="requests a round")
    ap.add_argument("--serve", nargs=2, metavar=("CONFIG", "ROW_STEP"), help=argparse.SUPPRESS)  # the child process
    args = ap.parse_args()
    if args.serve:
        print(json.dumps(serve(args.serve[0], args.dtype, int(args.serve[1]), args.rounds, args.requests, seed=5)))
        return 0
    print(f"| config | {args.dtype} | round | steps | step sizes | output tokens | padded to 16: tok/s | unpadded: tok/s | ratio |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for config in args.configs.split(","):
        runs = {}
        for step in (16, 1):
            cmd = [sys.executable, __file__, "--serve", config, str(step), "--dtype", args.dtype, "--rounds",
                   str(args.rounds), "--requests", str(args.requests)]
            runs[step] = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.splitlines()[-1])
        for a, b in zip(runs[16], runs[1]):
            assert a["tokens"] == b["tokens"], "the two runs served different work"
            print(f"| {config} | | {a['round']} | {a['steps']} | {a['sizes']} | {a['tokens']:,} | {a['tok_s']:,.0f} | "
                  f"{b['tok_s']:,.0f} | {a['tok_s'] / b['tok_s']:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
