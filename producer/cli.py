"""The ``tokenq`` command line: submit and stream, queue/worker status, cancel, the HTTP gateway.

    tokenq submit "Once upon a time" --priority high --max-tokens 32 --temperature 0
    tokenq status [--watch] [--json]
    tokenq cancel <id> [<id> ...]
    tokenq gateway --host 0.0.0.0 --port 8000
    tokenq batch submit input.jsonl --wait -o output.jsonl   (producer/batch/cli.py)

Every command takes ``--redis-url`` and ``--prefix`` (or ``TOKENQ_REDIS_URL`` /
``TOKENQ_PREFIX``). Exit status: 0 success, 1 the request failed (error entry, timeout,
cancelled) or Redis is unreachable, 2 bad input, 130 interrupted (the request is cancelled).

Subcommands live in a registry: another module adds one with :func:`command` (``tokenq
bench`` is picked up from ``producer.bench`` when that module exists, or from any
installed package's ``tokenq.commands`` entry point).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import importlib.util
import json
import math
import os
import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import redis

from common.keys import LEVELS, Keys
from common.protocol import ID_RE, decode_result
from common.settings import Settings

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130
CONNECTION_FLAGS = ["redis_url", "prefix"]


class UsageError(Exception):
    """Bad input: printed as ``tokenq: error: ...``, exit status 2."""


# ---------------------------------------------------------------------------- the registry


@dataclass
class Command:
    name: str
    help: str
    configure: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]
    connection_flags: bool = True  # add --redis-url / --prefix


COMMANDS: dict[str, Command] = {}
PLUGIN_MODULES = ("producer.bench", "producer.batch.cli")  # imported when present; they call command(...)
ENTRY_POINT_GROUP = "tokenq.commands"  # entry points naming a module (or a callable taking no arguments)


def command(name: str, help: str, configure: Callable[[argparse.ArgumentParser], None] | None = None,
            connection_flags: bool = True) -> Callable[[Callable[[argparse.Namespace], int]], Callable]:
    """Register ``run(args) -> exit status`` as ``tokenq <name>``; ``configure(parser)`` adds its flags."""

    def deco(run: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
        COMMANDS[name] = Command(name, help, configure or (lambda p: None), run, connection_flags)
        return run

    return deco


def _load_plugins() -> None:
    for mod in PLUGIN_MODULES:
        try:
            if importlib.util.find_spec(mod) is not None:
                importlib.import_module(mod)
        except Exception as e:  # a broken plugin must not take the other commands down
            print(f"tokenq: warning: could not load {mod}: {e}", file=sys.stderr)
    try:
        eps = importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)
    except Exception:
        eps = []
    for ep in eps:
        try:
            obj = ep.load()
            if callable(obj):
                obj()
        except Exception as e:
            print(f"tokenq: warning: could not load command plugin {ep.name}: {e}", file=sys.stderr)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tokenq", description="Send work to a tokenq queue and watch it.")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for cmd in COMMANDS.values():
        sp = sub.add_parser(cmd.name, help=cmd.help, description=cmd.help)
        cmd.configure(sp)
        if cmd.connection_flags:
            Settings.add_arguments(sp, CONNECTION_FLAGS)
        sp.set_defaults(_run=cmd.run)
    return p


def main(argv: list[str] | None = None) -> int:
    _load_plugins()
    try:
        parser = build_parser()  # reads TOKENQ_* for the defaults it shows
    except ValueError as e:
        print(f"tokenq: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    args = parser.parse_args(argv)  # exits 2 with a usage message on bad flags
    try:
        return int(args._run(args) or 0)
    except UsageError as e:
        print(f"tokenq {args.command}: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except redis.ConnectionError as e:
        url = getattr(args, "_redis_url", None) or "Redis"
        print(f"tokenq {args.command}: error: cannot reach {redact(url)}: {e}", file=sys.stderr)
        return EXIT_FAILED
    except redis.RedisError as e:
        print(f"tokenq {args.command}: error: Redis: {e}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # e.g. `tokenq submit ... | head -c 100`
        try:
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - keep the interpreter's final flush quiet
        except OSError:
            pass
        return EXIT_FAILED


# ---------------------------------------------------------------------------- helpers


def redact(url: str) -> str:
    """The URL without its password (for messages)."""
    try:
        parts = urlsplit(url)
        if parts.password:
            netloc = parts.netloc.rsplit("@", 1)
            user = (parts.username or "") + ":***"
            return urlunsplit(parts._replace(netloc=f"{user}@{netloc[-1]}"))
    except ValueError:
        pass
    return url


def settings_of(args: argparse.Namespace) -> Settings:
    try:
        s = Settings.from_args(args)
    except ValueError as e:
        raise UsageError(str(e)) from None
    args._redis_url = s.redis_url
    return s


def connect_checked(s: Settings) -> redis.Redis:
    from common.redis import connect

    try:
        r = connect(s.redis_url)
    except ValueError as e:  # a malformed URL
        raise UsageError(f"bad --redis-url {redact(s.redis_url)!r}: {e}") from None
    r.ping()
    return r


def _positive_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not (math.isfinite(v) and v > 0):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text!r}")
    return v


def _s(v: Any) -> str:
    return v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v)


def _glob_escape(text: str) -> str:
    return re.sub(r"([*?\[\]\\])", r"\\\1", text)


# ---------------------------------------------------------------------------- submit


def _submit_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt", nargs="?", help="the prompt; '-' (or nothing, with input piped) reads standard input")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--chat", action="store_true", help="send the prompt as a user chat message (the model's chat template applies)")
    g.add_argument("--input-ids", metavar="JSON", help="send token ids (a JSON array) instead of a prompt")
    p.add_argument("--system", help="a system message (with --chat)")
    p.add_argument("--priority", default="normal", choices=LEVELS, help="queue priority (default: normal)")
    p.add_argument("--max-tokens", type=int, help="most tokens to generate (default: the worker's, 256)")
    p.add_argument("--temperature", type=float, help="0 = greedy (default: 1)")
    p.add_argument("--top-p", type=float)
    p.add_argument("--top-k", type=int)
    p.add_argument("--seed", type=int)
    p.add_argument("--stop", action="append", help="a stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", default=None, help="keep going past end-of-sequence")
    p.add_argument("--timeout-s", type=_positive_float, help="give up if no worker starts it within this many seconds")
    p.add_argument("--wait", type=_positive_float, metavar="S", help="stop waiting (and cancel) after S seconds")
    p.add_argument("--id", help="request id (default: a random one)")
    p.add_argument("--json", action="store_true", help="print the whole result as one JSON object instead of streaming")
    p.add_argument("-q", "--quiet", action="store_true", help="no summary line on standard error")


@command("submit", "submit a prompt and stream the answer", _submit_args)
def cmd_submit(args: argparse.Namespace) -> int:
    from producer.client import Client
    from producer.types import GenerationError, GenerationTimeout, build_request

    kw: dict[str, Any] = {}
    if args.input_ids is not None:
        if args.prompt is not None:
            raise UsageError("give either a prompt or --input-ids, not both")
        try:
            kw["input_ids"] = json.loads(args.input_ids)
        except ValueError:
            raise UsageError("--input-ids must be a JSON array of token ids, e.g. '[1, 2, 3]'") from None
    else:
        prompt = args.prompt
        if prompt is None or prompt == "-":
            if prompt is None and sys.stdin.isatty():
                raise UsageError("no prompt: give one as an argument, or pipe it in")
            prompt = sys.stdin.read()
        if not prompt:
            raise UsageError("the prompt is empty")
        if args.chat:
            msgs = [{"role": "system", "content": args.system}] if args.system else []
            kw["messages"] = msgs + [{"role": "user", "content": prompt}]
        else:
            if args.system:
                raise UsageError("--system needs --chat")
            kw["prompt"] = prompt
    kw.update(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
              seed=args.seed, stop=args.stop, ignore_eos=args.ignore_eos, priority=args.priority,
              timeout_s=args.timeout_s, id=args.id)
    s = settings_of(args)
    try:  # before touching Redis: bad input is a usage error even when Redis is down
        build_request(keys=Keys(s.prefix), limits=s.limits, **kw)
    except ValueError as e:
        raise UsageError(str(e)) from None
    r = connect_checked(s)
    client = Client(s.redis_url, s.prefix, redis_client=r)
    out, err = sys.stdout, sys.stderr
    h = client.submit(**kw)
    try:  # from here on, Ctrl-C cancels the request
        if not args.quiet:
            print(f"[tokenq] {h.id} queued ({args.priority})", file=err, flush=True)
            if next(r.scan_iter(match=_glob_escape(s.prefix) + ":worker:*", count=1000), None) is None:
                print(f"[tokenq] no live worker on prefix {s.prefix!r} yet: the request waits in the queue "
                      "(start one with tokenq-worker)", file=err, flush=True)
        if args.json:
            res = h.result(timeout=args.wait)
        else:
            for c in h.chunks(timeout=args.wait):
                out.write(c.text)
                out.flush()
            res = h.result()
            out.write("\n")
            out.flush()
    except KeyboardInterrupt:
        _cancel_quietly(client, h.id)
        print(f"\n[tokenq] {h.id} interrupted: cancelled", file=err)
        return EXIT_INTERRUPTED
    except GenerationTimeout as e:  # our --wait ran out
        _cancel_quietly(client, h.id)
        return _fail(args, h.id, "wait_timeout", f"no result within --wait {args.wait} s; cancelled", e)
    except GenerationError as e:
        if not args.json:
            out.write("\n")
        return _fail(args, h.id, e.code, e.message, e)
    if args.json:
        print(json.dumps(res.to_dict(), ensure_ascii=False), file=out)
    if not args.quiet:
        t = res.timings
        fmt = lambda v: "-" if v is None else f"{v:.3f}s"  # noqa: E731
        print(f"[tokenq] {res.id} finish={res.finish_reason} prompt_tokens={res.usage.prompt_tokens} "
              f"completion_tokens={res.usage.completion_tokens} queue={fmt(t.queue_s)} ttft={fmt(t.ttft_s)} "
              f"total={fmt(t.total_s)}", file=err)
    if res.finish_reason in ("timeout", "cancelled"):
        if res.finish_reason == "timeout":
            print(f"tokenq submit: error: no worker started {res.id} within --timeout-s {args.timeout_s}", file=err)
        else:
            print(f"tokenq submit: error: {res.id} was cancelled", file=err)
        return EXIT_FAILED
    return EXIT_OK


def _cancel_quietly(client: Any, rid: str) -> None:
    try:
        client.cancel(rid)
    except redis.RedisError:
        pass


def _fail(args: argparse.Namespace, rid: str, code: str, message: str, exc: Exception) -> int:
    if args.json:
        print(json.dumps({"id": rid, "error": {"code": code, "message": message}}, ensure_ascii=False))
    print(f"tokenq submit: error: {code}: {message}", file=sys.stderr)
    return EXIT_FAILED


# ---------------------------------------------------------------------------- cancel


def _cancel_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("ids", nargs="+", metavar="ID", help="request id(s) to cancel")


@command("cancel", "cancel requests by id", _cancel_args)
def cmd_cancel(args: argparse.Namespace) -> int:
    bad = [i for i in args.ids if not ID_RE.match(i)]
    if bad:
        raise UsageError(f"not a valid request id: {bad[0]!r} (1-128 letters, digits and ._:-)")
    s = settings_of(args)
    r = connect_checked(s)
    from producer.client import Client

    client = Client(s.redis_url, s.prefix, redis_client=r)
    for rid in args.ids:
        last = r.xrevrange(client.keys.result(rid), count=1)
        state = ""
        if last:
            try:
                e = decode_result(last[0][1])
                state = " (it had already finished)" if e.final else " (it is running)"
            except (ValueError, KeyError):
                pass
        client.cancel(rid)
        print(f"cancel sent for {rid}{state}")
    return EXIT_OK


# ---------------------------------------------------------------------------- status


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
    worker_keys = sorted(r.scan_iter(match=_glob_escape(keys.prefix) + ":worker:*", count=1000))
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
            w = {_s(a): _field_value(_s(a), _s(b)) for a, b in fields.items()}
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


def _field_value(name: str, text: str) -> Any:
    """Heartbeat values as numbers where they are numbers (for --json), text otherwise."""
    if name in ("name", "model", "device"):
        return text
    if re.fullmatch(r"[+-]?\d{1,18}", text):
        return int(text)
    try:
        v = float(text)
    except ValueError:
        return text
    return v if math.isfinite(v) else text


def _num(v: Any) -> float | None:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


def _int_text(v: Any) -> str:
    f = _num(v)
    return "-" if v is None else (str(int(f)) if f is not None else str(v))


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
    for col in ("name", "model", "device", "KV pages free", "running", "waiting", "tok/s", "last step"):
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
                   "-" if tps is None else f"{tps:.1f}", age)
    if not st["workers"]:
        wt.caption = "no live worker heartbeats"
        wt.caption_justify = "left"
    return Group(qt, wt)


def _status_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--watch", action="store_true", help="refresh continuously (Ctrl-C to stop)")
    p.add_argument("--interval", type=_positive_float, default=1.0, help="seconds between refreshes with --watch")
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


# ---------------------------------------------------------------------------- gateway


def _gateway_args(p: argparse.ArgumentParser) -> None:
    Settings.add_arguments(p, ["host", "port", "api_key", "model_name", "batch_feed_limit", "batch_max_file_bytes",
                               "batch_max_requests", "batch_ttl_s", "batch_lease_s"])
    p.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))


@command("gateway", "serve the OpenAI-compatible HTTP API", _gateway_args)
def cmd_gateway(args: argparse.Namespace) -> int:
    s = settings_of(args)
    if not 0 <= s.port <= 65535:
        raise UsageError(f"--port must be in [0, 65535], got {s.port}")
    try:
        connect_checked(s).close()
    except redis.ConnectionError as e:
        print(f"tokenq gateway: warning: cannot reach {redact(s.redis_url)} yet ({e}); /health reports 503 "
              "until it is up", file=sys.stderr)
    from producer.gateway import serve

    serve(s, log_level=args.log_level)
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
