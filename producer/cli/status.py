"""``tokenq status``: queue depths, in-flight work, dead letters and live workers."""

from __future__ import annotations

import argparse
import json
import math
import time
from typing import Any

import redis

from common.keys import LEVELS, Keys
from common.protocol import parse_heartbeat
from producer.cli.registry import EXIT_OK, UsageError, command, connect_checked, positive_float, settings_of


def gather_status(r: redis.Redis, keys: Keys) -> dict[str, Any]:
    """Queue depth, pending and waiting per priority, dead letters and worker heartbeats."""
    queues: dict[str, Any] = {}
    for level in LEVELS:
        stream = keys.requests(level)
        q: dict[str, Any] = {"length": int(r.xlen(stream)), "pending": None, "waiting": None, "group": False,
                             "consumers": {}}
        try:
            groups = r.xinfo_groups(stream)
        except redis.ResponseError:  # no such stream yet
            groups = []
        for g in groups:
            if _s(g.get("name", b"")) != keys.group:
                continue
            q["group"] = True
            lag = g.get("lag")
            try:
                summary = r.xpending(stream, keys.group)
            except redis.ResponseError:
                summary = {"pending": g.get("pending", 0), "consumers": []}
            q["pending"] = int(summary.get("pending") or 0)
            q["consumers"] = {_s(c["name"]): int(c["pending"]) for c in summary.get("consumers") or []}
            q["waiting"] = int(lag) if lag is not None else max(0, q["length"] - q["pending"])
        if not q["group"]:
            q["pending"], q["waiting"] = 0, q["length"]
        queues[level] = q
    workers = []
    worker_keys = sorted(r.scan_iter(match=keys.worker_pattern, count=1000))
    if worker_keys:
        pipe = r.pipeline(transaction=False)
        for k in worker_keys:
            pipe.hgetall(k)
            pipe.ttl(k)
        replies = pipe.execute(raise_on_error=False)
        head = len(keys.worker(""))
        for i, k in enumerate(worker_keys):
            fields, ttl = replies[2 * i], replies[2 * i + 1]
            if not isinstance(fields, dict) or not fields:
                continue  # expired meanwhile, or not a hash
            w = parse_heartbeat(fields)
            w.setdefault("name", _s(k)[head:])
            w["ttl_s"] = ttl if isinstance(ttl, int) else None
            workers.append(w)
    return {
        "prefix": keys.prefix,
        "time": time.time(),
        "queues": queues,
        "dead": int(r.xlen(keys.dead)),
        "workers": workers,
    }


def _num(v: Any) -> float | None:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


def _int_text(v: Any) -> str:
    f = _num(v)
    return "-" if v is None else (str(int(f)) if f is not None else str(v))


def _hit_rate(w: dict[str, Any]) -> str:
    """Prefix-cache hits / queries (tokens) of a heartbeat, as a percentage."""
    q, h = _num(w.get("prefix_cache_queries")), _num(w.get("prefix_cache_hits"))
    return f"{100 * h / q:.0f}%" if q and h is not None else "-"


def render_status(st: dict[str, Any]) -> Any:
    from rich.console import Group
    from rich.table import Table

    qt = Table(title=f"tokenq queues  (prefix {st['prefix']!r})", title_justify="left")
    for col in ("priority", "queued", "waiting", "in flight", "by worker"):
        qt.add_column(col, justify="left" if col in ("priority", "by worker") else "right")
    for level, q in st["queues"].items():
        by = ", ".join(f"{n}: {c}" for n, c in sorted(q["consumers"].items()) if c) or "-"
        qt.add_row(level, str(q["length"]), _int_text(q["waiting"]), _int_text(q["pending"]), by)
    total = sum(q["length"] for q in st["queues"].values())
    inflight = sum(q["pending"] or 0 for q in st["queues"].values())
    qt.caption = f"{total} queued, {inflight} in flight, {st['dead']} dead-lettered"
    qt.caption_justify = "left"

    wt = Table(title=f"workers ({len(st['workers'])} live)", title_justify="left")
    for col in ("name", "model", "device", "KV pages free", "running", "waiting", "tok/s", "prefix hits", "last step"):
        wt.add_column(col, justify="left" if col in ("name", "model", "device") else "right")
    now = st["time"]
    for w in st["workers"]:
        free, tot = _num(w.get("pages_free")), _num(w.get("pages_total"))
        if free is not None and tot:
            pages = f"{int(free)}/{int(tot)} ({100 * free / tot:.0f}%)"
        else:
            pages = f"{w.get('pages_free', '-')}/{w.get('pages_total', '-')}"
        tps = _num(w.get("tokens_per_s"))
        last = _num(w.get("last_step"))
        if last is not None and last > 1e9:  # a Unix time
            age = f"{max(0.0, now - last):.1f}s ago"
        else:
            age = str(w.get("last_step", "-"))
        name = str(w.get("name", "?")) + (" (stopping)" if str(w.get("stopping")) in ("1", "true") else "")
        wt.add_row(name, str(w.get("model", "-")), str(w.get("device", "-")), pages,
                   _int_text(w.get("running")), _int_text(w.get("waiting")),
                   "-" if tps is None else f"{tps:.1f}", _hit_rate(w), age)
    if not st["workers"]:
        wt.caption = "no live worker heartbeats"
        wt.caption_justify = "left"
    return Group(qt, wt)


def _status_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--watch", action="store_true", help="refresh continuously (Ctrl-C to stop)")
    p.add_argument("--interval", type=positive_float, default=1.0, help="seconds between refreshes with --watch")
    p.add_argument("--json", action="store_true", help="print the status as JSON")


@command("status", "show queue depths, in-flight work, dead letters and live workers", _status_args)
def cmd_status(args: argparse.Namespace) -> int:
    from rich.console import Console

    if args.watch and args.json:
        raise UsageError("--watch and --json do not go together")
    s = settings_of(args)
    r = connect_checked(s)
    keys = Keys(s.prefix)
    if args.json:
        print(json.dumps(gather_status(r, keys), indent=2))
        return EXIT_OK
    console = Console()
    if not args.watch:
        console.print(render_status(gather_status(r, keys)))
        return EXIT_OK
    from rich.live import Live

    try:
        with Live(render_status(gather_status(r, keys)), console=console, refresh_per_second=4,
                  screen=False) as live:
            while True:
                time.sleep(args.interval)
                live.update(render_status(gather_status(r, keys)))
    except KeyboardInterrupt:
        return EXIT_OK




def _s(v: Any) -> str:
    return v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v)
