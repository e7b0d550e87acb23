"""The wire protocol: every request field, both encodings, the bad cases, result entries."""

import json

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from common.errors import INVALID_REQUEST, ProtocolError
from common.keys import Keys, priority_of
from common.protocol import (
    Limits,
    Request,
    SamplingParams,
    decode_result,
    done_entry,
    error_entry,
    parse_control,
    parse_request,
    token_entry,
)

K = Keys("tq")


def parse(fields, **kw):
    raw = {k.encode(): (v if isinstance(v, bytes) else str(v).encode()) for k, v in fields.items()}
    return parse_request(raw, entry_id="1700000000000-0", keys=K, **kw)


def bad(fields, needle, **kw):
    with pytest.raises(ProtocolError) as e:
        parse(fields, **kw)
    assert e.value.code == INVALID_REQUEST
    assert needle in e.value.message, e.value.message
    return e.value


def test_keys():
    assert K.requests("high") == "tq:requests:high"
    assert K.request_streams == ["tq:requests:high", "tq:requests:normal", "tq:requests:low"]
    assert K.group == "tq:workers" and K.control == "tq:control" and K.dead == "tq:dead"
    assert K.result("abc") == "tq:result:abc" and K.worker("w1") == "tq:worker:w1"
    assert K.level_of_stream("tq:requests:low") == "low" and K.level_of_stream("tq:requests:urgent") is None
    assert [priority_of(x) for x in ("high", "normal", "low", 2)] == [0, 1, 2, 2]
    with pytest.raises(ValueError):
        priority_of("urgent")


def test_prompt_defaults():
    req = parse({"prompt": "Once upon a time"})
    assert req.prompt == "Once upon a time" and req.id == "1700000000000-0"
    assert req.reply_to == "tq:result:1700000000000-0" and req.priority == 1
    assert req.params == SamplingParams()


def test_every_field_flat():
    req = parse({
        "id": "job-1", "prompt": "hi", "max_tokens": "32", "temperature": "0.5", "top_p": "0.9", "top_k": "40",
        "seed": "7", "stop": '["\\n", "END"]', "ignore_eos": "true", "reply_to": "tq:result:mine", "timeout_s": "2.5",
        "stop_token_ids": "[5, 6]", "unknown_field": "ignored",
    }, level="high")
    p = req.params
    assert (req.id, req.reply_to, req.priority, req.timeout_s) == ("job-1", "tq:result:mine", 0, 2.5)
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.seed) == (32, 0.5, 0.9, 40, 7)
    assert p.stop == ["\n", "END"] and p.ignore_eos is True and p.stop_token_ids == [5, 6]


def test_stop_as_plain_string():
    assert parse({"prompt": "x", "stop": "END"}).params.stop == ["END"]


def test_input_ids_json_and_msgpack():
    assert parse({"input_ids": "[1, 2, 3]"}).input_ids == [1, 2, 3]
    assert parse({"input_ids": msgpack.packb([4, 5])}).input_ids == [4, 5]


def test_messages():
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert parse({"messages": json.dumps(msgs)}).messages == msgs


def test_payload_msgpack_map():
    payload = msgpack.packb({"id": "p1", "input_ids": [1, 2], "max_tokens": 3, "temperature": 0, "ignore_eos": True, "stop": ["x"]})
    req = parse({"payload": payload})
    assert req.id == "p1" and req.input_ids == [1, 2]
    assert req.params.max_tokens == 3 and req.params.temperature == 0 and req.params.ignore_eos and req.params.stop == ["x"]


