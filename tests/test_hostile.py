"""Hostile input through raw Redis and through the HTTP gateway.

Property-based fuzzing (hypothesis) of every request field, random bytes in fields and field
names, msgpack payloads of anything; then the classics: huge prompts, huge max_tokens, deeply
nested JSON, invalid UTF-8, control characters in ids, junk on the control stream. Each entry
gets a clear answer: a final entry on its result stream (``error`` with a code and a message,
or ``done`` when it happened to be valid) or, when no safe reply key exists, an entry in
``{prefix}:dead``. The worker never crashes, acknowledges everything and serves the next request.
"""

from __future__ import annotations

import json
import uuid

import httpx
import msgpack
import pytest
import redis
from helpers import read_result, spawn_worker
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from reliability import WORKER_ENV, decode, env_int, pending_total, wait_until

from common.errors import CODES
from common.keys import Keys
from common.protocol import reply_key_for

# Small caps so that "too big" is cheap to try; the defaults are checked in test_protocol.
CAPS = ["--max-prompt-chars", "2000", "--max-input-ids", "256", "--max-tokens-limit", "64", "--max-num-seqs", "8",
        "--claim-idle-s", "5"]
FIELDS = ["prompt", "input_ids", "messages", "id", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop",
          "stop_token_ids", "ignore_eos", "reply_to", "timeout_s"]


class Target:
    """A real worker on a prefix of its own, and a way to send one entry and see how it was answered."""

    def __init__(self, r: redis.Redis, prefix: str, worker):
        self.r, self.prefix, self.w, self.keys = r, prefix, worker, Keys(prefix)
        self.sent = 0

    def answer(self, fields: dict, level: str = "normal", timeout: float = 60.0) -> dict[str, str]:
        """XADD the entry; return its final entry, or its dead-letter entry (with 'dead': '1')."""
        _, reply = reply_key_for(fields, "0-0", self.keys)  # a fixed result key: clear what an earlier example left
        if reply is not None and reply != self.keys.result("0-0"):
            self.r.delete(reply)
        entry = self.r.xadd(self.keys.requests(level), fields).decode()
        self.sent += 1
        rid, reply = reply_key_for(fields, entry, self.keys)
        if reply is not None:
            _, _, final, _ = read_result(self.r, reply, timeout=timeout)
            return final
        found: dict[str, str] = {}

        def dead() -> bool:
            for _, e in self.r.xrevrange(self.keys.dead, count=50):
                e = decode(e)
                if e.get("entry_id") == entry:
                    found.update(e, dead="1")
                    return True
            return False

        wait_until(dead, timeout, f"a dead-letter entry for {entry}", interval=0.02)
        return found

    def assert_alive(self) -> None:
        assert self.w.proc.poll() is None, self.w.log[-3000:]


@pytest.fixture(scope="module")
def target(redis_url, tiny_model_dir, tmp_path_factory):
    prefix = f"tqhostile-{uuid.uuid4().hex[:8]}"
    w = spawn_worker(prefix, model=tiny_model_dir, url=redis_url, log_dir=tmp_path_factory.mktemp("hostile"),
                     args=CAPS, env=WORKER_ENV)
    r = redis.Redis.from_url(redis_url)
    yield Target(r, prefix, w)
    w.kill()
    keys = list(r.scan_iter(match=f"{prefix}:*", count=1000))
    if keys:
        r.delete(*keys)
    r.close()


def assert_clear(final: dict[str, str]) -> None:
    """A clear answer: an error with a known code and a message, a dead letter, or a valid run."""
    if final.get("dead"):
        assert final["code"] in CODES and final["message"], final
    elif final["type"] == "error":
        assert final["code"] in CODES and len(final["message"]) > 5, final
    else:
        assert final["type"] == "done" and final["finish_reason"] in ("stop", "length", "timeout"), final


def good(target: Target) -> None:
    """The worker still serves a normal request, right after."""
    rid = f"ok-{uuid.uuid4().hex[:8]}"
    final = target.answer({"id": rid, "prompt": "still serving?", "max_tokens": "2"})
    assert final["type"] == "done", final


# ---------------------------------------------------------------------------- strategies

text = st.text(max_size=40)
junk_bytes = st.binary(max_size=60)
json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | text,
                           lambda c: st.lists(c, max_size=4) | st.dictionaries(text, c, max_size=4), max_leaves=12)
packable = st.recursive(st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats() | text | st.binary(max_size=20),
                        lambda c: st.lists(c, max_size=4) | st.dictionaries(text, c, max_size=4), max_leaves=12)
