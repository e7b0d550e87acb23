"""The Python client (sync and asyncio): what it sends, how it reads, and end to end against a real worker."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest
import redis
from producer_helpers import done, error, publish, shared_worker, tokens

from common.keys import Keys
from common.protocol import parse_control, parse_request
from producer import AsyncClient, Client, GenerationCancelled, GenerationError, GenerationTimeout


@pytest.fixture
def client(redis_url, prefix):
    with Client(redis_url, prefix) as c:
        yield c


@pytest.fixture(scope="module")
def worker(request, redis_url, tiny_model_dir, tmp_path_factory):
    return shared_worker(request, redis_url, tiny_model_dir, tmp_path_factory)


def entries(r, key):
    return [(eid.decode(), {k.decode(): v.decode() for k, v in f.items()}) for eid, f in r.xrange(key)]


# ---------------------------------------------------------------------------- sending


def test_submit_sends_exact_fields(client, r, prefix):
    h = client.submit("Once upon a time", max_tokens=12, temperature=0, top_p=0.9, top_k=5, seed=7,
                      stop=["\n", "END"], ignore_eos=True, priority="high", timeout_s=30, id="req-1")
    assert h.id == "req-1" and h.key == f"{prefix}:result:req-1"
    k = Keys(prefix)
    got = entries(r, k.requests("high"))
    assert len(got) == 1
    assert got[0][1] == {"id": "req-1", "prompt": "Once upon a time", "max_tokens": "12", "temperature": "0",
                         "top_p": "0.9", "top_k": "5", "seed": "7", "stop": '["\\n", "END"]',
                         "ignore_eos": "true", "timeout_s": "30.0"}
    assert r.xlen(k.requests("normal")) == 0 and r.xlen(k.requests("low")) == 0
    req = parse_request(r.xrange(k.requests("high"))[0][1], entry_id=got[0][0], level="high", keys=k)
    assert (req.id, req.reply_to, req.priority, req.params.max_tokens, req.params.stop) == (
        "req-1", h.key, 0, 12, ["\n", "END"])


def test_submit_defaults_and_other_inputs(client, r, prefix):
    k = Keys(prefix)
    h = client.submit("hi")
    (eid, f), = entries(r, k.requests("normal"))
    assert f == {"id": h.id, "prompt": "hi"}  # protocol defaults are left out
    assert len(h.id) == 32
    client.submit(input_ids=[1, 2, 3], priority="low")
    client.submit(messages=[{"role": "user", "content": "hello"}], priority=2)
    low = [f for _, f in entries(r, k.requests("low"))]
    assert json.loads(low[0]["input_ids"]) == [1, 2, 3]
    assert json.loads(low[1]["messages"]) == [{"role": "user", "content": "hello"}]


@pytest.mark.parametrize("kwargs, needle", [
    ({}, "exactly one of prompt, input_ids or messages"),
    ({"prompt": "a", "input_ids": [1]}, "got prompt, input_ids"),
    ({"prompt": ""}, "prompt is empty"),
    ({"prompt": 5}, "prompt must be a string"),
    ({"prompt": "a", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "a", "max_tokens": 10**7}, "max_tokens must be in [1, 4096]"),
    ({"prompt": "a", "max_tokens": "12"}, "max_tokens"),
    ({"prompt": "a", "temperature": -1}, "temperature"),
    ({"prompt": "a", "top_p": 0}, "top_p"),
    ({"prompt": "a", "top_k": -2}, "top_k"),
    ({"prompt": "a", "seed": -1}, "seed"),
    ({"prompt": "a", "stop": [""]}, "stop"),
    ({"prompt": "a", "stop": 3}, "stop"),
    ({"prompt": "a", "ignore_eos": "yes"}, "ignore_eos"),
    ({"prompt": "a", "priority": "urgent"}, "unknown priority 'urgent'"),
    ({"prompt": "a", "priority": 7}, "unknown priority"),
    ({"prompt": "a", "id": "no spaces"}, "id must be"),
    ({"prompt": "a", "timeout_s": 0}, "timeout_s"),
    ({"prompt": "a", "timeout_s": "soon"}, "timeout_s"),
    ({"input_ids": []}, "input_ids must be a non-empty array"),
    ({"input_ids": [1, -3]}, "input_ids must hold integers"),
    ({"input_ids": "1 2 3"}, "input_ids must be a list"),
    ({"messages": []}, "messages must be a non-empty array"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user"}]}, "messages[0] must be an object"),
])
def test_bad_arguments_raise_before_sending(client, r, prefix, kwargs, needle):
    with pytest.raises(ValueError) as e:
        client.submit(**kwargs)
    assert needle in str(e.value), str(e.value)
    assert list(r.scan_iter(match=f"{prefix}:*")) == []


class CountingConnection(redis.Connection):
    """A real connection that counts how often it writes to the socket."""

    writes = 0

    def send_packed_command(self, command, check_health=True):
        type(self).writes += 1
        return super().send_packed_command(command, check_health)


def test_submit_many_is_one_round_trip(redis_url, r, prefix):
    pool = redis.ConnectionPool.from_url(redis_url, connection_class=CountingConnection)
    rc = redis.Redis(connection_pool=pool)
    rc.ping()
    with Client(redis_url, prefix, redis_client=rc) as client:
        CountingConnection.writes = 0
        hs = client.submit_many([{"prompt": f"p{i}", "max_tokens": 4, "priority": "high" if i % 2 else "low"}
                                 for i in range(20)])
        assert CountingConnection.writes == 1
        assert len({h.id for h in hs}) == 20
        k = Keys(prefix)
        assert [f["prompt"] for _, f in entries(r, k.requests("high"))] == [f"p{i}" for i in range(1, 20, 2)]
        assert [f["prompt"] for _, f in entries(r, k.requests("low"))] == [f"p{i}" for i in range(0, 20, 2)]
        # One bad request: a clear message naming it, and nothing at all is sent.
        with pytest.raises(ValueError, match=r"requests\[1\]: max_tokens"):
            client.submit_many([{"prompt": "ok"}, {"prompt": "x", "max_tokens": -1}])
        with pytest.raises(ValueError, match=r"requests\[0\].*unexpected keyword"):
            client.submit_many([{"prompt": "ok", "colour": "red"}])
        assert r.xlen(k.requests("normal")) == 0
        assert client.submit_many([]) == []
    rc.close()


def test_cancel_writes_control_entry(client, r, prefix):
    h = client.submit("hello", id="to-cancel")
    h.cancel()
    client.cancel("other.id")
    got = r.xrange(Keys(prefix).control)
    assert [parse_control(f) for _, f in got] == [("cancel", "to-cancel"), ("cancel", "other.id")]
    with pytest.raises(ValueError):
        client.cancel("bad id!")


# ---------------------------------------------------------------------------- reading (entries written with the protocol's encoders)


def test_read_all_and_result(client, r):
    h = client.attach("r1")
    publish(r, h.key, tokens((0, [5, 6], "Hel"), (2, [7], "lo")) + [done("r1", "length", 4, 3)])
    chunks = list(h)
    assert [(c.seq, c.token_ids, c.text) for c in chunks] == [(0, [5, 6], "Hel"), (2, [7], "lo")]
    res = h.result()
    assert (res.text, res.token_ids, res.finish_reason) == ("Hello", [5, 6, 7], "length")
    assert (res.usage.prompt_tokens, res.usage.completion_tokens, res.usage.total_tokens) == (4, 3, 7)
    assert (res.timings.queue_s, res.timings.ttft_s, res.timings.total_s) == (0.01, 0.02, 0.05)
    assert res.to_dict()["usage"] == {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7,
                                      "prompt_tokens_details": {"cached_tokens": 0}}
    assert h.done and h.finish_reason == "length" and list(h) == []


def test_chunks_arrive_as_they_are_written(client, r):
    h = client.attach("r2")
    done_at = []

    def writer():
        for i in range(3):
            time.sleep(0.15)
            publish(r, h.key, tokens((i, [i], str(i))))
        time.sleep(0.3)
        done_at.append(time.monotonic())
        publish(r, h.key, [done("r2")])

    t = threading.Thread(target=writer)
    t.start()
    seen = [(c.text, time.monotonic()) for c in h]
    t.join()
    assert [s for s, _ in seen] == ["0", "1", "2"]
    assert seen[0][1] < done_at[0], "the first chunk must be delivered before the request ends"
    assert h.result().text == "012"


def test_duplicate_seqs_are_dropped(client, r):
    """A request resumed by another worker re-sends what the stream already holds: read once."""
    h = client.attach("r3")
    publish(r, h.key, tokens((0, [1, 2], "ab"), (2, [3], "c"), (0, [1, 2], "ab"), (2, [3], "c"), (3, [4], "d"))
            + [done("r3")])
    assert [c.seq for c in h] == [0, 2, 3]
    assert h.result().text == "abcd" and h.token_ids == [1, 2, 3, 4]
    assert h._state.duplicates == 2


def test_reading_resumes_where_it_stopped(client, r, redis_url, prefix):
    h = client.attach("r4")
    publish(r, h.key, tokens((0, [1], "a"), (1, [2], "b"), (2, [3], "c")))
    it = iter(h)
    assert next(it).text == "a"
    # Stop early (a break); a new loop goes on from the next chunk, nothing repeated or lost.
    first_again = next(iter(h))
    assert first_again.text == "b"
    last_id = h.last_id
    assert last_id != "0-0"
    publish(r, h.key, tokens((3, [4], "d")) + [done("r4", "stop", 1, 4)])
    assert [c.text for c in h] == ["c", "d"]
    # Another process can pick up from a saved entry id (here: after the first three tokens).
    with Client(redis_url, prefix) as other:
        h2 = other.attach("r4", last_id=last_id, next_seq=3)
        assert [c.text for c in h2] == ["d"]
        assert h2.result().finish_reason == "stop"


def test_error_entry_raises(client, r):
    h = client.attach("r5")
    publish(r, h.key, tokens((0, [1], "x")) + [error("r5", "too_long", "prompt too long")])
    got = []
    with pytest.raises(GenerationError) as e:
        for c in h:
            got.append(c.text)
    assert got == ["x"]
    assert (e.value.code, e.value.message, e.value.request_id) == ("too_long", "prompt too long", "r5")
    with pytest.raises(GenerationError, match="too_long: prompt too long"):
        h.result()
    assert h.finish_reason == "error"


def test_entries_after_the_final_one_are_ignored(client, r):
    h = client.attach("r6")
    publish(r, h.key, tokens((0, [1], "x")) + [done("r6")] + tokens((1, [2], "y")) + [error("r6")])
    assert h.result().text == "x"


@pytest.mark.parametrize("reason, exc", [("timeout", GenerationTimeout), ("cancelled", GenerationCancelled)])
def test_timeout_and_cancelled_results(client, r, reason, exc):
    h = client.attach("r7")
    publish(r, h.key, [done("r7", reason)])
    res = h.result()
    assert res.finish_reason == reason
    with pytest.raises(exc):
        res.check()


def test_wait_timeout_leaves_the_request_readable(client, r):
    h = client.attach("r8")
    t0 = time.monotonic()
    with pytest.raises(GenerationTimeout) as e:
        h.result(timeout=0.3)
    assert 0.25 < time.monotonic() - t0 < 10.0  # generous: CI machines can be slow
    assert e.value.code == "wait_timeout" and isinstance(e.value, TimeoutError)
    with pytest.raises(GenerationTimeout):
        list(h.chunks(timeout=0.2))
    assert h.poll() == []
    publish(r, h.key, tokens((0, [9], "z")) + [done("r8")])
    assert [c.text for c in h.poll()] == ["z"]
    assert h.result(timeout=5).text == "z"


# ---------------------------------------------------------------------------- asyncio twin


def test_async_client_sends_and_reads(redis_url, prefix, r):
    async def main():
        async with AsyncClient(redis_url, prefix) as ac:
            h = await ac.submit("hi", max_tokens=3, priority="high", id="a1")
            (_, f), = entries(r, Keys(prefix).requests("high"))
            assert f == {"id": "a1", "prompt": "hi", "max_tokens": "3"}
            with pytest.raises(ValueError, match="temperature"):
                await ac.submit("x", temperature=500)
            hs = await ac.submit_many([{"prompt": "a"}, {"input_ids": [1, 2]}])
            assert r.xlen(Keys(prefix).requests("normal")) == 2

            def write():
                time.sleep(0.1)
                publish(r, h.key, tokens((0, [1], "a"), (1, [2], "b"), (0, [1], "a")) + [done("a1", "length", 2, 2)])

            t = threading.Thread(target=write)
            t.start()
            got = [c.text async for c in h]
            t.join()
            assert got == ["a", "b"]
            res = await h  # awaiting the handle is awaiting its result
            assert (res.text, res.finish_reason, res.usage.total_tokens) == ("ab", "length", 4)
            await hs[0].cancel()
            assert parse_control(r.xrange(Keys(prefix).control)[0][1]) == ("cancel", hs[0].id)
            publish(r, hs[1].key, [error(hs[1].id, "invalid_request", "nope")])
            with pytest.raises(GenerationError, match="invalid_request"):
                await hs[1].result()
            with pytest.raises(GenerationTimeout):
                await hs[0].result(timeout=0.2)
            # resume from a saved position (entry id + tokens had): the re-sent seq 0 is dropped
            h2 = ac.attach("a1", last_id=r.xrange(h.key)[1][0].decode(), next_seq=2)
            assert [c.text async for c in h2] == []
            assert (await h2.result()).finish_reason == "length"
            return True

    assert asyncio.run(main())


# ---------------------------------------------------------------------------- end to end: a real worker


def test_e2e_stream_and_result(worker, redis_url):
    prefix, _ = worker
    with Client(redis_url, prefix) as c:
        h = c.submit("Once upon a time", max_tokens=8, temperature=0, priority="high")
        chunks = list(h)
        res = h.result()
        assert res.finish_reason == "length"
        assert res.token_ids == [t for ch in chunks for t in ch.token_ids]
        assert [ch.seq for ch in chunks] == sorted({ch.seq for ch in chunks})
        assert res.text == "".join(ch.text for ch in chunks)
        assert res.usage.completion_tokens == 8 and res.usage.prompt_tokens > 0
        assert res.timings.total_s is not None and res.timings.ttft_s is not None
        # Greedy is deterministic, through any entry point.
        again = c.generate("Once upon a time", max_tokens=8, temperature=0, timeout=60)
        assert again.token_ids == res.token_ids


def test_e2e_submit_many_priorities_chat_and_ids(worker, redis_url):
    prefix, _ = worker
    with Client(redis_url, prefix) as c:
        hs = c.submit_many([
            {"prompt": "a b c", "max_tokens": 4, "temperature": 0, "priority": "low"},
            {"input_ids": [1, 5, 9, 13], "max_tokens": 3, "temperature": 0, "priority": "high"},
            {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 2, "priority": "normal"},
        ])
        results = [h.result(timeout=60) for h in hs]
        assert [len(x.token_ids) for x in results] == [4, 3, 2]
        assert results[1].usage.prompt_tokens == 4


def test_e2e_worker_errors_and_cancel(worker, redis_url):
    prefix, _ = worker
    with Client(redis_url, prefix) as c:
        with pytest.raises(GenerationError) as e:
            c.submit(input_ids=[7] * 3000, max_tokens=4).result(timeout=60)
        assert e.value.code == "too_long"
        h = c.submit("tell me everything", max_tokens=2000, ignore_eos=True, temperature=0)
        first = next(iter(h))
        assert first.token_ids
        h.cancel()
        res = h.result(timeout=60)
        assert res.finish_reason == "cancelled"
        assert 1 <= len(res.token_ids) < 2000
        with pytest.raises(GenerationCancelled):
            res.check()


def test_e2e_async(worker, redis_url):
    prefix, _ = worker

    async def main():
        async with AsyncClient(redis_url, prefix) as ac:
            hs = [await ac.submit(f"story {i}", max_tokens=5, temperature=0) for i in range(3)]

            async def consume(h):
                return "".join([c.text async for c in h]), await h

            outs = await asyncio.gather(*(consume(h) for h in hs))
            for text, res in outs:
                assert text == res.text and len(res.token_ids) == 5
            sync_ids = Client(redis_url, prefix).generate("story 0", max_tokens=5, temperature=0).token_ids
            assert outs[0][1].token_ids == sync_ids

    asyncio.run(main())
