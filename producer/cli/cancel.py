"""``tokenq cancel``: cancel requests by id."""

from __future__ import annotations

import argparse

from common.protocol import ID_RE, decode_result
from producer.cli.registry import EXIT_OK, UsageError, command, connect_checked, settings_of


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