numbers_as_text = st.one_of(st.integers(-2**70, 2**70).map(str), st.floats().map(repr), st.sampled_from(
    ["", " ", "1e309", "-0", "0x10", "NaN", "inf", "1_000", "٣", "1" * 5000, "+1", "007"]))
valid_ish = {
    "prompt": st.text(min_size=0, max_size=60),
    "input_ids": st.lists(st.integers(-5, 600), max_size=20).map(json.dumps),
    "messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "robot"]),
                                                "content": text}), max_size=3).map(json.dumps),
    "id": st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._:\-]{0,20}", fullmatch=True),
    "max_tokens": st.integers(-3, 80).map(str),
    "temperature": st.floats(-1, 3).map(repr),
    "top_p": st.floats(-0.5, 1.5).map(repr),
    "top_k": st.integers(-2, 2**40).map(str),
    "seed": st.integers(-2, 2**64).map(str),
    "stop": st.lists(text, max_size=3).map(json.dumps) | text,
    "stop_token_ids": st.lists(st.integers(-2, 600), max_size=3).map(json.dumps),
    "ignore_eos": st.sampled_from(["true", "false", "1", "0", "yes", "maybe", ""]),
    "reply_to": st.sampled_from(["", "x", "other:result:a", "{p}:result:", "{p}:result:ok", "{p}:result:../x",
                                 "{p}:requests:normal", "{p}:result:a b"]),
    "timeout_s": numbers_as_text,
}


def field_value(name: str):
    return st.one_of(valid_ish[name], junk_bytes, text, numbers_as_text, json_values.map(json.dumps))


@st.composite
def entries(draw):
    names = draw(st.lists(st.sampled_from(FIELDS), min_size=0, max_size=6, unique=True))
    fields: dict = {}
    for name in names:
        v = draw(field_value(name))
        if isinstance(v, str) and "{p}" in v:
            v = v.replace("{p}", draw(st.sampled_from(["tqhostile", "tokenq"])))
        fields[name] = v
    if draw(st.booleans()):
        fields[draw(st.binary(min_size=1, max_size=10))] = draw(junk_bytes)  # a field name that is not UTF-8
    if not fields:
        fields["junk"] = "1"
    return fields


# ---------------------------------------------------------------------------- raw Redis


@settings(max_examples=env_int("TOKENQ_FUZZ_EXAMPLES", 120), suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
          deadline=None)
@given(fields=entries())
def test_fuzz_fields(target, fields):
    if isinstance(fields.get("reply_to"), str) and fields["reply_to"].startswith("tqhostile"):  # aim at this test's own prefix
        fields["reply_to"] = target.prefix + fields["reply_to"][len("tqhostile"):]
    if "id" in fields and isinstance(fields["id"], str) and fields["id"][:1].isalnum():
        fields["id"] = f"{uuid.uuid4().hex[:6]}{fields['id']}"[:128]  # no two examples share a result stream
    final = target.answer(fields)
    assert_clear(final)
    target.assert_alive()