def test_cache_salt_is_an_optional_string():
    assert parse({"prompt": "x"}).params.cache_salt is None
    assert parse({"prompt": "x", "cache_salt": "tenant-7"}).params.cache_salt == "tenant-7"
    assert parse({"payload": msgpack.packb({"prompt": "x", "cache_salt": "t"})}).params.cache_salt == "t"
    req = Request(id="r1", reply_to="tq:result:r1", params=SamplingParams(cache_salt="tenant 7 \u00e9"), prompt="hi")
    assert req.to_fields()["cache_salt"] == "tenant 7 \u00e9" and parse(req.to_fields()).params == req.params
    with pytest.raises(ValueError, match="cache_salt"):
        SamplingParams(cache_salt=7)


def test_round_trip_to_fields():
    req = Request(id="r1", reply_to="tq:result:r1", params=SamplingParams(max_tokens=9, temperature=0, stop=["a"], seed=3, ignore_eos=True),
                  prompt="hello", timeout_s=1.5)
    back = parse(req.to_fields())
    assert (back.id, back.prompt, back.params, back.timeout_s) == ("r1", "hello", req.params, 1.5)


@pytest.mark.parametrize("fields, needle", [
    ({}, "exactly one of prompt"),
    ({"prompt": "a", "input_ids": "[1]"}, "exactly one"),
    ({"prompt": ""}, "prompt is empty"),
    ({"prompt": b"\xff\xfe"}, "not valid UTF-8"),
    ({"prompt": "x" * 101}, "more than the limit"),
    ({"input_ids": "[1, 2"}, "not valid JSON"),
    ({"input_ids": "[]"}, "non-empty array"),
    ({"input_ids": '["a"]'}, "integers"),
    ({"input_ids": "[-1]"}, "integers"),
    ({"input_ids": b"\xc1\x00"}, "neither JSON nor msgpack"),
    ({"messages": "{}"}, "non-empty array"),
    ({"messages": '[{"role": "user"}]'}, "string 'role' and 'content'"),
    ({"messages": '[{"role": "wizard", "content": "x"}]'}, "role must be one of"),
    ({"messages": "[" * 100000 + "]" * 100000}, "not valid JSON"),
    ({"prompt": "x", "max_tokens": "ten"}, "max_tokens must be an integer"),
    ({"prompt": "x", "max_tokens": "0"}, "max_tokens must be in"),
    ({"prompt": "x", "max_tokens": "99999999"}, "max_tokens must be in"),
    ({"prompt": "x", "temperature": "hot"}, "temperature must be a number"),
    ({"prompt": "x", "temperature": "-1"}, "temperature must be in"),
    ({"prompt": "x", "temperature": "nan"}, "temperature must be in"),
    ({"prompt": "x", "top_p": "0"}, "top_p must be in"),
    ({"prompt": "x", "top_p": "1.5"}, "top_p must be in"),
    ({"prompt": "x", "top_k": "-3"}, "top_k must be in"),
    ({"prompt": "x", "seed": "1.5"}, "seed must be an integer"),
    ({"prompt": "x", "stop": "[1, 2]"}, "stop strings"),
    ({"prompt": "x", "stop": json.dumps(["a"] * 17)}, "at most 16"),
    ({"prompt": "x", "ignore_eos": "maybe"}, "ignore_eos must be a boolean"),
    ({"prompt": "x", "cache_salt": ""}, "cache_salt must be a string of 1 to 256"),
    ({"prompt": "x", "cache_salt": "s" * 257}, "cache_salt must be a string"),
    ({"prompt": "x", "cache_salt": b"\xff"}, "cache_salt is not valid UTF-8"),
    ({"prompt": "x", "timeout_s": "0"}, "timeout_s must be in"),
    ({"prompt": "x", "id": "bad id with spaces"}, "id must be"),
    ({"prompt": "x", "id": "a\x00b"}, "id must be"),
    ({"prompt": "x", "reply_to": "other:key"}, "reply_to must be a key under"),
    ({"prompt": "x", "reply_to": "tq:result:a b"}, "reply_to must be"),
    ({"payload": b"\xc1"}, "payload is not valid msgpack"),
    ({"payload": msgpack.packb([1, 2])}, "payload must be a msgpack map"),
])
def test_bad_fields(fields, needle):
    bad(fields, needle, limits=Limits(max_prompt_chars=100))


