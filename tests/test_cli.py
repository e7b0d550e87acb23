"""The ``tokenq`` command line: submit, status, cancel, gateway; bad input gives a clear message and exit 2."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from producer_helpers import run_cli, shared_worker, wait_for

from common.keys import Keys
from common.local_redis import free_port
from common.protocol import parse_control
from producer import Client
from producer.cli import COMMANDS, command, main

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = Path(sys.executable).parent / "tokenq"


def takes_ctrl_c() -> None:
    """In the child before it runs: SIGINT as Ctrl-C. A test run started as a shell's background
    job (``cmd &``) ignores SIGINT, every child inherits that, and Python then never turns it
    into KeyboardInterrupt: the tests that interrupt a ``tokenq`` process waited in vain."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def tokenq_cmd() -> list[str]:
    """The installed console script (falls back to ``python -m producer.cli`` outside a venv)."""
    return [str(SCRIPT)] if SCRIPT.exists() else [sys.executable, "-m", "producer.cli"]


@pytest.fixture(scope="module")
def worker(request, redis_url, tiny_model_dir, tmp_path_factory):
    return shared_worker(request, redis_url, tiny_model_dir, tmp_path_factory)


# ---------------------------------------------------------------------------- submit


def test_submit_streams_the_answer(worker, redis_url, capsys):
    prefix, _ = worker
    code, out, err = run_cli(capsys, "submit", "Once upon a time", "--max-tokens", "6", "--temperature", "0",
                         "--priority", "high", "--redis-url", redis_url, "--prefix", prefix)
    assert code == 0, err
    with Client(redis_url, prefix) as c:
        expected = c.generate("Once upon a time", max_tokens=6, temperature=0, timeout=60)
    assert out == expected.text + "\n"
    assert "queued (high)" in err and "finish=length" in err and "completion_tokens=6" in err


def test_submit_json_chat_and_stdin(worker, redis_url, capsys, monkeypatch):
    prefix, _ = worker
    # greedy: sampled at temperature 1, the tiny model (512 ids, near-uniform) can draw its EOS and
    # finish with "stop" before its 3 tokens (this test failed once in a full run, not again alone)
    code, out, err = run_cli(capsys, "submit", "hello", "--chat", "--system", "be brief", "--max-tokens", "3",
                         "--temperature", "0", "--json", "-q", "--redis-url", redis_url, "--prefix", prefix)
    assert code == 0, err
    res = json.loads(out)
    assert res["finish_reason"] == "length" and len(res["token_ids"]) == 3
    assert res["usage"]["completion_tokens"] == 3 and res["usage"]["total_tokens"] > 3
    assert err == ""
    import io

    monkeypatch.setattr(sys, "stdin", io.StringIO("from standard input"))
    code, out, err = run_cli(capsys, "submit", "-", "--max-tokens", "2", "--temperature", "0", "--json",
                         "--redis-url", redis_url, "--prefix", prefix)
    assert code == 0 and len(json.loads(out)["token_ids"]) == 2


def test_submit_worker_error_exits_1(worker, redis_url, capsys):
    prefix, _ = worker
    ids = json.dumps([5] * 3000)
    code, out, err = run_cli(capsys, "submit", "--input-ids", ids, "--max-tokens", "4", "--redis-url", redis_url,
                         "--prefix", prefix)
    assert code == 1
    assert "too_long" in err
    code, out, err = run_cli(capsys, "submit", "--input-ids", ids, "--max-tokens", "4", "--json", "--redis-url",
                         redis_url, "--prefix", prefix)
    assert code == 1 and json.loads(out)["error"]["code"] == "too_long"


@pytest.mark.parametrize("argv, needle", [
    (["submit", "x", "--max-tokens", "0"], "max_tokens"),
    (["submit", "x", "--temperature", "-1"], "temperature"),
    (["submit", "x", "--id", "bad id"], "id must be"),
    (["submit", "--input-ids", "nope"], "--input-ids must be a JSON array"),
    (["submit", "--input-ids", "[]"], "input_ids must be a non-empty array"),
    (["submit", "x", "--input-ids", "[1]"], "not both"),
    (["submit", "x", "--system", "s"], "--system needs --chat"),
    (["submit", ""], "the prompt is empty"),
    (["cancel", "not valid!"], "not a valid request id"),
    (["status", "--watch", "--json"], "do not go together"),
])
def test_bad_input_exits_2_and_sends_nothing(redis_url, prefix, r, capsys, argv, needle):
    code, out, err = run_cli(capsys, *argv, "--redis-url", redis_url, "--prefix", prefix)
    assert code == 2, (out, err)
    assert needle in err, err
    assert list(r.scan_iter(match=f"{prefix}:*")) == []


@pytest.mark.parametrize("argv, needle", [
    (["submit", "x", "--priority", "urgent"], "invalid choice: 'urgent'"),
    (["submit", "x", "--max-tokens", "many"], "invalid int value"),
    (["submit", "x", "--timeout-s", "-3"], "must be a positive number"),
    (["frobnicate"], "invalid choice: 'frobnicate'"),
    ([], "required: COMMAND"),
])
def test_bad_flags_exit_2_with_usage(capsys, argv, needle):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert needle in capsys.readouterr().err


