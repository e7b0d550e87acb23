"""Output features through Redis with raw redis-py: logprobs and prompt logprobs on token
entries, n choices on one result stream, structured output (flat JSON fields and msgpack
payload), invalid grammars as error entries, and n choices + a grammar resumed by a peer."""

from __future__ import annotations

import json
import re
import signal
import time

import msgpack
import pytest
import torch
from helpers import _str
from transformers import AutoModelForCausalLM


@pytest.fixture(scope="module")
def ref_model(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float64).eval()


def entries(r, key: str, timeout: float = 60.0) -> list[dict[str, str]]:
    """Every entry of a result stream up to its final one."""
    last, out = "0", []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for _, es in r.xread({key: last}, block=500, count=100) or []:
            for eid, fields in es:
                last = eid
                out.append(_str(fields))
                if out[-1]["type"] != "token":
                    return out
    raise TimeoutError(f"no final entry on {key}: {out[-3:]}")


def choices(es: list[dict[str, str]]) -> dict[int, list[int]]:
    """Tokens per choice, each contiguous from seq 0 (re-sent seqs after a resume dropped)."""
    got: dict[int, list[int]] = {}
    for e in es:
        if e["type"] == "token":
            ids = got.setdefault(int(e.get("index", 0)), [])
            assert int(e["seq"]) <= len(ids)
            if int(e["seq"]) == len(ids):
                ids.extend(json.loads(e["ids"]))
    return got


def test_logprobs_on_token_entries(r, prefix, worker_factory, ref_model):
    worker_factory(prefix)
    prompt = [5, 6, 7, 8, 9]
    r.xadd(f"{prefix}:requests:normal", {"id": "lp", "input_ids": json.dumps(prompt), "max_tokens": "6", "temperature": "0",
                                         "ignore_eos": "true", "logprobs": "3", "prompt_logprobs": "2"})
    es = entries(r, f"{prefix}:result:lp")
    tokens = [e for e in es if e["type"] == "token"]
    out = [t for e in tokens for t in json.loads(e["ids"])]
    with torch.no_grad():
        want = torch.log_softmax(ref_model(torch.tensor([prompt + out])).logits[0], -1)
    lps = [lp for e in tokens for lp in json.loads(e["logprobs"])]
    assert [lp["id"] for lp in lps] == out
    for i, lp in enumerate(lps):
        row = want[len(prompt) - 1 + i]
        assert abs(lp["logprob"] - row[out[i]].item()) < 1e-9 and isinstance(lp["token"], str)
        assert [x["id"] for x in lp["top"]] == row.topk(3).indices.tolist()
    plp = json.loads(tokens[0]["prompt_logprobs"])
    assert plp[0]["id"] == prompt[0] and plp[0]["logprob"] is None and len(plp) == len(prompt)
    assert all(abs(plp[i]["logprob"] - want[i - 1, prompt[i]].item()) < 1e-9 for i in range(1, len(prompt)))
    assert all("prompt_logprobs" not in e for e in tokens[1:])
    assert "index" not in tokens[0]  # n=1 entries look as they always did


def test_n_choices_and_structured_output(r, prefix, worker_factory):
    worker_factory(prefix)
    r.xadd(f"{prefix}:requests:normal", {"id": "n3", "prompt": "Once upon", "max_tokens": "8", "n": "3", "seed": "4",
                                         "ignore_eos": "true"})
    r.xadd(f"{prefix}:requests:normal", {"id": "rx", "prompt": "code:", "max_tokens": "30",
                                         "structured_outputs": json.dumps({"regex": "[a-z]{3}-[0-9]{2}"})})
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}
    r.xadd(f"{prefix}:requests:normal", {"payload": msgpack.packb({
        "id": "js", "prompt": "json:", "max_tokens": 30, "temperature": 0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}})})
    r.xadd(f"{prefix}:requests:normal", {"id": "bad", "prompt": "x", "structured_outputs": json.dumps({"regex": "[a-"})})
    es = entries(r, f"{prefix}:result:n3")
    got = choices(es)
    assert sorted(got) == [0, 1, 2] and all(len(c) == 8 for c in got.values()) and len({tuple(c) for c in got.values()}) == 3
    ends = [e for e in es if e.get("finish_reason") and e["type"] == "token"]
    assert sorted(int(e["index"]) for e in ends) == [0, 1, 2]
    done = es[-1]
    assert done["type"] == "done" and json.loads(done["finish_reasons"]) == ["length"] * 3
    assert int(done["completion_tokens"]) == 24 and sum(e["type"] != "token" for e in es) == 1
    es = entries(r, f"{prefix}:result:rx")
    assert re.fullmatch("[a-z]{3}-[0-9]{2}", "".join(e.get("text", "") for e in es)) and es[-1]["finish_reason"] == "stop"
    es = entries(r, f"{prefix}:result:js")
    assert isinstance(json.loads("".join(e.get("text", "") for e in es))["ok"], bool)
    es = entries(r, f"{prefix}:result:bad")
    assert es[-1]["type"] == "error" and es[-1]["code"] == "invalid_request" and "structured_outputs.regex" in es[-1]["message"]


def test_choices_and_grammar_resume_on_a_peer(r, prefix, worker_factory):
    """A worker leaves mid-generation; a peer resumes each choice and the grammar from the tokens
    published: every choice equals an uninterrupted run of the same seeded request."""
    from reliability import WORKER_ENV

    a = worker_factory(prefix, name="leaving", args=["--grace-s", "0"], env=WORKER_ENV)
    req = {"prompt": "Once upon", "max_tokens": "400", "n": "2", "seed": "9", "ignore_eos": "true",
           "structured_outputs": json.dumps({"regex": "[a-z]{150}"})}
    r.xadd(f"{prefix}:requests:normal", {"id": "moved", **req})
    deadline = time.monotonic() + 60
    while r.xlen(f"{prefix}:result:moved") < 10:
        assert time.monotonic() < deadline, "first tokens"
        time.sleep(0.005)
    # Paused at once and stopped with no grace: it leaves mid-generation however fast it runs
    # (with 0.1 s of grace, a fast machine finished the request on this worker).
    a.proc.send_signal(signal.SIGSTOP)
    assert b"done" not in [f[b"type"] for _, f in r.xrange(f"{prefix}:result:moved")], "finished before it left"
    a.proc.send_signal(signal.SIGTERM)
    a.proc.send_signal(signal.SIGCONT)
    assert a.stop() == 0
    b = worker_factory(prefix, name="peer", args=["--claim-idle-s", "30"], env=WORKER_ENV)
    moved = entries(r, f"{prefix}:result:moved", timeout=120)
    assert "event=claimed" in b.log
    r.xadd(f"{prefix}:requests:normal", {"id": "fresh", **req})
    fresh = entries(r, f"{prefix}:result:fresh", timeout=120)
    assert choices(moved) == choices(fresh) and moved[-1]["type"] == fresh[-1]["type"] == "done"
    assert sum(e["type"] != "token" for e in moved) == 1
    texts = {}
    for e in fresh:
        if e["type"] == "token":
            texts[e.get("index", "0")] = texts.get(e.get("index", "0"), "") + e["text"]
    assert all(re.fullmatch("[a-z]{150}", t) for t in texts.values()) and len(texts) == 2