def test_error_knows_where_to_reply():
    e = bad({"id": "r9", "prompt": "x", "max_tokens": "ten"}, "max_tokens")
    assert (e.request_id, e.reply_to) == ("r9", "tq:result:r9")
    e = bad({"id": "r9", "prompt": "x", "reply_to": "evil"}, "reply_to")
    assert e.reply_to is None  # never write outside the prefix: the service dead-letters it
    e = bad({"id": "no good", "prompt": "x"}, "id must be")
    assert e.reply_to is None


@given(st.dictionaries(st.sampled_from(["prompt", "input_ids", "messages", "max_tokens", "temperature", "top_p", "top_k",
                                        "seed", "stop", "ignore_eos", "cache_salt", "id", "reply_to", "timeout_s", "payload", "x"]),
                       st.one_of(st.binary(max_size=64), st.text(max_size=64).map(str.encode))))
def test_fuzz_never_crashes(fields):
    try:
        req = parse_request(fields, entry_id="1-0", keys=K)
    except ProtocolError as e:
        assert e.code == INVALID_REQUEST and e.message
    else:
        assert req.reply_to.startswith("tq:result:")


def test_sampling_params_validation():
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    assert SamplingParams(stop="x").stop == ["x"]
    assert SamplingParams(temperature=0).greedy


def test_result_entries_round_trip():
    t = decode_result({k.encode(): v.encode() for k, v in token_entry(3, [5, 6], "h\u00e9").items()})
    assert (t.type, t.seq, t.ids, t.text, t.final) == ("token", 3, [5, 6], "h\u00e9", False)
    d = decode_result(done_entry("r", "length", prompt_tokens=4, completion_tokens=2, queue_s=0.5, ttft_s=None, total_s=1.0))
    assert (d.type, d.finish_reason, d.prompt_tokens, d.completion_tokens, d.queue_s, d.ttft_s, d.final) == ("done", "length", 4, 2, 0.5, None, True)
    e = decode_result(error_entry("r", "too_long", "no"))
    assert (e.type, e.code, e.message, e.final) == ("error", "too_long", "no", True)
    c = decode_result(done_entry("r", "stop", prompt_tokens=40, completion_tokens=2, queue_s=0, ttft_s=0.1, total_s=1.0,
                                 cached_tokens=32))
    assert (c.prompt_tokens, c.cached_tokens) == (40, 32) and d.cached_tokens == 0
    old = {k: v for k, v in done_entry("r", "stop", prompt_tokens=4, completion_tokens=2, queue_s=0, ttft_s=None,
                                       total_s=1.0).items() if k != "cached_tokens"}
    assert decode_result(old).cached_tokens == 0  # a done entry of an older worker


def test_control():
    assert parse_control({b"type": b"cancel", b"id": b"abc"}) == ("cancel", "abc")
    assert parse_control({b"type": b"reboot", b"id": b"abc"}) is None
    assert parse_control({b"type": b"cancel", b"id": b"a b"}) is None


def test_payload_merges_with_flat_fields():
    packed = msgpack.packb({"input_ids": [1, 2], "max_tokens": 4, "ignore_eos": True})
    req = parse_request({b"payload": packed, b"id": b"flat", b"max_tokens": b"4", b"ignore_eos": b"true"},
                        entry_id="1-1", keys=K)
    assert req.id == "flat" and req.reply_to == K.result("flat") and req.params.max_tokens == 4
    with pytest.raises(ProtocolError) as e:
        parse_request({b"payload": packed, b"max_tokens": b"5", b"id": b"x"}, entry_id="1-1", keys=K)
    assert e.value.code == INVALID_REQUEST and "max_tokens is given both" in e.value.message
    assert e.value.reply_to == K.result("x")  # the error goes where the flat id points
