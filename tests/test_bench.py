"""The benchmark cannot rot: ``scripts/bench.py --quick`` runs every system on the tiny
config and prints its tables (speed is not asserted: CI machines are shared)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

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
    assert "throughput vs concurrent requests" in out and "throughput vs prompt length" in out
    # vLLM is optional: a Python without it is skipped cleanly, not a failure
    assert "skipped: tiny vllm:" in out
    assert png.exists() and png.stat().st_size > 0
    data = json.loads(js.read_text())
    engine = next(r for r in data["results"] if r["system"] == "engine")
    assert engine["out_tokens"] > 0 and engine["tok_s"] > 0
    assert 0 <= engine["kv_waste_peak"] <= engine["kv_waste_bound"] + 1e-9  # at most one partial page per sequence
    assert {s["value"] for s in data["sweeps"]["concurrency"]} == {1, 4}