@settings(max_examples=env_int("TOKENQ_FUZZ_EXAMPLES", 120) // 2, suppress_health_check=[HealthCheck.function_scoped_fixture], deadline=None)
@given(payload=st.one_of(st.binary(max_size=80),
                         st.dictionaries(st.sampled_from(FIELDS) | text, packable, max_size=6).map(
                             lambda d: msgpack.packb(d, use_bin_type=True))))
def test_fuzz_msgpack_payload(target, payload):
    final = target.answer({"payload": payload})
    assert_clear(final)
    target.assert_alive()


@settings(max_examples=env_int("TOKENQ_FUZZ_EXAMPLES", 120) // 3, suppress_health_check=[HealthCheck.function_scoped_fixture], deadline=None)
@given(data=st.dictionaries(st.binary(min_size=1, max_size=12), st.binary(max_size=80), min_size=1, max_size=6))
def test_fuzz_random_bytes(target, data):
    final = target.answer(data)
    assert_clear(final)
    target.assert_alive()


def deep(n: int, open_: str = "[", close: str = "]") -> str:
    return open_ * n + close * n


CLASSICS = [
    # (fields, expected code or None for 'done', needle in the message)
    ({"prompt": "x" * 5_000_000}, "invalid_request", "limit"),  # way past the entry cap
    ({"prompt": "x" * 2001}, "invalid_request", "limit"),
    ({"prompt": "é" * 500}, None, ""),  # 500 characters, 1000 bytes: within the cap of 2000 characters
    ({"input_ids": json.dumps(list(range(6, 6 + 257)))}, "invalid_request", "limit"),
    ({"input_ids": json.dumps([7] * 3_000_000)}, "invalid_request", "limit"),
    ({"prompt": "x", "max_tokens": "65"}, "invalid_request", "max_tokens"),
    ({"prompt": "x", "max_tokens": "9" * 400}, "invalid_request", "max_tokens"),
    ({"prompt": "x", "max_tokens": "1e9"}, "invalid_request", "max_tokens"),
    ({"input_ids": deep(10_000)}, "invalid_request", "input_ids"),
    ({"messages": deep(5_000, "[{\"a\":", "}]")}, "invalid_request", "messages"),
    ({"input_ids": deep(100_000)}, "invalid_request", "limit"),
    ({"input_ids": "[" + "1," * 100 + "1e999]"}, "invalid_request", "input_ids"),
    ({"prompt": b"\xff\xfe\xfd"}, "invalid_request", "UTF-8"),
    ({"prompt": b"ok \xed\xa0\x80 lone surrogate"}, "invalid_request", "UTF-8"),
    ({"prompt": "nul\x00 and \x1b[31m escapes\r\n", "max_tokens": "2"}, None, ""),
    ({"messages": json.dumps([{"role": "user", "content": "\ud800"}])}, "any", ""),  # a lone surrogate
    ({"prompt": "x", "stop": json.dumps(["a"] * 1000)}, "invalid_request", "stop"),
    ({"prompt": "x", "stop": json.dumps(["s" * 10_000])}, "invalid_request", "stop"),
    ({"prompt": "x", "top_k": str(2**31 - 1), "temperature": "1e-300", "max_tokens": "2"}, None, ""),
    ({"prompt": "x", "temperature": "100", "top_p": "1e-9", "max_tokens": "2"}, None, ""),
    ({"prompt": "x", "timeout_s": "1e400"}, "invalid_request", "timeout_s"),
    ({"prompt": "x", "timeout_s": "-1"}, "invalid_request", "timeout_s"),
    ({"payload": msgpack.packb({"prompt": "x" * 3_000_000})}, "invalid_request", "limit"),  # not even decoded
    ({"payload": msgpack.packb([[[[[]]]]] * 10)}, "invalid_request", "payload"),
    ({"payload": b"\xdd\xff\xff\xff\xff"}, "invalid_request", "payload"),  # claims a 4-billion-element array
]


@pytest.mark.parametrize("i", range(len(CLASSICS)))
def test_classic_hostile_inputs(target, i):
    fields, code, needle = CLASSICS[i]
    fields = {"id": f"classic{i}-{uuid.uuid4().hex[:6]}", "max_tokens": "4", **fields}
    final = target.answer(fields)
    assert_clear(final)
    if final.get("dead"):
        assert needle in final["message"], final
    elif code == "any":
        pass
    elif code is None:
        assert final["type"] == "done", final
    else:
        assert final["type"] == "error" and final["code"] == code and needle in final["message"], final
    target.assert_alive()


@pytest.mark.parametrize("rid", ["a\nb", "a\x00", "\x1b[2J", "../../etc", "a" * 129, "-x", "tokenq:result:x", "é", " a",
                                 b"\xff\xfe"])
def test_bad_ids_are_dead_lettered(target, rid):
    """An id that is not safe in a key or a log line: no reply key can be derived, so the
    answer goes to the dead-letter stream (with the entry id), and nothing is written elsewhere."""
    final = target.answer({"id": rid, "prompt": "x"})
    if isinstance(rid, str) and rid.startswith("tokenq:"):
        assert final["type"] == "done", final  # ':' is allowed in ids: its result stays under our prefix
        assert target.r.exists(f"{target.prefix}:result:{rid}") and not target.r.exists("tokenq:result:x")
        return
    else:
        assert final.get("dead") == "1" and "id" in final["message"], final
    assert "\n" not in final["message"] and "\x1b" not in final["message"]
    line = [ln for ln in target.w.log.splitlines() if "event=rejected" in ln][-1]
    assert "\x1b" not in line and "\x00" not in line
    target.assert_alive()


def test_junk_on_the_control_stream(target):
    ctl = target.keys.control
    for fields in ({"type": "cancel"}, {"type": "cancel", "id": "\x00\n"}, {b"\xff": b"\xfe"}, {"type": "x" * 100_000},
                   {"type": "cancel", "id": "x" * 10_000}, {"type": "shutdown", "id": "all"}):
        target.r.xadd(ctl, fields)
    good(target)
    target.assert_alive()


def test_worker_survived_everything(target):
    """After all of the above: alive, still serving, nothing pending, nothing left in the streams."""
    good(target)
    wait_until(lambda: pending_total(target.r, target.prefix) == 0, 30, "pending lists to empty")
    for level in ("high", "normal", "low"):
        assert target.r.xlen(target.keys.requests(level)) == 0
    assert "Traceback" not in target.w.log, target.w.log[target.w.log.index("Traceback") - 500:][:3000]
    target.assert_alive()


# ---------------------------------------------------------------------------- HTTP


@pytest.fixture(scope="module")
def gateway(target, redis_url):
    pytest.importorskip("producer.gateway")
    from producer_helpers import serve_gateway

    from common.settings import Settings

    s = Settings.from_env(redis_url=redis_url, prefix=target.prefix, model_name="tiny", api_key="sesame",
                          max_prompt_chars=2000, max_input_ids=256, max_tokens_limit=64)
    with serve_gateway(s) as base:
        yield base


AUTH = {"Authorization": "Bearer sesame"}
json_bodies = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=30),
                           lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=12), c, max_size=5),
                           max_leaves=15)


