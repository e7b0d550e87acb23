"""``tokenq gateway``: serve the OpenAI-compatible HTTP API."""

from __future__ import annotations

import argparse
import sys

import redis

from common.redis import redact_url
from common.settings import Settings
from producer.cli.registry import EXIT_OK, UsageError, command, connect_checked, settings_of


def _gateway_args(p: argparse.ArgumentParser) -> None:
    Settings.add_arguments(p, ["host", "port", "api_key", "model_name"])
    p.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))


@command("gateway", "serve the OpenAI-compatible HTTP API", _gateway_args)
def cmd_gateway(args: argparse.Namespace) -> int:
    s = settings_of(args)
    if not 0 <= s.port <= 65535:
        raise UsageError(f"--port must be in [0, 65535], got {s.port}")
    try:
        connect_checked(s).close()
    except redis.ConnectionError as e:
        print(f"tokenq gateway: warning: cannot reach {redact_url(s.redis_url)} yet ({e}); /health reports 503 "
              "until it is up", file=sys.stderr)
    from producer.gateway import serve

    serve(s, log_level=args.log_level)
    return EXIT_OK


