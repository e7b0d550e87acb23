"""``tokenq submit``: send a prompt and stream the answer."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import redis

from common.keys import LEVELS, Keys
from producer.cli.registry import (
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    UsageError,
    command,
    connect_checked,
    positive_float,
    settings_of,
)


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
    p.add_argument("--timeout-s", type=positive_float, help="give up if no worker starts it within this many seconds")
    p.add_argument("--wait", type=positive_float, metavar="S", help="stop waiting (and cancel) after S seconds")
    p.add_argument("--id", help="request id (default: a random one)")
    p.add_argument("--json", action="store_true", help="print the whole result as one JSON object instead of streaming")
    p.add_argument("-q", "--quiet", action="store_true", help="no summary line on standard error")


def _request(args: argparse.Namespace) -> dict[str, Any]:
    """The submit() arguments the flags ask for (UsageError for what cannot be sent)."""
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
    return kw


@command("submit", "submit a prompt and stream the answer", _submit_args)
def cmd_submit(args: argparse.Namespace) -> int:
    from producer.client import Client
    from producer.types import GenerationError, GenerationTimeout, build_request

    kw = _request(args)
    s = settings_of(args)
    try:  # before touching Redis: bad input is a usage error even when Redis is down
        build_request(keys=Keys(s.prefix), limits=s.limits, **kw)
    except ValueError as e:
        raise UsageError(str(e)) from None
    r = connect_checked(s)
    client = Client(s.redis_url, s.prefix, redis_client=r)
    h = client.submit(**kw)
    try:  # from here on, Ctrl-C cancels the request
        if not args.quiet:
            _say_queued(args, r, s.prefix, h.id)
        res = _read(args, h)
    except KeyboardInterrupt:
        _cancel_quietly(client, h.id)
        print(f"\n[tokenq] {h.id} interrupted: cancelled", file=sys.stderr)
        return EXIT_INTERRUPTED
    except GenerationTimeout as e:  # our --wait ran out
        _cancel_quietly(client, h.id)
        return _fail(args, h.id, "wait_timeout", f"no result within --wait {args.wait} s; cancelled", e)
    except GenerationError as e:
        if not args.json:
            sys.stdout.write("\n")
        return _fail(args, h.id, e.code, e.message, e)
    return _report(args, res)


def _say_queued(args: argparse.Namespace, r: redis.Redis, prefix: str, rid: str) -> None:
    err = sys.stderr
    print(f"[tokenq] {rid} queued ({args.priority})", file=err, flush=True)
    if next(r.scan_iter(match=Keys(prefix).worker_pattern, count=1000), None) is None:
        print(f"[tokenq] no live worker on prefix {prefix!r} yet: the request waits in the queue "
              "(start one with tokenq-worker)", file=err, flush=True)


def _read(args: argparse.Namespace, h: Any) -> Any:
    """The result: streamed to standard output as it comes, or whole (--json)."""
    if args.json:
        return h.result(timeout=args.wait)
    out = sys.stdout
    for c in h.chunks(timeout=args.wait):
        out.write(c.text)
        out.flush()
    res = h.result()
    out.write("\n")
    out.flush()
    return res


def _report(args: argparse.Namespace, res: Any) -> int:
    err = sys.stderr
    if args.json:
        print(json.dumps(res.to_dict(), ensure_ascii=False), file=sys.stdout)
    if not args.quiet:
        t = res.timings
        fmt = lambda v: "-" if v is None else f"{v:.3f}s"  # noqa: E731
        print(f"[tokenq] {res.id} finish={res.finish_reason} prompt_tokens={res.usage.prompt_tokens} "
              f"completion_tokens={res.usage.completion_tokens} queue={fmt(t.queue_s)} ttft={fmt(t.ttft_s)} "
              f"total={fmt(t.total_s)}", file=err)
    if res.finish_reason == "timeout":
        print(f"tokenq submit: error: no worker started {res.id} within --timeout-s {args.timeout_s}", file=err)
        return EXIT_FAILED
    if res.finish_reason == "cancelled":
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


