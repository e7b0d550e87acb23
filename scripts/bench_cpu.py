"""Where a through-Redis run's cores went: each thread's CPU time (Linux ``/proc``) of the
worker, redis-server and the reading client over the run.

On the 2-core bench machine the worker's two math threads share the cores with the client
that reads the results, redis-server and the worker's own writer thread. A math thread that
one of them preempts holds up every parallel region it is part of, so a few percent of a core
spent beside the engine costs the engine more than that: these lines show how much ran
beside it (docs/performance-log.md, thirty-second session).
"""

from __future__ import annotations

import os
from pathlib import Path

# (process label, thread id) -> (CPU seconds, voluntary context switches, involuntary ones)
Snapshot = dict[tuple[str, int], tuple[float, int, int]]
_HZ = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def snapshot(pids: dict[str, int]) -> Snapshot:
    """Every thread of each process in ``pids`` (label -> pid); a process not on this machine
    (a remote Redis) or gone is left out."""
    out: Snapshot = {}
    for label, pid in pids.items():
        tasks = Path(f"/proc/{pid}/task")
        try:
            tids = [int(t.name) for t in tasks.iterdir()]
        except OSError:
            continue
        for tid in tids:
            try:
                stat = (tasks / str(tid) / "stat").read_text().rsplit(")", 1)[1].split()
                status = (tasks / str(tid) / "status").read_text().splitlines()
            except OSError:
                continue
            switches = dict(line.split(":", 1) for line in status if "ctxt_switches" in line)
            out[label, tid] = ((int(stat[11]) + int(stat[12])) / _HZ, int(switches["voluntary_ctxt_switches"]),
                               int(switches["nonvoluntary_ctxt_switches"]))
    return out


def threads_used(before: Snapshot, after: Snapshot, pids: dict[str, int], wall_s: float,
                 least: float = 0.01) -> list[dict]:
    """Per thread that used at least ``least`` of a core over ``wall_s``: its process, ``main``
    (the process's first thread) or ``thread``, its share of one core and its context switches
    (voluntary: it waited; involuntary: it was preempted), busiest first within a process."""
    if wall_s <= 0:
        return []
    rows = []
    for (label, tid), (cpu, vol, invol) in after.items():
        cpu0, vol0, invol0 = before.get((label, tid), (0.0, 0, 0))  # a thread started during the run: all of it
        share = (cpu - cpu0) / wall_s
        if share >= least:
            rows.append({"process": label, "thread": "main" if tid == pids[label] else "thread", "tid": tid,
                         "core_share": round(share, 3), "waits": vol - vol0, "preempted": invol - invol0})
    order = list(pids)
    return sorted(rows, key=lambda r: (order.index(r["process"]), r["thread"] != "main", -r["core_share"]))


def line(rows: list[dict]) -> str:
    """One line: each thread's share of a core, waits and preemptions."""
    return "; ".join(f"{r['process']} {r['thread']} {r['core_share']:.0%} ({r['waits']} waits, {r['preempted']} preempted)"
                     for r in rows)
