"""The command registry, the parser built from it, ``main``, and what every command shares."""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import importlib.util
import math
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

import redis

from common.redis import redact_url
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
PLUGIN_MODULES = ("producer.bench",)  # imported when present; they call command(...)
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
        print(f"tokenq {args.command}: error: cannot reach {redact_url(url)}: {e}", file=sys.stderr)
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
        raise UsageError(f"bad --redis-url {redact_url(s.redis_url)!r}: {e}") from None
    r.ping()
    return r


def positive_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not (math.isfinite(v) and v > 0):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text!r}")
    return v
