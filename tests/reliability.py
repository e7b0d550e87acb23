"""Shared by the reliability tests and scripts/soak.py: request mixes, greedy references from
transformers, a client-side result checker, and a fleet of real workers to SIGKILL at random.

Everything talks to Redis with raw redis-py commands (the public protocol), never through
tokenq client code, so what is checked is what any client would see.
"""

from __future__ import annotations

import json
import os
import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import redis
from helpers import WorkerProcess, read_result, spawn_worker

LEVELS = ("high", "normal", "low")
# One intra-op thread per worker: on small shared machines a second OpenMP thread only waits
# for a core another process holds (10x slower steps with 3 workers on 2 cores).
WORKER_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def decode(fields: dict) -> dict[str, str]:
    return {(k.decode() if isinstance(k, bytes) else k): (v.decode("utf-8", "replace") if isinstance(v, bytes) else v)
            for k, v in fields.items()}


# ---------------------------------------------------------------------------- requests


@dataclass
class Spec:
    """One greedy request: its id, level, prompt ids and length."""

    id: str
    level: str
    input_ids: list[int]
    max_tokens: int
    timeout_s: float | None = None

    def fields(self) -> dict[str, str]:
        f = {"id": self.id, "input_ids": json.dumps(self.input_ids), "max_tokens": str(self.max_tokens),
             "temperature": "0", "ignore_eos": "true"}
        if self.timeout_s is not None:
            f["timeout_s"] = repr(self.timeout_s)
        return f


def mixed_requests(n: int, seed: int = 0, tag: str = "r", prompt_len: tuple[int, int] = (2, 40),
                   max_tokens: tuple[int, int] = (2, 40), vocab: int = 512) -> list[Spec]:
    """``n`` greedy requests of mixed priority, prompt length and output length."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        plen = rng.randint(*prompt_len)
        out.append(Spec(f"{tag}{i}", rng.choice(LEVELS), [rng.randrange(6, vocab) for _ in range(plen)],
                        rng.randint(*max_tokens)))
    return out


def submit(r: redis.Redis, prefix: str, spec: Spec) -> str:
    return r.xadd(f"{prefix}:requests:{spec.level}", spec.fields()).decode()


class Reference:
    """Greedy continuations by transformers' own ``generate``, one request alone at a time."""

    def __init__(self, model_dir: str):
        import torch
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(1)
        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64).eval()
        self.cache: dict[tuple, list[int]] = {}

    def __call__(self, ids: list[int], n: int) -> list[int]:
        key = (tuple(ids), n)
        if key not in self.cache:
            t = self.torch.tensor([ids])
            out = self.model.generate(t, attention_mask=self.torch.ones_like(t), max_new_tokens=n, min_new_tokens=n,
                                      do_sample=False, eos_token_id=None, pad_token_id=0)
            self.cache[key] = out[0, len(ids):].tolist()
        return self.cache[key]


# ---------------------------------------------------------------------------- checking results


@dataclass
class Tally:
    """What clients saw, over many requests."""

    requests: int = 0
    done: int = 0
    errors: int = 0
    lost: int = 0  # no final entry within the deadline
    finals_extra: int = 0  # final entries beyond the first one on a stream
    duplicate_tokens_seen: int = 0  # tokens a client reading with seq dedup received twice (must be 0)
    raw_resends: int = 0  # token entries repeated on the stream (exact re-sends; the client drops them)
    mismatched_resends: int = 0  # a repeated seq with different ids (must be 0)
    wrong_output: int = 0
    reasons: Counter = field(default_factory=Counter)
    problems: list[str] = field(default_factory=list)

    def note(self, what: str) -> None:
        if len(self.problems) < 20:
            self.problems.append(what)

    @property
    def ok(self) -> bool:
        return not (self.lost or self.finals_extra or self.duplicate_tokens_seen or self.mismatched_resends or self.wrong_output)


def check_stream(r: redis.Redis, key: str, tally: Tally, expected: list[int] | None = None,
                 expect_reason: str | None = "length", timeout: float = 120.0) -> tuple[list[int], dict | None]:
    """Read one result stream as a client would, then audit the raw stream.

    Counts into ``tally``: a missing final entry, more than one final entry, a seq the client
    would get twice, repeated seqs whose ids differ, and output different from ``expected``.
    """
    tally.requests += 1
    try:
        ids, _, final, _ = read_result(r, key, timeout=timeout)
    except TimeoutError:
        tally.lost += 1
        tally.note(f"{key}: no final entry")
        return [], None
    except AssertionError as e:  # a gap in the seqs
        tally.lost += 1
        tally.note(str(e))
        return [], None
    tally.reasons[final.get("finish_reason") or final.get("code") or "?"] += 1
    if final["type"] == "done":
        tally.done += 1
    else:
        tally.errors += 1
    raw = [decode(f) for _, f in r.xrange(key)]
    finals = [e for e in raw if e.get("type") in ("done", "error")]
    if len(finals) != 1:
        tally.finals_extra += len(finals) - 1
        tally.note(f"{key}: {len(finals)} final entries")
    by_seq: dict[int, list[int]] = {}
    client: list[int] = []
    for e in raw:
        if e.get("type") != "token":
            continue
        seq, tok = int(e["seq"]), json.loads(e["ids"])
        if seq in by_seq:
            tally.raw_resends += 1
            if by_seq[seq] != tok:
                tally.mismatched_resends += 1
                tally.note(f"{key}: seq {seq} sent as {by_seq[seq]} and as {tok}")
        by_seq.setdefault(seq, tok)
        if seq == len(client):  # the client rule: take the next seq, drop the ones it has
            client.extend(tok)
    if client != ids:
        tally.note(f"{key}: raw stream and client view differ")
        tally.wrong_output += 1
    if expected is not None and len(ids) > len(expected):
        # a resume that re-emitted published tokens under new seqs would show up here
        tally.duplicate_tokens_seen += len(ids) - len(expected)
    if expected is not None and ids != expected:
        tally.wrong_output += 1
        tally.note(f"{key}: got {ids[:8]}... expected {expected[:8]}... ({len(ids)} vs {len(expected)} tokens)")
    if expect_reason is not None and final.get("finish_reason") != expect_reason:
        tally.note(f"{key}: final {final}")
    return ids, final