def test_bad_environment_and_redis(capsys, monkeypatch):
    code, _, err = run_cli(capsys, "status", "--redis-url", f"redis://127.0.0.1:{free_port()}/0")
    assert code == 1 and "cannot reach redis://127.0.0.1" in err
    code, _, err = run_cli(capsys, "status", "--redis-url", "http://example.com")
    assert code == 2 and "bad --redis-url" in err
    code, _, err = run_cli(capsys, "status", "--redis-url", "redis://:s3cret@127.0.0.1:1/0")
    assert code == 1 and "s3cret" not in err and ":***@" in err
    code, _, err = run_cli(capsys, "submit", "x", "--max-tokens", "0", "--redis-url", f"redis://127.0.0.1:{free_port()}/0")
    assert code == 2 and "max_tokens" in err  # bad input is reported as such even with Redis down
    monkeypatch.setenv("TOKENQ_PORT", "eighty")
    code, _, err = run_cli(capsys, "gateway")
    assert code == 2 and "TOKENQ_PORT='eighty' is not a valid int" in err


def test_submit_wait_gives_up_and_cancels(redis_url, prefix, r, capsys):
    """No worker on this prefix: --wait runs out, the request is cancelled, exit 1."""
    code, out, err = run_cli(capsys, "submit", "nobody home", "--wait", "0.5", "--id", "lonely-1",
                         "--redis-url", redis_url, "--prefix", prefix)
    assert code == 1 and "wait_timeout" in err
    assert [parse_control(f) for _, f in r.xrange(Keys(prefix).control)] == [("cancel", "lonely-1")]
    assert r.xlen(Keys(prefix).requests("normal")) == 1


def test_submit_ctrl_c_cancels(redis_url, prefix, r):
    """Interrupting ``tokenq submit`` cancels the request and exits 130 (a real process and signal)."""
    env = {**os.environ, "TOKENQ_REDIS_URL": redis_url, "TOKENQ_PREFIX": prefix}
    p = subprocess.Popen([*tokenq_cmd(), "submit", "wait for me", "--id", "interrupted-1"], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                         preexec_fn=takes_ctrl_c)
    wait_for(lambda: r.xlen(Keys(prefix).requests("normal")) == 1, 30, what="the request")
    time.sleep(0.2)
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=30)
    assert p.returncode == 130, err
    assert "interrupted: cancelled" in err
    assert [parse_control(f) for _, f in r.xrange(Keys(prefix).control)] == [("cancel", "interrupted-1")]


# ---------------------------------------------------------------------------- cancel


def test_cancel(redis_url, prefix, r, capsys):
    code, out, _ = run_cli(capsys, "cancel", "abc", "d.e-f", "--redis-url", redis_url, "--prefix", prefix)
    assert code == 0 and out.count("cancel sent for") == 2
    assert [parse_control(f) for _, f in r.xrange(Keys(prefix).control)] == [("cancel", "abc"), ("cancel", "d.e-f")]


def test_cancel_a_running_request(worker, redis_url, capsys):
    prefix, _ = worker
    with Client(redis_url, prefix) as c:
        h = c.submit("go on and on", max_tokens=2000, ignore_eos=True)
        next(iter(h))
        code, out, _ = run_cli(capsys, "cancel", h.id, "--redis-url", redis_url, "--prefix", prefix)
        assert code == 0 and "(it is running)" in out
        assert h.result(timeout=60).finish_reason == "cancelled"
        code, out, _ = run_cli(capsys, "cancel", h.id, "--redis-url", redis_url, "--prefix", prefix)
        assert "(it had already finished)" in out


# ---------------------------------------------------------------------------- status


def test_status_counts(redis_url, prefix, r, capsys):
    k = Keys(prefix)
    for i in range(3):
        r.xadd(k.requests("high"), {"prompt": f"h{i}"})
    r.xadd(k.requests("low"), {"prompt": "l"})
    r.xgroup_create(k.requests("high"), k.group, id="0", mkstream=True)
    r.xreadgroup(k.group, "w-a", {k.requests("high"): ">"}, count=2)
    r.xadd(k.dead, {"id": "x", "reason": "gave up"})
    now = time.time()
    r.hset(k.worker("w-a"), mapping={"model": "tiny", "device": "cpu", "pages_total": 256, "pages_free": 64,
                                     "running": 2, "waiting": 1, "tokens_per_s": "31.5", "last_step": f"{now:.3f}",
                                     "prefix_cache_queries": 400, "prefix_cache_hits": 300})
    r.expire(k.worker("w-a"), 30)
    r.hset(k.worker("w-b"), mapping={"model": "other", "surprise": "field"})  # missing and unknown fields
    code, out, err = run_cli(capsys, "status", "--json", "--redis-url", redis_url, "--prefix", prefix)
    assert code == 0, err
    st = json.loads(out)
    assert st["queues"]["high"] == {"length": 3, "pending": 2, "waiting": 1, "group": True, "consumers": {"w-a": 2}}
    assert st["queues"]["normal"]["length"] == 0 and st["queues"]["normal"]["pending"] == 0
    assert st["queues"]["low"] == {"length": 1, "pending": 0, "waiting": 1, "group": False, "consumers": {}}
    assert st["dead"] == 1
    ws = {w["name"]: w for w in st["workers"]}
    assert ws["w-a"]["pages_free"] == 64 and ws["w-a"]["tokens_per_s"] == 31.5 and 0 < ws["w-a"]["ttl_s"] <= 30
    assert ws["w-b"] == {"model": "other", "surprise": "field", "name": "w-b", "ttl_s": -1}
    code, out, err = run_cli(capsys, "status", "--redis-url", redis_url, "--prefix", prefix)
    assert code == 0, err
    for needle in ("high", "w-a: 2", "4 queued, 2 in flight, 1 dead-lettered", "w-a", "tiny", "64/256", "31.5",
                   "w-b", "other", "workers (2 live)", "75%"):
        assert needle in out, (needle, out)


