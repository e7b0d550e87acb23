"""The benchmark cannot rot: ``scripts/bench.py --quick`` runs every system on the tiny
config and prints its tables (speed is not asserted: CI machines are shared)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_quick_bench_prints_the_tables(tmp_path):
    png, js = tmp_path / "bench.png", tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench.py"), "--quick", "--no-progress", "--plot", str(png),
         "--json", str(js), "--vllm-python", str(tmp_path / "no-such-python")],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "| config | system | requests | output tok/s | × engine | TTFT mean ms | TTFT p99 ms | ITL mean ms | ITL p99 ms |" in out
    rows = {line.split("|")[2].strip() for line in out.splitlines() if line.startswith("| tiny |")}
    assert {"engine", "ideal", "hf-static", "hf-cb", "hf-single"} <= rows, out
    assert "| tiny | engine | 8 |" in out and "| 1.00 |" in out  # the engine is its own baseline
    assert "KV waste at peak" in out and "sched + batch share" in out
    assert "| MFU | of ceiling |" in out and "- tiny: **" in out  # the ceiling per config (bench_flops.ceiling_s)
    assert "throughput vs concurrent requests" in out and "throughput vs prompt length" in out
    # vLLM is optional: a Python without it is skipped cleanly, not a failure
    assert "skipped: tiny vllm:" in out
    assert png.exists() and png.stat().st_size > 0
    data = json.loads(js.read_text())
    engine = next(r for r in data["results"] if r["system"] == "engine")
    assert engine["out_tokens"] > 0 and engine["tok_s"] > 0 and engine["kv_bytes"] > 0
    assert 0 <= engine["kv_waste_peak"] <= engine["kv_waste_bound"] + 1e-9  # at most one partial page per sequence
    assert {s["value"] for s in data["sweeps"]["concurrency"]} == {1, 4}


def test_the_ceiling_counts_every_decode_read():
    """The ceiling's K/V bytes are what decode attention reads: each output token after the first
    attends its prompt, the outputs before it and itself (fewer slots in a sliding-window layer)."""
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM

    sys.path.insert(0, str(ROOT / "scripts"))
    from bench_flops import ceiling_s, workload_kv_bytes

    llama = LlamaForCausalLM(LlamaConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                                         num_hidden_layers=2, intermediate_size=64, vocab_size=100))
    # a request of 3 prompt tokens and 3 outputs: outputs 2 and 3 are fed, attending 4 and 5
    # slots; one of 1 output decodes nothing. K and V of 2 kv heads x 8 dims, float32: 128 bytes
    # a token and layer, 2 layers
    workload = [([1, 2, 3], 3), ([4] * 5, 1)]
    assert workload_kv_bytes(llama, workload) == 2 * 128 * (4 + 5)
    assert workload_kv_bytes(llama.to(torch.bfloat16), workload) == 2 * 64 * (4 + 5)
    gemma = Gemma3ForCausalLM(Gemma3TextConfig(
        hidden_size=32, num_attention_heads=4, num_key_value_heads=1, head_dim=8, num_hidden_layers=2,
        intermediate_size=64, vocab_size=100, sliding_window=4, layer_types=["sliding_attention", "full_attention"]))
    per = 2 * 1 * 8 * 4  # K and V of 1 kv head x 8 dims, float32
    assert workload_kv_bytes(gemma, workload) == per * (4 + 4) + per * (4 + 5)  # the window caps 5 slots at 4
    # linears at the peak, then the reads at the read rate: 2 GFLOP at 100 GFLOP/s + 3 GB at 10 GB/s
    assert abs(ceiling_s(2e9, 3e9, 100.0, 10.0) - 0.32) < 1e-12
    assert ceiling_s(2e9, 3e9, 0.0, 10.0) == 0.0  # no yardstick, no ceiling


def test_the_memory_read_outsizes_the_cpus_caches():
    """The read rate the ceiling uses must come from memory, not from a last-level cache that
    holds the whole buffer (a 300 MiB L3 read a 256 MB sum at twice its memory's rate).

    The yardstick is what util-linux's lscpu reports for one instance of each cache (the
    kernel's view), not the C library's ``getconf LEVEL3_CACHE_SIZE``: that asks CPUID, which on
    an AMD EPYC virtual machine reported the host's 256 MiB where the machine has 32 MiB (a
    plain read of 256 MB there ran at the memory's rate, 28-37 GB/s)."""
    sys.path.insert(0, str(ROOT / "scripts"))
    from bench_flops import last_level_cache_bytes, read_mbytes

    lscpu = shutil.which("lscpu")
    done = subprocess.run([lscpu, "--caches=ONE-SIZE", "--bytes"], capture_output=True, text=True) if lscpu else None
    sizes = [int(x) for x in done.stdout.split() if x.isdigit()] if done and done.returncode == 0 else []  # (a header, then sizes)
    if not sizes:
        pytest.skip("lscpu does not report the caches here")
    assert last_level_cache_bytes() == max(sizes)
    assert read_mbytes("cpu") * 2**20 >= 4 * max(sizes)
    assert read_mbytes("cuda") == 256


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="per-thread CPU time comes from Linux's /proc")
def test_the_cpu_lines_find_a_busy_thread():
    """bench_cpu (the through-Redis run's CPU per thread) sees a thread that kept a core busy
    as that, tells it from the process's main thread, and leaves out a process that is gone."""
    import os
    import threading
    import time

    sys.path.insert(0, str(ROOT / "scripts"))
    from bench_cpu import line, snapshot, threads_used

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    pids = {"me": os.getpid(), "gone": dead.pid}
    before = snapshot(pids)
    assert before and all(label == "me" for label, _ in before)
    ident: list[int] = []
    spun, done = threading.Event(), threading.Event()

    def spin() -> None:  # a core's worth for 0.4 s of this thread's own CPU time, then alive until told
        ident.append(threading.get_native_id())
        end = time.thread_time() + 0.4
        while time.thread_time() < end:
            pass
        spun.set()
        done.wait()

    t0 = time.perf_counter()
    worker = threading.Thread(target=spin)
    worker.start()
    spun.wait()
    rows = threads_used(before, snapshot(pids), pids, time.perf_counter() - t0)
    done.set()
    worker.join()
    busy = [r for r in rows if r["tid"] == ident[0]]
    assert busy and busy[0]["thread"] == "thread" and busy[0]["core_share"] >= 0.5, rows
    assert all(r["process"] == "me" for r in rows)
    assert "me thread" in line(rows)