def pending_total(r: redis.Redis, prefix: str) -> int:
    total = 0
    for level in LEVELS:
        try:
            total += r.xpending(f"{prefix}:requests:{level}", f"{prefix}:workers")["pending"]
        except redis.ResponseError:  # no group (nothing was ever served)
            pass
    return total


def backlog(r: redis.Redis, prefix: str) -> int:
    return sum(r.xlen(f"{prefix}:requests:{level}") for level in LEVELS)


def wait_until(cond: Callable[[], bool], timeout: float, what: str, interval: float = 0.1) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(interval)


# ---------------------------------------------------------------------------- a fleet of workers


class Fleet:
    """Real worker processes on one prefix; ``chaos()`` SIGKILLs one at random and starts another."""

    def __init__(self, prefix: str, model: str, url: str, log_dir: Path, args: list[str] | None = None, seed: int = 0):
        self.prefix, self.model, self.url, self.log_dir = prefix, model, url, Path(log_dir)
        self.args = list(args or [])
        self.rng = random.Random(seed)
        self.workers: list[WorkerProcess] = []
        self.killed: list[WorkerProcess] = []
        self.hits = 0  # requests held by workers at the moment they were killed
        self.n = 0
        self.r = redis.Redis.from_url(url)

    def start(self, count: int = 1, ready: bool = False) -> list[WorkerProcess]:
        new = []
        for _ in range(count):
            self.n += 1
            w = spawn_worker(self.prefix, model=self.model, url=self.url, log_dir=self.log_dir, args=self.args,
                             name=f"chaos-{self.n}", ready=False, env=WORKER_ENV)
            self.workers.append(w)
            new.append(w)
        if ready:
            for w in new:
                w.wait_ready()
        return new

    @property
    def alive(self) -> list[WorkerProcess]:
        return [w for w in self.workers if w.proc.poll() is None]

    def holding(self) -> dict[str, int]:
        """Pending entries per consumer name, over all levels."""
        out: Counter = Counter()
        for level in LEVELS:
            try:
                info = self.r.xpending(f"{self.prefix}:requests:{level}", f"{self.prefix}:workers")
            except redis.ResponseError:
                continue
            for c in info.get("consumers") or []:
                out[decode({"n": c["name"]})["n"]] += int(c["pending"])
        return dict(out)

    def chaos(self) -> WorkerProcess | None:
        """SIGKILL a random live worker (preferring one that holds requests); start a replacement."""
        alive = [w for w in self.alive if self.r.exists(f"{self.prefix}:worker:{w.name}")]
        if not alive:
            return None
        held = self.holding()
        busy = [w for w in alive if held.get(w.name, 0) > 0]
        victim = self.rng.choice(busy or alive)
        victim.kill()
        self.hits += held.get(victim.name, 0)
        self.killed.append(victim)
        self.start(1)
        return victim

    def crashes(self) -> list[str]:
        """Workers that exited on their own (not killed by us): name and log tail."""
        out = []
        for w in self.workers:
            if w in self.killed:
                continue
            rc = w.proc.poll()
            if rc is not None:
                out.append(f"{w.name} exited {rc}:\n{w.log[-2000:]}")
        return out

    def logs(self) -> str:
        return "\n".join(f"--- {w.name}\n{w.log[-1500:]}" for w in self.workers)

    def grep(self, needle: str) -> int:
        return sum(w.log.count(needle) for w in self.workers)

    def close(self) -> None:
        for w in self.workers:
            w.kill()
        self.r.close()


def run_chaos(r: redis.Redis, fleet: Fleet, specs: list[Spec], reference: Callable[[list[int], int], list[int]],
              kills: int, kill_every: float, progress: Callable[[str], None] | None = None,
              read_timeout: float = 180.0) -> Tally:
    """Submit ``specs`` in ``kills + 1`` waves; shortly after each wave but the last, SIGKILL a worker
    that holds requests (and start a replacement), at most one kill per ``kill_every`` seconds.
    Then read and check every result."""
    prefix = fleet.prefix
    per_wave = max(1, -(-len(specs) // (kills + 1)))
    waves = [specs[i:i + per_wave] for i in range(0, len(specs), per_wave)]
    last_kill = 0.0
    for k, wave in enumerate(waves):
        time.sleep(max(0.0, last_kill + kill_every - time.monotonic()))
        for s in wave:
            submit(r, prefix, s)
        if k >= kills:
            continue
        try:  # a victim that holds work: that is what the test is about
            wait_until(lambda: any(fleet.holding().values()), 10, "a worker to take work", interval=0.02)
        except TimeoutError:
            pass
        time.sleep(fleet.rng.uniform(0.0, 0.2))
        victim = fleet.chaos()
        last_kill = time.monotonic()
        if progress and victim is not None:
            progress(f"killed {victim.name}")
    tally = Tally()
    for s in specs:
        check_stream(r, f"{prefix}:result:{s.id}", tally, reference(s.input_ids, s.max_tokens), timeout=read_timeout)
        if progress:
            progress("checked")
    return tally


def env_int(name: str, default: int) -> int:
    return int(os.environ.get(name, default))
