"""The demo: a worker on the default model, requests of mixed priority, answers streamed live.

Run it with ./scripts/demo.sh (which sets up the environment and Redis first).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import redis  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.live import Live  # noqa: E402
from rich.table import Table  # noqa: E402

from producer import Client  # noqa: E402

QUESTIONS = [
    ("low", "Write a short story about a lighthouse keeper who befriends a seagull."),
    ("low", "Explain how a bicycle stays upright, in simple terms."),
    ("normal", "Give three tips for writing clear emails."),
    ("low", "Describe the water cycle to a ten-year-old."),
    ("high", "What is the capital of France? Answer in one sentence."),
]


def start_worker(url: str, prefix: str, model: str, log_path: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "worker.main", "--model", model, "--redis-url", url, "--prefix", prefix,
           "--name", "demo-worker", "--max-num-seqs", "8", "--kv-cache-memory", "0.25", "--heartbeat-s", "0.5"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error", "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(cmd, cwd=ROOT, stdout=open(log_path, "w"), stderr=subprocess.STDOUT, env=env)


def wait_ready(r: redis.Redis, key: str, proc: subprocess.Popen, log_path: Path, console: Console) -> None:
    with console.status("starting the worker (the first run converts the GGUF model once, about 20 s)..."):
        while not r.exists(key):
            if proc.poll() is not None:
                console.print(log_path.read_text()[-3000:])
                raise SystemExit(f"the worker exited with {proc.returncode}")
            time.sleep(0.2)


def view(rows: list[dict]) -> Table:
    t = Table(title="tokenq demo: answers streaming from the worker", expand=True, show_lines=True)
    t.add_column("priority", width=8)
    t.add_column("question", ratio=1)
    t.add_column("answer (streaming)", ratio=2)
    t.add_column("status", width=16)
    for row in rows:
        h = row["handle"]
        status = h.finish_reason or f"{len(h.token_ids)} tokens"
        style = {"high": "bold red", "normal": "yellow", "low": "dim"}[row["priority"]]
        t.add_row(f"[{style}]{row['priority']}[/]", row["question"], h.text, status)
    return t


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="smollm2", help="model for the worker (default: the bundled SmolLM2-135M-Instruct)")
    ap.add_argument("--max-tokens", type=int, default=96)
    args = ap.parse_args()
    url = os.environ.get("TOKENQ_REDIS_URL", "redis://localhost:6379/0")
    prefix = f"tokenq-demo-{os.getpid()}"
    console = Console()
    log_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"{prefix}-worker.log"
    r = redis.Redis.from_url(url)
    proc = start_worker(url, prefix, args.model, log_path)
    client = Client(url, prefix)
    try:
        wait_ready(r, f"{prefix}:worker:demo-worker", proc, log_path, console)
        rows = []
        for level, question in QUESTIONS:  # the high-priority question is sent last, yet answered first
            h = client.submit(messages=[{"role": "user", "content": question}], max_tokens=args.max_tokens,
                              temperature=0, priority=level)
            rows.append({"priority": level, "question": question, "handle": h})
        with Live(view(rows), console=console, refresh_per_second=12) as live:
            while not all(row["handle"].done for row in rows):
                for row in rows:
                    row["handle"].poll()
                live.update(view(rows))
                time.sleep(0.05)
        if not console.is_terminal:
            console.print()  # Live leaves its last frame without a newline when output is a file or pipe
        summary = Table(title="timings (from enqueue)")
        for col in ("priority", "time to first token", "tokens", "total", "finish"):
            summary.add_column(col)
        for row in rows:
            res = row["handle"].result()
            summary.add_row(row["priority"], f"{res.timings.ttft_s:.2f} s", str(res.usage.completion_tokens),
                            f"{res.timings.total_s:.2f} s", res.finish_reason)
        console.print(summary)
        console.print(f"worker log: {log_path}")
        return 0
    finally:
        client.close()
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        for key in r.scan_iter(match=f"{prefix}:*"):
            r.delete(key)


if __name__ == "__main__":
    sys.exit(main())
