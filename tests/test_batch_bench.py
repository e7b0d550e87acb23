"""``scripts/bench_batch.py`` cannot rot: a few requests each way, its table printed (speed is not
asserted here: the figures come from a full run under ``flock /tmp/bench.lock``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_batch_bench_runs(tmp_path, redis_url):
    js = tmp_path / "b.json"
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_batch.py"), "--requests", "12",
                           "--idle-probes", "2", "--probe-every", "0.2", "--redis-url", redis_url, "--json", str(js)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "| way | output tok/s | wall s | client / gateway CPU s | high-probe TTFT mean / p90 |" in proc.stdout
    assert "batch / direct throughput:" in proc.stdout
    data = json.loads(js.read_text())
    assert data["direct"][0]["tokens"] == data["batch"][0]["tokens"] > 0  # the same work both ways
    assert len(data["idle_ttft"]) >= 2
