"""The worker service on real Redis, driven only with raw redis-py commands (no tokenq client)."""

from __future__ import annotations

import json
import time

import msgpack
import pytest
import torch
from helpers import read_result
from transformers import AutoModelForCausalLM, AutoTokenizer


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    """Greedy continuation of ``ids`` by transformers' own generate, alone, in float64."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float64).eval()
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)

    def generate(ids: list[int], n: int) -> list[int]:
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
        return out[0, len(ids):].tolist()

    generate.tokenizer = tok
    return generate


def xadd(r, prefix, level="normal", **fields):
    return r.xadd(f"{prefix}:requests:{level}", {k: v for k, v in fields.items()}).decode()


def test_any_redis_client_prompt_ids_messages_payload(r, prefix, worker_factory, reference):
    worker_factory(prefix)
    tok = reference.tokenizer
    xadd(r, prefix, "high", id="p1", prompt="Once upon a time", max_tokens="12", temperature="0", ignore_eos="true")
    xadd(r, prefix, "normal", id="p2", input_ids=json.dumps([5, 6, 7, 8]), max_tokens="6", temperature="0", ignore_eos="1")
    msgs = [{"role": "user", "content": "hello queue"}]
    xadd(r, prefix, "low", id="p3", messages=json.dumps(msgs), max_tokens="5", temperature="0", ignore_eos="true")
    xadd(r, prefix, "normal", payload=msgpack.packb({"id": "p4", "input_ids": [9, 10, 11], "max_tokens": 4, "temperature": 0, "ignore_eos": True}))

    prompt_ids = tok("Once upon a time").input_ids
    ids, text, done, _ = read_result(r, f"{prefix}:result:p1")
    assert done["type"] == "done" and done["finish_reason"] == "length"
    assert ids == reference(prompt_ids, 12)
    assert text == tok.decode(ids, skip_special_tokens=True)
    assert int(done["prompt_tokens"]) == len(prompt_ids) and int(done["completion_tokens"]) == 12
    assert float(done["total_s"]) >= float(done["ttft_s"]) >= float(done["queue_s"]) >= 0

    ids, _, done, _ = read_result(r, f"{prefix}:result:p2")
    assert ids == reference([5, 6, 7, 8], 6)
    chat_ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False)
    ids, _, done, _ = read_result(r, f"{prefix}:result:p3")
    assert int(done["prompt_tokens"]) == len(chat_ids) and ids == reference(list(chat_ids), 5)
    ids, _, done, _ = read_result(r, f"{prefix}:result:p4")
    assert ids == reference([9, 10, 11], 4)
    # acknowledged and deleted once final: nothing pending, nothing left in the streams
    for level in ("high", "normal", "low"):
        assert r.xlen(f"{prefix}:requests:{level}") == 0
        assert r.xpending(f"{prefix}:requests:{level}", f"{prefix}:workers")["pending"] == 0
    ttl = r.ttl(f"{prefix}:result:p1")
    assert 0 < ttl <= 3600


def test_entry_id_is_the_default_request_id(r, prefix, worker_factory):
    worker_factory(prefix)
    entry = xadd(r, prefix, prompt="hi", max_tokens="2")
    _, _, done, _ = read_result(r, f"{prefix}:result:{entry}")
    assert done["type"] == "done" and done["id"] == entry


BAD = [
    ({"prompt": "x", "max_tokens": "ten"}, "max_tokens"),
    ({"prompt": "x", "temperature": "-2"}, "temperature"),
    ({"prompt": "x", "top_p": "abc"}, "top_p"),
    ({"input_ids": "[1, 2"}, "JSON"),
    ({"input_ids": "[999999]"}, "vocabulary"),
    ({"messages": "not json"}, "JSON"),
    ({"prompt": ""}, "empty"),
    ({"prompt": "a", "input_ids": "[1]"}, "exactly one"),
    ({"temperature": "0"}, "exactly one"),
    ({"payload": b"\xc1garbage"}, "msgpack"),
    ({"prompt": "x", "stop": "[1]"}, "stop"),
]


def test_bad_input_gets_errors_and_worker_keeps_serving(r, prefix, worker_factory):
    w = worker_factory(prefix)
    for i, (fields, _) in enumerate(BAD):
        xadd(r, prefix, id=f"bad{i}", **fields)
    xadd(r, prefix, id="long", input_ids=json.dumps(list(range(3, 300)) * 8), max_tokens="10")  # 2376 > max_model_len (2048)
    xadd(r, prefix, "urgent", id="lost", prompt="x")  # a priority stream that does not exist
    xadd(r, prefix, id="evil", prompt="x", reply_to="somebody:else:key")  # never written outside the prefix
    xadd(r, prefix, id="good", prompt="still here?", max_tokens="3")
    for i, (_, needle) in enumerate(BAD):
        _, _, final, _ = read_result(r, f"{prefix}:result:bad{i}")
        assert final["type"] == "error" and final["code"] == "invalid_request", final
        assert needle in final["message"], final
    _, _, final, _ = read_result(r, f"{prefix}:result:long")
    assert final["type"] == "error" and final["code"] == "too_long" and "exceeds" in final["message"]
    _, _, final, _ = read_result(r, f"{prefix}:result:lost", timeout=30)
    assert final["type"] == "error" and "unknown priority stream" in final["message"]
    _, _, final, _ = read_result(r, f"{prefix}:result:good")
    assert final["type"] == "done"
    assert not r.exists("somebody:else:key")
    dead = [{k.decode(): v.decode() for k, v in f.items()} for _, f in r.xrange(f"{prefix}:dead")]
    assert any(d["id"] == "evil" and "reply_to" in d["message"] for d in dead)
    assert r.xlen(f"{prefix}:requests:normal") == 0 and w.proc.poll() is None
    assert "code=invalid_request" in w.log


def wait_tokens(r, key, n, timeout=60):
    deadline = time.monotonic() + timeout
    while r.xlen(key) < n:
        assert time.monotonic() < deadline, f"{key} never reached {n} entries"
        time.sleep(0.02)


def heartbeat(r, prefix, name):
    return {k.decode(): v.decode() for k, v in r.hgetall(f"{prefix}:worker:{name}").items()}


def test_cancel_running_and_waiting(r, prefix, worker_factory):
    w = worker_factory(prefix, args=["--max-num-seqs", "1"])
    xadd(r, prefix, id="run", prompt="go on", max_tokens="900", ignore_eos="true", temperature="0")
    wait_tokens(r, f"{prefix}:result:run", 2)
    xadd(r, prefix, id="queued", prompt="me too", max_tokens="5")  # no slot: stays in Redis
    r.xadd(f"{prefix}:control", {"type": "cancel", "id": "queued"})
    time.sleep(0.5)
    r.xadd(f"{prefix}:control", {"type": "cancel", "id": "run"})
    ids, _, final, _ = read_result(r, f"{prefix}:result:run", timeout=30)
    assert final["type"] == "done" and final["finish_reason"] == "cancelled" and len(ids) < 900
    _, _, final, _ = read_result(r, f"{prefix}:result:queued", timeout=30)
    assert final["finish_reason"] == "cancelled" and final["completion_tokens"] == "0"
    time.sleep(1.0)
    hb = heartbeat(r, prefix, w.name)
    assert hb["pages_free"] == hb["pages_total"] and hb["running"] == "0"
    assert r.xlen(f"{prefix}:requests:normal") == 0


def test_pulls_only_what_it_can_admit(r, prefix, worker_factory):
    worker_factory(prefix, args=["--max-num-seqs", "2"])
    for i in range(8):
        xadd(r, prefix, id=f"q{i}", prompt="count", max_tokens="40", ignore_eos="true")
    wait_tokens(r, f"{prefix}:result:q0", 2)
    pending = r.xpending(f"{prefix}:requests:normal", f"{prefix}:workers")["pending"]
    assert pending <= 2, "the worker holds a private backlog"
    assert r.xlen(f"{prefix}:requests:normal") >= 6  # the rest waits in Redis for any worker
    for i in range(8):
        assert read_result(r, f"{prefix}:result:q{i}")[2]["type"] == "done"


def test_high_priority_pulled_past_a_full_engine(r, prefix, worker_factory):
    worker_factory(prefix, args=["--max-num-seqs", "2"])
    for i in range(2):
        xadd(r, prefix, "low", id=f"low{i}", prompt="slow", max_tokens="200", ignore_eos="true")
    wait_tokens(r, f"{prefix}:result:low1", 2)
    xadd(r, prefix, "high", id="vip", prompt="urgent", max_tokens="5")
    _, _, vip, _ = read_result(r, f"{prefix}:result:vip", timeout=60)
    assert vip["type"] == "done"
    assert r.xlen(f"{prefix}:result:low0") < 200 or r.xlen(f"{prefix}:result:low1") < 200  # lows still running
    for i in range(2):
        ids, _, final, _ = read_result(r, f"{prefix}:result:low{i}", timeout=120)
        assert final["finish_reason"] == "length" and len(ids) == 200


def test_worker_killed_mid_generation_loses_nothing(r, prefix, worker_factory, reference):
    # Killed after a request's second entry (its first goes out at once, the next 20 ms later),
    # with 200 tokens each to go: killed after the fifth with 60 to go, a fast machine had
    # finished all six requests by then, and the rescuer had nothing left to claim.
    n = 200
    a = worker_factory(prefix, name="victim")
    prompts = {f"c{i}": [3 + i, 40 + i, 7, 99 - i] for i in range(6)}
    for rid, ids in prompts.items():
        xadd(r, prefix, ["high", "normal", "low"][int(rid[1:]) % 3], id=rid, input_ids=json.dumps(ids), max_tokens=str(n),
             temperature="0", ignore_eos="true")
    wait_tokens(r, f"{prefix}:result:c0", 2)
    a.kill()  # SIGKILL mid-generation
    unfinished = [rid for rid in prompts if not any(e[b"type"] == b"done" for _, e in r.xrange(f"{prefix}:result:{rid}"))]
    assert unfinished, "the victim finished every request before it was killed: nothing was left to claim"
    b = worker_factory(prefix, name="rescuer")
    for rid, ids in prompts.items():
        got, _, final, raw = read_result(r, f"{prefix}:result:{rid}", timeout=120)
        assert final["type"] == "done" and final["finish_reason"] == "length", final
        assert got == reference(ids, n), rid
        tokens = [(int(e["seq"]), len(json.loads(e["ids"]))) for e in raw if e["type"] == "token"]
        starts = [0, *(seq + k for seq, k in tokens[:-1])]
        assert [seq for seq, _ in tokens] == starts and sum(k for _, k in tokens) == n, f"{rid}: entries {tokens}"
    for level in ("high", "normal", "low"):
        assert r.xpending(f"{prefix}:requests:{level}", f"{prefix}:workers")["pending"] == 0
    assert "event=claimed" in b.log


def test_sigterm_finishes_or_releases(r, prefix, worker_factory, reference):
    a = worker_factory(prefix, name="leaving", args=["--grace-s", "0.1"])
    xadd(r, prefix, id="short", input_ids="[4, 5, 6]", max_tokens="3", temperature="0", ignore_eos="true")
    xadd(r, prefix, id="long", input_ids="[7, 8, 9]", max_tokens="600", temperature="0", ignore_eos="true")
    wait_tokens(r, f"{prefix}:result:long", 3)
    assert a.stop() == 0
    assert "event=released" in a.log
    assert read_result(r, f"{prefix}:result:short")[2]["type"] == "done"
    worker_factory(prefix, name="successor")
    ids, _, final, _ = read_result(r, f"{prefix}:result:long", timeout=120)
    assert final["type"] == "done" and ids == reference([7, 8, 9], 600)


def test_poison_entry_goes_to_dead_letter(r, prefix, worker_factory):
    stream, group = f"{prefix}:requests:normal", f"{prefix}:workers"
    r.xgroup_create(stream, group, id="0", mkstream=True)
    entry = r.xadd(stream, {"id": "poison", "prompt": "boom"})
    # Three workers took it and died (each delivery counts); it now sits idle in a dead consumer.
    r.xreadgroup(group, "ghost", {stream: ">"}, count=1)
    for _ in range(3):
        r.xclaim(stream, group, "ghost", 0, [entry])
    w = worker_factory(prefix, args=["--max-attempts", "3", "--claim-idle-s", "0.5"])
    _, _, final, _ = read_result(r, f"{prefix}:result:poison", timeout=30)
    assert final["type"] == "error" and final["code"] == "internal" and "5 deliveries" in final["message"]  # 1 read + 3 claims + ours
    dead = [{k.decode(): v.decode() for k, v in f.items()} for _, f in r.xrange(f"{prefix}:dead")]
    assert [d["id"] for d in dead] == ["poison"]
    assert r.xpending(stream, group)["pending"] == 0 and "event=dead_letter" in w.log


def test_redis_restart_under_a_running_worker(prefix, local_redis, worker_factory, reference):
    import redis

    server = local_redis(appendonly=True)
    r = redis.Redis.from_url(server.url)
    w = worker_factory(prefix, url=server.url)
    xadd(r, prefix, id="survivor", input_ids="[11, 12, 13]", max_tokens="200", temperature="0", ignore_eos="true")
    wait_tokens(r, f"{prefix}:result:survivor", 3)
    server.stop(kill=True)  # AOF with fsync always: what was written survives
    time.sleep(3)  # longer than the client's own retries: the worker must buffer and reconnect
    server.start()
    r = redis.Redis.from_url(server.url)
    ids, _, final, _ = read_result(r, f"{prefix}:result:survivor", timeout=120)
    assert final["type"] == "done" and ids == reference([11, 12, 13], 200)
    assert w.proc.poll() is None and "event=redis_down" in w.log
    xadd(r, prefix, id="after", prompt="again", max_tokens="3")
    assert read_result(r, f"{prefix}:result:after")[2]["type"] == "done"


def test_heartbeat(r, prefix, worker_factory):
    w = worker_factory(prefix)
    hb = heartbeat(r, prefix, w.name)
    for field in ("model", "device", "pages_total", "pages_free", "running", "waiting", "tokens_per_s", "last_step"):
        assert field in hb
    assert hb["device"] == "cpu" and int(hb["pages_total"]) == 256
    assert 0 < r.ttl(f"{prefix}:worker:{w.name}") <= 10
    assert w.stop() == 0
    assert not r.exists(f"{prefix}:worker:{w.name}")


def test_a_starting_worker_beats_before_its_first_read(r, prefix, worker_factory):
    """The first heartbeat goes out as the service starts, not after its first read of the
    streams, which blocks for a second when nothing waits: the heartbeat is what says that a
    worker serves (the bench's start-up time, `tokenq` status)."""
    w = worker_factory(prefix, args=["--heartbeat-s", "5"])  # the idle read blocks min(5, 1) s
    written = float(heartbeat(r, prefix, w.name)["last_step"])  # the beat's own time.time()
    line = next(line for line in w.log.splitlines() if "event=start" in line)
    started = time.mktime(time.strptime(line[:19], "%Y-%m-%d %H:%M:%S")) + int(line[20:23]) / 1000
    assert written - started < 0.5, (written - started, line)


def test_tokens_of_fast_steps_go_out_together(r, prefix, worker_factory, reference):
    """stream_interval_ms: the first token at once, then the tokens of faster steps in one
    entry each interval (logprobs and choices joined along), contiguous, the same tokens."""
    worker_factory(prefix, args=["--stream-interval-ms", "400"])
    xadd(r, prefix, id="one", input_ids=json.dumps([5, 6, 7, 8]), max_tokens="40", temperature="0", ignore_eos="1",
         logprobs="2")
    xadd(r, prefix, id="two", input_ids=json.dumps([9, 10]), max_tokens="30", n="2", temperature="0", ignore_eos="1")
    ids, _, done, raw = read_result(r, f"{prefix}:result:one")
    assert ids == reference([5, 6, 7, 8], 40) and done["completion_tokens"] == "40"
    tokens = [e for e in raw if e["type"] == "token"]
    assert len(json.loads(tokens[0]["ids"])) == 1  # the first token is never held back
    assert len(tokens) < 40 and max(len(json.loads(e["ids"])) for e in tokens) > 1
    assert all(len(json.loads(e["logprobs"])) == len(json.loads(e["ids"])) for e in tokens)
    assert [int(e["seq"]) for e in tokens] == [0, *(int(e["seq"]) + len(json.loads(e["ids"])) for e in tokens[:-1])]
    _, _, done, raw = read_result(r, f"{prefix}:result:two")
    choices: dict[str, list[int]] = {"0": [], "1": []}
    for e in raw:
        if e["type"] == "token":
            assert int(e["seq"]) == len(choices[e["index"]])
            choices[e["index"]] += json.loads(e["ids"])
    assert choices["0"] == choices["1"] == reference([9, 10], 30) and json.loads(done["finish_reasons"]) == ["length"] * 2
