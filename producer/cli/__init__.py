"""The ``tokenq`` command line: submit and stream, queue/worker status, cancel, the HTTP gateway.

    tokenq submit "Once upon a time" --priority high --max-tokens 32 --temperature 0
    tokenq status [--watch] [--json]
    tokenq cancel <id> [<id> ...]
    tokenq gateway --host 0.0.0.0 --port 8000

Every command takes ``--redis-url`` and ``--prefix`` (or ``TOKENQ_REDIS_URL`` /
``TOKENQ_PREFIX``). Exit status: 0 success, 1 the request failed (error entry, timeout,
cancelled) or Redis is unreachable, 2 bad input, 130 interrupted (the request is cancelled).

Subcommands live in a registry: another module adds one with :func:`command` (``tokenq
bench`` is picked up from ``producer.bench`` when that module exists, or from any
installed package's ``tokenq.commands`` entry point).
"""

from producer.cli import cancel, serve, status, submit  # noqa: F401 - each registers its command
from producer.cli.registry import (
    COMMANDS,
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_USAGE,
    UsageError,
    build_parser,
    command,
    main,
)
from producer.cli.status import gather_status, render_status

__all__ = ["COMMANDS", "EXIT_FAILED", "EXIT_INTERRUPTED", "EXIT_OK", "EXIT_USAGE", "UsageError", "build_parser",
           "command", "gather_status", "main", "render_status"]