@settings(max_examples=env_int("TOKENQ_FUZZ_EXAMPLES", 120) * 2 // 3, suppress_health_check=[HealthCheck.function_scoped_fixture], deadline=None)
@given(body=st.one_of(json_bodies, st.fixed_dictionaries(
    {"model": st.sampled_from(["tiny", "other", 3]), "prompt": st.one_of(st.text(max_size=40), json_bodies)},
    optional={"max_tokens": st.one_of(st.integers(-5, 10**12), json_bodies),
              "temperature": st.one_of(st.floats(), json_bodies), "stream": st.booleans(),
              "n": st.integers(-1, 5), "stop": json_bodies, "priority": json_bodies,
              "timeout_s": st.one_of(st.floats(), json_bodies), "logprobs": json_bodies})),
       path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]))
def test_fuzz_http(gateway, target, body, path):
    if path.endswith("chat/completions") and isinstance(body, dict) and "prompt" in body:
        body["messages"] = body.pop("prompt")
    with httpx.Client(base_url=gateway, timeout=60) as c:
        # allow_nan: Infinity and NaN are not JSON, but Python's parser takes them: a hostile client would too
        resp = c.post(path, content=json.dumps(body, allow_nan=True), headers={**AUTH, "content-type": "application/json"})
        assert resp.status_code in (200, 400, 404, 413, 422), (resp.status_code, resp.text[:500])
        if resp.status_code != 200:
            err = resp.json()["error"]
            assert err["message"] and err["type"], err
    target.assert_alive()


def test_http_hostile_bodies(gateway, target):
    with httpx.Client(base_url=gateway, timeout=60) as c:
        cases = [
            b"{", b"\xff\xfe", b"[" * 100_000 + b"]" * 100_000, b'{"prompt": "' + b"x" * 3_000_000 + b'"}',
            json.dumps({"model": "tiny", "prompt": "x", "max_tokens": 10**30}).encode(),
            json.dumps({"model": "tiny", "prompt": "x", "max_tokens": 65}).encode(),
            json.dumps({"model": "tiny", "prompt": "x" * 2001}).encode(),
            json.dumps({"model": "tiny", "messages": [{"role": "user", "content": deep(20_000)}]}).encode(),
            json.dumps({"model": "tiny", "prompt": [[[[1]]]]}).encode(),
        ]
        for body in cases:
            resp = c.post("/v1/completions", content=body, headers={**AUTH, "content-type": "application/json"})
            assert resp.status_code in (400, 413, 422), (body[:60], resp.status_code, resp.text[:300])
            assert resp.json()["error"]["message"]
        # control characters where free text is allowed are just text
        ok = c.post("/v1/completions", json={"model": "tiny", "prompt": "hi\x00\x1b[2J", "max_tokens": 2,
                                             "user": "\x00\n\x1b"}, headers=AUTH)
        assert ok.status_code == 200, ok.text
    target.assert_alive()


def test_http_requires_the_api_key(gateway):
    with httpx.Client(base_url=gateway, timeout=30) as c:
        body = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sesame"},
                        {"Authorization": "Basic c2VzYW1l"}, {"Authorization": "Bearer sesame2"},
                        {"Authorization": "Bearer sesam"}):
            resp = c.post("/v1/completions", json=body, headers=headers)
            assert resp.status_code == 401, (headers, resp.status_code)
            assert resp.json()["error"]["code"] == "invalid_api_key"
        assert c.get("/v1/models").status_code == 401
        assert c.post("/v1/completions", json=body, headers=AUTH).status_code == 200
