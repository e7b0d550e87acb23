"""``tokenq batch``: submit a JSONL file as a batch, watch it, list, cancel.

    tokenq batch submit input.jsonl [--priority low] [--wait] [-o output.jsonl] [-e errors.jsonl]
    tokenq batch status <batch_id> [--json] [-o output.jsonl] [-e errors.jsonl]
    tokenq batch list [--limit 20] [--json]
    tokenq batch cancel <batch_id>

The commands talk to Redis, like the rest of ``tokenq``. Gateways carry batches; while
``submit --wait`` waits, this process carries its own batch too (sharing it with any gateway
through the batch's lease), so a batch also runs with workers and no gateway up. Exit status:
0 the batch completed (or the command did its work), 1 it failed, expired or was cancelled,
2 bad input, 130 interrupted (the batch goes on).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path
from typing import Any

from common.keys import LEVELS
from common.settings import Settings
from producer.batch import records
from producer.batch.store import Store, StoreError
from producer.cli.registry import (
    CONNECTION_FLAGS,
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    UsageError,
    command,
    connect_checked,
    settings_of,
)

POLL_S = 0.25
FINAL = ("completed", "failed", "expired", "cancelled")


def _configure(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="batch_command", metavar="SUBCOMMAND")
    sub.required = True
    sp = sub.add_parser("submit", help="upload a JSONL file and create a batch of it")
    sp.add_argument("file", type=Path, help="input JSONL: one {custom_id, method, url, body} per line")
    sp.add_argument("--endpoint", choices=records.ENDPOINTS, help="default: the url of the file's first line")
    sp.add_argument("--priority", default="low", choices=LEVELS, help="queue level of its requests (default: low)")
    sp.add_argument("--completion-window", default="24h", help="24h (or <n>s, <n>m, <n>h)")
    sp.add_argument("--metadata", action="append", metavar="KEY=VALUE", help="a metadata pair (repeatable)")
    sp.add_argument("--wait", action="store_true", help="wait for the end, with a progress bar")
    _outputs(sp)
    sp = sub.add_parser("status", help="show a batch (and with -o/-e, download its results)")
    sp.add_argument("batch_id")
    sp.add_argument("--json", action="store_true", help="print the batch object as JSON")
    _outputs(sp)
    sp = sub.add_parser("list", help="list batches, newest first")
    sp.add_argument("--limit", type=int, default=20, help="how many (1-100, default 20)")
    sp.add_argument("--after", help="list those older than this batch id")
    sp.add_argument("--json", action="store_true", help="print the list object as JSON")
    sp = sub.add_parser("cancel", help="cancel a batch (what completed stays in its output)")
    sp.add_argument("batch_id")
    for name, sp in sub.choices.items():  # the connection flags go after the subcommand too
        Settings.add_arguments(sp, CONNECTION_FLAGS + (["model_name"] if name == "submit" else []))
        for a in sp._actions:
            if a.dest in CONNECTION_FLAGS:
                a.default = argparse.SUPPRESS  # unset here: the value given before the subcommand stands


def _outputs(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("-o", "--output", type=Path, help="write the output file here once the batch ends")
    sp.add_argument("-e", "--errors", type=Path, help="write the error file here once the batch ends")


@command("batch", "OpenAI-style batch jobs: submit a JSONL file, watch, list, cancel", _configure)
def cmd_batch(args: argparse.Namespace) -> int:
    s = settings_of(args)
    connect_checked(s).close()
    try:
        return asyncio.run(_run(args, s))
    except StoreError as e:
        raise UsageError(e.message) from None
    except KeyboardInterrupt:
        print("\n[tokenq] interrupted: the batch goes on (tokenq batch cancel to stop it)", file=sys.stderr)
        return EXIT_INTERRUPTED


async def _run(args: argparse.Namespace, s: Settings) -> int:
    from common.redis import connect_async

    r = connect_async(s.redis_url)
    store = Store.of(r, s)
    try:
        if args.batch_command == "submit":
            return await _submit(args, s, store)
        if args.batch_command == "status":
            b = await store.get_batch(args.batch_id)
            print(json.dumps(b, indent=2) if args.json else _line(b))
            return await _download(args, store, b)
        if args.batch_command == "list":
            if not 1 <= args.limit <= 100:
                raise UsageError("--limit must be in [1, 100]")
            page = await store.list_batches(args.after, args.limit)
            print(json.dumps(page, indent=2) if args.json else "\n".join(_line(b) for b in page["data"]))
            return EXIT_OK
        b = await store.cancel_batch(args.batch_id)
        print(_line(b))
        return EXIT_OK
    finally:
        await r.aclose()


def _line(b: dict[str, Any]) -> str:
    c = b["request_counts"]
    return (f"{b['id']}  {b['status']:<11} {c['completed']}/{c['total']} completed, {c['failed']} failed  "
            f"{b['endpoint']}  priority={b.get('priority')}")


async def _submit(args: argparse.Namespace, s: Settings, store: Store) -> int:
    try:
        data = args.file.read_bytes()
    except OSError as e:
        raise UsageError(f"cannot read {args.file}: {e.strerror}") from None
    endpoint = args.endpoint or _first_url(data)
    metadata = dict(_pair(x) for x in args.metadata) if args.metadata else None
    f = await store.put_file(data, filename=args.file.name, purpose="batch")
    b = await store.create_batch(input_file_id=f["id"], endpoint=endpoint, completion_window=args.completion_window,
                                 metadata=metadata, priority=args.priority)
    print(b["id"])
    print(f"[tokenq] {b['id']} created from {args.file} ({f['bytes']} bytes, {endpoint}, {args.priority})",
          file=sys.stderr)
    if not args.wait:
        return EXIT_OK
    b = await _wait(store, s, b["id"])
    print(f"[tokenq] {_line(b)}", file=sys.stderr)
    for e in (b.get("errors") or {}).get("data") or []:
        print(f"[tokenq] line {e['line']}: {e['code']}: {e['message']}", file=sys.stderr)
    return await _download(args, store, b)


def _first_url(data: bytes) -> str:
    for raw in data.splitlines():
        if raw.strip():
            try:
                url = json.loads(raw).get("url")
            except (ValueError, AttributeError):
                break
            if url in records.ENDPOINTS:
                return url
            break
    raise UsageError(f"cannot tell the endpoint from the file's first line: give --endpoint "
                     f"({' or '.join(records.ENDPOINTS)})")


def _pair(text: str) -> tuple[str, str]:
    k, sep, v = text.partition("=")
    if not sep or not k:
        raise UsageError(f"--metadata takes KEY=VALUE, got {text!r}")
    return k, v


async def _wait(store: Store, s: Settings, batch_id: str) -> dict[str, Any]:
    """Poll to the end with a progress bar; carry the batch meanwhile (see the module's docstring)."""
    from tqdm import tqdm

    from producer.batch.runner import BatchRunner

    runner = BatchRunner(store.r, s, only={batch_id})
    runner.start()
    runner.wake()
    bar = tqdm(total=0, unit="req", desc=batch_id[:18], file=sys.stderr, dynamic_ncols=True)
    try:
        while True:
            b = await store.get_batch(batch_id)
            c = b["request_counts"]
            bar.total = c["total"]
            bar.n = c["completed"] + c["failed"]
            bar.set_postfix_str(f"{b['status']}, {c['failed']} failed", refresh=True)
            if b["status"] in FINAL:
                return b
            await asyncio.sleep(POLL_S)
    finally:
        bar.close()
        await runner.aclose()


async def _download(args: argparse.Namespace, store: Store, b: dict[str, Any]) -> int:
    if b["status"] not in FINAL:
        if args.output or args.errors:
            print(f"[tokenq] {b['id']} is {b['status']}: its files come when it ends", file=sys.stderr)
        return EXIT_OK
    for path, fid in ((args.output, b["output_file_id"]), (args.errors, b["error_file_id"])):
        if path is None:
            continue
        with open(path, "wb") as out:
            if fid is not None:
                async for chunk in await store.file_content(fid):
                    out.write(chunk)
    if b["error_file_id"] and args.errors is None:
        print(f"[tokenq] {b['request_counts']['failed']} lines failed: see file {b['error_file_id']} "
              "(or -e errors.jsonl)", file=sys.stderr)
    return EXIT_OK if b["status"] == "completed" else EXIT_FAILED
