"""Structured output with xgrammar on a random tiny model and the tiny byte-level tokenizer:
without a grammar it never writes valid JSON, with one every output parses and fits its schema
(greedy and sampled); regex, choice and EBNF likewise; bad grammars are invalid_request; the
matcher survives preemption and resumption; a compiling grammar never stalls the batch."""

from __future__ import annotations

import functools
import json
import re
import threading

import pytest
from engine_helpers import drive, make_engine, model_pair
from tiny import tiny_tokenizer

from common.protocol import SamplingParams

SCHEMA = {
    "type": "object",
    "properties": {
        # (xgrammar 0.2.8's maxLength strings admit raw control characters, which JSON does not)
        "name": {"type": "string", "pattern": "^[A-Za-z ]{1,6}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "ok": {"type": "boolean"},
        "color": {"enum": ["red", "green", "blue"]},
    },
    "required": ["name", "age", "ok", "color"],
    "additionalProperties": False,
}


def fits(text: str) -> bool:
    """``text`` is JSON that validates against SCHEMA."""
    try:
        v = json.loads(text)
    except ValueError:
        return False
    return (isinstance(v, dict) and set(v) == set(SCHEMA["required"]) and isinstance(v["name"], str) and re.fullmatch("[A-Za-z ]{1,6}", v["name"])
            and type(v["age"]) is int and 0 <= v["age"] <= 120 and isinstance(v["ok"], bool) and v["color"] in ("red", "green", "blue"))


@functools.cache
def model():
    return model_pair("llama", seed=3)[0]


@functools.cache
def tok():
    return tiny_tokenizer()


def engine(**cfg):
    cfg.setdefault("num_pages", 128)
    return make_engine(model(), tok(), **cfg)


PROMPT = tok().encode("Give me a JSON object: ")
SAMPLED = [dict(temperature=0)] + [dict(temperature=1.0, seed=s) for s in range(5)]


def run_all(so: dict | None, max_tokens: int = 80, **cfg):
    reqs = {f"r{i}": (PROMPT, SamplingParams(max_tokens=max_tokens, structured_outputs=so, **kw)) for i, kw in enumerate(SAMPLED)}
    return reqs, drive(engine(**cfg), {0: [(rid, pr, p) for rid, (pr, p) in reqs.items()]})


def test_json_schema_every_output_fits_and_none_without():
    _, free = run_all(None)
    assert not any(fits(free.text(rid)) for rid in free.outputs)
    assert not any(_parses(free.text(rid)) for rid in free.outputs)
    _, run = run_all({"json": SCHEMA})
    for rid in run.outputs:
        text = run.text(rid)
        assert fits(text), (rid, text)
        # bounded whitespace: exactly json.dumps' separators, nothing padded
        assert run.reason(rid) == "stop" and text == json.dumps(json.loads(text), ensure_ascii=False)
    assert len({run.text(rid) for rid in run.outputs}) > 2  # sampled outputs differ


def _parses(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except ValueError:
        return False


@pytest.mark.parametrize("so,check", [
    ({"regex": r"[a-z]{2,5}-[0-9]{3}"}, lambda t: re.fullmatch(r"[a-z]{2,5}-[0-9]{3}", t)),
    ({"choice": ["yes", "no", "maybe not"]}, lambda t: t in ("yes", "no", "maybe not")),
    ({"grammar": 'root ::= ("ab" | "cd") " " [xyz] [0-9]'}, lambda t: re.fullmatch(r"(ab|cd) [xyz][0-9]", t)),
])
def test_regex_choice_and_grammar(so, check):
    _, free = run_all(None, max_tokens=12)
    assert not any(check(free.text(rid)) for rid in free.outputs)
    _, run = run_all(so, max_tokens=40)
    for rid in run.outputs:
        assert check(run.text(rid)), (rid, run.text(rid))
        assert run.reason(rid) == "stop"


def test_json_object_ends_as_an_object():
    _, run = run_all({"json_object": True}, max_tokens=60)
    for rid in run.outputs:
        text = run.text(rid)
        assert text.startswith("{"), text
        if run.reason(rid) == "stop":
            assert isinstance(json.loads(text), dict)


@pytest.mark.parametrize("so,what", [
    ({"regex": "[a-"}, "structured_outputs.regex is invalid"),
    ({"json": {"type": 5}}, "structured_outputs.json is invalid"),
    ({"grammar": "root ::= undefined_rule"}, "structured_outputs.grammar is invalid"),
])
def test_invalid_grammar_is_an_invalid_request_error(so, what):
    e = engine()
    run = drive(e, {0: [("bad", PROMPT, SamplingParams(max_tokens=5, structured_outputs=so, n=2)),
                        ("good", PROMPT, SamplingParams(max_tokens=5, temperature=0))]})
    final = run.final("bad")
    assert final.finish_reason == "error" and final.error[0] == "invalid_request" and what in final.error[1]
    assert not run.tokens("bad") and len(run.tokens("good")) == 5


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_matcher_survives_preemption(mode):
    reqs, roomy = run_all({"json": SCHEMA})
    tight = engine(page_size=4, num_pages=32, max_num_seqs=6, max_num_batched_tokens=16, preemption_mode=mode, swap_pages=12)
    run = drive(tight, {0: [(rid, pr, p) for rid, (pr, p) in reqs.items()]})
    assert tight.stats.num_preemptions >= 3
    for rid in reqs:
        assert run.tokens(rid) == roomy.tokens(rid) and fits(run.text(rid))


def test_resumed_request_rebuilds_the_matcher():
    reqs, full = run_all({"json": SCHEMA})
    e = engine()
    for rid, (pr, p) in reqs.items():
        done = full.tokens(rid)
        e.add_request(rid, pr, p, generated_ids=done[:len(done) // 2])
    rest = drive(e)
    for rid in reqs:
        done = full.tokens(rid)
        assert rest.tokens(rid) == done[len(done) // 2:]


def test_a_compiling_grammar_does_not_stall_the_batch():
    e = engine()
    grammars = e._grammars()
    gate = threading.Event()
    real = grammars._compile
    grammars._compile = lambda spec: (gate.wait(30), real(spec))[1]  # a schema that takes long to compile
    e.add_request("slow", PROMPT, SamplingParams(max_tokens=60, structured_outputs={"json": SCHEMA}, temperature=0))
    e.add_request("plain", PROMPT, SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    plain = []
    for _ in range(8):
        for o in e.step():
            assert o.request_id == "plain"
            plain += o.new_token_ids
    assert len(plain) == 5 and "slow" in e
    gate.set()
    run = drive(e)
    assert fits(run.text("slow"))
