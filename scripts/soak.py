#!/usr/bin/env python
"""Soak: chaos + overload + hostile input + Redis faults at once, then a table of what survived.

    .venv/bin/python scripts/soak.py --minutes 5

Starts a private redis-server (AOF, fsync always) and a fleet of real workers on the tiny test
model (float64, so greedy output can be checked exactly against transformers' generate), keeps
a standing backlog of greedy requests of mixed priority and length (more than the fleet can
serve: an overload), mixes in hostile entries, and every ``--fault-every`` seconds injects a
fault: SIGKILL of a random worker (a replacement is started), CLIENT KILL of every connection,
a Redis restart (SIGKILL; AOF keeps what was acknowledged) or a Redis stall longer than the
workers' socket timeout. At the end every request is read the way a client reads it and
checked: exactly one final entry, each seq once and in order, output equal to the reference.

Nothing here needs the shared Redis or a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import redis  # noqa: E402
from reliability import LEVELS, Fleet, Reference, Spec, Tally, check_stream, decode, pending_total, submit  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn  # noqa: E402
from rich.table import Table  # noqa: E402

from common.keys import Keys  # noqa: E402
from common.local_redis import LocalRedis  # noqa: E402
from common.protocol import reply_key_for  # noqa: E402

CAPS = ["--max-prompt-chars", "2000", "--max-input-ids", "256", "--max-tokens-limit", "128"]
FAULTS = ("worker SIGKILL", "connections killed", "Redis restart (AOF)", "Redis stall 6 s")


def hostile_entry(rng: random.Random, n: int) -> dict:
    """One bad (or odd) request entry; ids are unique so every answer can be found."""
    rid = f"bad{n}"
    base = {"id": rid, "prompt": "hello", "max_tokens": "3"}
    kind = rng.randrange(14)
    if kind == 0:
        return {rng.randbytes(rng.randint(1, 8)): rng.randbytes(rng.randint(0, 40)) for _ in range(rng.randint(1, 4))}
    if kind == 1:
        return {**base, "prompt": "x" * rng.choice([2001, 100_000, 3_000_000])}
    if kind == 2:
        return {**base, "max_tokens": rng.choice(["129", "9" * 300, "-1", "1e9", "ten", ""])}
    if kind == 3:
        return {"id": rid, "input_ids": "[" * 20_000 + "]" * 20_000}
    if kind == 4:
        return {**base, "prompt": rng.randbytes(20) + b"\xff"}
    if kind == 5:
        return {**base, "id": rng.choice(["a\nb", "\x1b[2J", "../x", "x" * 200, "é", b"\xff"])}
    if kind == 6:
        return {**base, "reply_to": rng.choice(["victim", "other:result:x", "tqsoak:requests:high", ""])}
    if kind == 7:
        return {"id": rid, "messages": json.dumps([{"role": "wizard", "content": 3}])}
    if kind == 8:
        return {"payload": rng.randbytes(rng.randint(1, 60))}
    if kind == 9:
        return {**base, "temperature": rng.choice(["nan", "inf", "-1", "1e-300"]), "top_p": rng.choice(["0", "2", "1e-9"])}
    if kind == 10:
        return {**base, "stop": json.dumps(["s"] * 100)}
    if kind == 11:
        return {**base, "input_ids": json.dumps([rng.randrange(-10, 10**6) for _ in range(5)]), "prompt": None}
    if kind == 12:
        return {**base, "timeout_s": rng.choice(["0", "-5", "1e999", "soon"])}
    return {"id": rid}  # nothing to generate from


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=5.0, help="how long to inject faults and load")
    ap.add_argument("--workers", type=int, default=3)
    ap.add_argument("--depth", type=int, default=60, help="standing backlog of good requests (the overload)")
    ap.add_argument("--fault-every", type=float, default=6.0, help="seconds between faults")
    ap.add_argument("--bad-per-s", type=float, default=4.0, help="hostile entries per second")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default="", help="model directory (default: build the tiny test model)")
    ap.add_argument("--markdown", action="store_true", help="also print the table as Markdown (for the README)")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    console = Console(width=max(100, Console().width))
    work = Path(tempfile.mkdtemp(prefix="tokenq-soak-"))
    if args.model:
        model = args.model
    else:
        from tiny import save_tiny

        model = save_tiny(work / "tiny")
    ref = Reference(model)
    server = LocalRedis(appendonly=True).start()
    prefix = "tqsoak"
    keys = Keys(prefix)
    r = redis.Redis.from_url(server.url, retry_on_error=[redis.ConnectionError, redis.TimeoutError],
                             retry=redis.retry.Retry(redis.backoff.ExponentialBackoff(cap=1.0), 20))
    fleet = Fleet(prefix, model, server.url, work, seed=args.seed, args=[
        "--max-attempts", "100", "--max-num-seqs", "8", "--claim-idle-s", "2", "--aging-s", "3", *CAPS])
    specs: list[Spec] = []
    bad: list[tuple[str, dict]] = []  # (entry id, fields)
    faults: Counter = Counter()
    t_start = time.monotonic()
    try:
        console.print(f"[bold]soak[/]: {args.workers} workers, {args.minutes} min, redis {server.url}, logs in {work}")
        fleet.start(args.workers, ready=True)
        duration = args.minutes * 60
        next_fault = time.monotonic() + args.fault_every
        next_bad = time.monotonic()
        cols = [TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(), TimeRemainingColumn(),
                TextColumn("{task.fields[info]}")]
        with Progress(*cols, console=console) as bar:
            task = bar.add_task("chaos + overload", total=duration, info="")
            t0 = time.monotonic()
            while (elapsed := time.monotonic() - t0) < duration:
                # overload: keep a standing backlog of good requests
                try:
                    queued = sum(r.xlen(keys.requests(level)) for level in LEVELS)
                    for _ in range(max(0, args.depth - queued)):
                        n = len(specs)
                        s = Spec(f"g{n}", rng.choice(LEVELS), [rng.randrange(6, 512) for _ in range(rng.randint(2, 40))],
                                 rng.randint(2, 60), timeout_s=rng.choice([None, None, None, 8.0]))
                        submit(r, prefix, s)
                        specs.append(s)
                    # hostile input
                    while time.monotonic() >= next_bad:
                        fields = {k: v for k, v in hostile_entry(rng, len(bad)).items() if v is not None}
                        entry = r.xadd(keys.requests(rng.choice(LEVELS)), fields).decode()
                        bad.append((entry, fields))
                        next_bad += 1.0 / args.bad_per_s
                except redis.RedisError:
                    pass  # Redis is restarting: the producer retries next round
                # faults
                if time.monotonic() >= next_fault:
                    kind = rng.choice(FAULTS)
                    if kind == "worker SIGKILL":
                        try:
                            fleet.chaos()
                        except redis.RedisError:
                            continue  # Redis is restarting: try again next round
                    elif kind == "connections killed":
                        try:
                            r.execute_command("CLIENT", "KILL", "TYPE", "normal")
                        except redis.RedisError:
                            pass
                    elif kind == "Redis restart (AOF)":
                        server.restart(kill=True)
                    else:
                        try:
                            r.execute_command("CLIENT", "PAUSE", "6000", "ALL")
                        except redis.RedisError:
                            pass
                    faults[kind] += 1
                    next_fault = time.monotonic() + args.fault_every
                info = f"sent {len(specs)} good, {len(bad)} bad; faults {sum(faults.values())}; workers alive {len(fleet.alive)}"
                bar.update(task, completed=elapsed, info=info)
                time.sleep(0.1)
            bar.update(task, completed=duration)
            # read everything as a client would
            check = bar.add_task("checking results", total=len(specs) + len(bad), info="")
            tally = Tally()
            timeouts = 0
            ttft_high: list[float] = []
            for s in specs:
                ids, final = check_stream(r, keys.result(s.id), tally, None, expect_reason=None, timeout=300)
                if final is not None and final.get("finish_reason") == "timeout" and s.timeout_s is not None:
                    timeouts += 1
                    if ids:
                        tally.wrong_output += 1
                        tally.note(f"{s.id}: timed out after {len(ids)} tokens")
                elif final is not None:
                    if ids != ref(s.input_ids, s.max_tokens) or final.get("finish_reason") != "length":
                        tally.wrong_output += 1
                        tally.note(f"{s.id}: {final}")
                    if s.level == "high" and final.get("ttft_s"):
                        ttft_high.append(float(final["ttft_s"]))
                bar.advance(check)
            bad_answered, bad_done = 0, 0
            dead = {decode(f).get("entry_id") for _, f in r.xrange(keys.dead)}
            for entry, fields in bad:
                rid, reply = reply_key_for(fields, entry, keys)
                final = None
                if reply is not None:
                    deadline = time.monotonic() + 60
                    while final is None and time.monotonic() < deadline:
                        final = next((decode(f) for _, f in r.xrange(reply) if decode(f)["type"] in ("done", "error")), None)
                        if final is None:
                            time.sleep(0.2)
                if final is not None or entry in dead:
                    bad_answered += 1
                    bad_done += final is not None and final["type"] == "done"
                bar.advance(check)
        pend = pending_total(r, prefix)
        crashes = fleet.crashes()
        rss = []
        for w in fleet.alive:
            try:
                status = Path(f"/proc/{w.proc.pid}/status").read_text()
                rss.append(int(next(ln for ln in status.splitlines() if ln.startswith("VmRSS:")).split()[1]) / 1024)
            except (OSError, StopIteration):
                pass
        levels = Counter(s.level for s in specs)
        table = Table(title=f"tokenq soak: {args.minutes:g} min, {args.workers} workers, tiny model, private Redis (AOF)")
        table.add_column("what")
        table.add_column("count", justify="right")
        table.add_row("faults injected", f"{sum(faults.values())}  ({', '.join(f'{k}: {v}' for k, v in sorted(faults.items()))})")
        table.add_row("requests sent", f"{len(specs)}  (high {levels['high']}, normal {levels['normal']}, low {levels['low']})")
        table.add_row("requests lost", str(tally.lost))
        table.add_row("second final entries", str(tally.finals_extra))
        table.add_row("duplicate tokens seen by clients", str(tally.duplicate_tokens_seen + tally.mismatched_resends))
        table.add_row("wrong greedy outputs", str(tally.wrong_output))
        table.add_row("timed out (timeout_s=8 while queued)", str(timeouts))
        table.add_row("re-sent token entries (exact, dropped by clients)", str(tally.raw_resends))
        table.add_row("bad inputs tried", f"{len(bad)}  (answered: {bad_answered}; valid after all: {bad_done})")
        table.add_row("crashes", str(len(crashes)))
        table.add_row("pending at the end", str(pend))
        if ttft_high:
            table.add_row("high-priority TTFT p50 / max (s)", f"{statistics.median(ttft_high):.3f} / {max(ttft_high):.3f}")
        if rss:
            table.add_row("worker RSS at the end (MiB)", f"{max(rss):.0f}")
        table.add_row("wall time (s)", f"{time.monotonic() - t_start:.0f}")
        console.print(table)
        if args.markdown:
            print("\n| what | count |\n|---|---:|")
            for row in zip(*(c.cells for c in table.columns)):
                print(f"| {row[0]} | {row[1]} |")
        for p in tally.problems:
            console.print(f"[red]{p}[/]")
        for c in crashes:
            console.print(f"[red]crash[/]: {c}")
        ok = tally.ok and not crashes and bad_answered == len(bad) and pend == 0
        console.print("[green]OK[/]" if ok else "[red]FAILED[/]")
        return 0 if ok else 1
    finally:
        fleet.close()
        server.cleanup()


if __name__ == "__main__":
    sys.exit(main())