def test_status_of_an_empty_prefix(redis_url, prefix, capsys):
    code, out, _ = run_cli(capsys, "status", "--redis-url", redis_url, "--prefix", prefix)
    assert code == 0 and "0 queued, 0 in flight, 0 dead-lettered" in out and "no live worker heartbeats" in out


def test_status_shows_a_real_worker(worker, redis_url, capsys):
    prefix, w = worker
    code, out, _ = run_cli(capsys, "status", "--json", "--redis-url", redis_url, "--prefix", prefix)
    st = json.loads(out)
    (hb,) = [x for x in st["workers"] if x["name"] == w.name]
    assert hb["device"] == "cpu" and hb["pages_total"] > 0 and hb["pages_free"] <= hb["pages_total"]
    assert {"model", "running", "waiting", "tokens_per_s", "last_step"} <= set(hb)


def test_status_watch_is_a_live_view(redis_url, prefix, r):
    r.xadd(Keys(prefix).requests("low"), {"prompt": "x"})
    env = {**os.environ, "TOKENQ_REDIS_URL": redis_url, "TOKENQ_PREFIX": prefix, "COLUMNS": "120",
           "TTY_COMPATIBLE": "1", "TTY_INTERACTIVE": "1"}  # rich redraws as on a terminal
    p = subprocess.Popen([*tokenq_cmd(), "status", "--watch", "--interval", "0.2"], env=env, cwd=ROOT,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=takes_ctrl_c)
    out: list[str] = []
    reader = threading.Thread(target=lambda: out.extend(iter(lambda: p.stdout.read(1), "")), daemon=True)
    reader.start()
    try:
        wait_for(lambda: "1 queued, 0 in flight" in "".join(out), 60, what="the first view")
        r.xadd(Keys(prefix).requests("high"), {"prompt": "y"})
        wait_for(lambda: "2 queued, 0 in flight" in "".join(out), 20, what="a refreshed view")
    finally:
        p.send_signal(signal.SIGINT)
        p.wait(20)
        reader.join(5)
    assert p.returncode == 0, p.stderr.read()


# ---------------------------------------------------------------------------- gateway and the registry


def test_gateway_command_serves(redis_url, prefix):
    port = free_port()
    env = {**os.environ, "TOKENQ_REDIS_URL": redis_url}
    p = subprocess.Popen([*tokenq_cmd(), "gateway", "--port", str(port), "--prefix", prefix, "--model-name", "m1",
                          "--log-level", "warning"], env=env, cwd=ROOT, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    try:
        def health():
            try:
                return httpx.get(f"http://127.0.0.1:{port}/health", timeout=1)
            except httpx.HTTPError:
                assert p.poll() is None, p.stderr.read()
                return None

        resp = wait_for(health, 30, 0.1, "the gateway")
        assert resp.status_code == 200 and resp.json()["redis"] == "ok"
        assert httpx.get(f"http://127.0.0.1:{port}/v1/models").json()["data"][0]["id"] == "m1"
    finally:
        p.terminate()
        p.wait(20)


def test_gateway_bad_port(capsys):
    code, _, err = run_cli(capsys, "gateway", "--port", "70000")
    assert code == 2 and "--port must be in [0, 65535]" in err


def test_command_registry_takes_new_subcommands(redis_url, prefix, capsys):
    seen = {}

    def configure(p):
        p.add_argument("--rate", type=float, default=1.0)

    @command("bench-test", "a registered test command", configure)
    def run_it(args):
        seen.update(rate=args.rate, prefix=args.prefix)
        return 3

    try:
        assert main(["bench-test", "--rate", "2.5", "--prefix", prefix]) == 3
        assert seen == {"rate": 2.5, "prefix": prefix}
    finally:
        COMMANDS.pop("bench-test")


def test_console_script_help():
    out = subprocess.run([*tokenq_cmd(), "--help"], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 0
    for name in ("submit", "status", "cancel", "gateway"):
        assert name in out.stdout
