"""The engine end to end on real tiny transformers models: greedy parity with transformers'
generate, continuous batching with chunked prefill, EOS, and the API other parts call."""

from __future__ import annotations

import copy
import dataclasses
import functools
import random

import pytest
import torch
from engine_helpers import FAMILIES, drive, greedy, make_engine, model_pair, random_prompts, reference
from hypothesis import given, settings
from hypothesis import strategies as st

from common.protocol import SamplingParams
from worker.engine import Engine, EngineConfig
from worker.models import UnsupportedModelError
from worker.outputs import RequestOutput


@functools.cache
def pair(family: str):
    return model_pair(family)


@functools.cache
def ref_tokens(family: str, prompt: tuple[int, ...], max_tokens: int) -> list[int]:
    return reference(pair(family)[1], list(prompt), max_tokens)


# ---------------------------------------------------------------------------- parity


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_parity_chunked_prefill_and_joining(family):
    """Mixed prompt lengths (1..300) and max_tokens, a small token budget that chunks the long
    prompts, few sequence slots and arrivals mid-run: every output equals generate alone."""
    model, ref = pair(family)
    rng = random.Random(hash(family) % 1000)
    lengths = [1, 2, 13, 40, 97, 170, 300]
    rng.shuffle(lengths)
    prompts = [random_prompts(rng, 1, (n, n))[0] for n in lengths]
    max_tokens = [rng.randint(1, 45) for _ in prompts]
    engine = make_engine(model, page_size=8, num_pages=256, max_num_seqs=3, max_num_batched_tokens=48)
    arrivals: dict[int, list[tuple]] = {}
    for i, (p, m) in enumerate(zip(prompts, max_tokens)):
        arrivals.setdefault([0, 0, 0, 3, 9, 10, 25][i], []).append((f"r{i}", p, greedy(m)))
    run = drive(engine, arrivals)
    for i, (p, m) in enumerate(zip(prompts, max_tokens)):
        rid = f"r{i}"
        assert run.tokens(rid) == ref_tokens(family, tuple(p), m), f"{rid}: prompt {len(p)}, max_tokens {m}"
        assert run.reason(rid) == "length"
    steps = [s.scheduled for s in run.steps]
    assert max(sum(n for _, _, n, _ in s) for s in steps) <= 48
    # chunked prefill: a prompt computed in several steps
    assert any(start > 0 and n > 1 for s in steps for _, start, n, _ in s)
    # prefill chunks and decodes in one packed step
    assert any(any(n == 1 for _, _, n, _ in s) and any(n > 1 for _, _, n, _ in s) for s in steps)
    # sequences join while others run, and leave while others keep running
    first = {}
    for k, rec in enumerate(run.steps):
        for rid, *_ in rec.scheduled:
            first.setdefault(rid, k)
    assert any(first[r] > 0 and any(o in run.steps[first[r]].running for o in first if o != r and first[o] < first[r]) for r in first)
    assert len({run.finish_step[r] for r in run.finish_step}) > 2
    assert engine.stats.num_steps == len([s for s in steps if s])


def test_generate_matches_reference_all_at_once():
    """generate() with a list of params, everything queued at once, page size 16."""
    model, ref = pair("llama")
    rng = random.Random(5)
    prompts = random_prompts(rng, 8, (1, 200))
    params = [greedy(rng.randint(1, 30)) for _ in prompts]
    engine = make_engine(model, num_pages=128, max_num_seqs=4, max_num_batched_tokens=64)
    out = engine.generate(prompts, params)
    assert out == [ref_tokens("llama", tuple(p), sp.max_tokens) for p, sp in zip(prompts, params)]
    # same params for all
    out = engine.generate(prompts[:3], greedy(7))
    assert out == [ref_tokens("llama", tuple(p), 7) for p in prompts[:3]]


@settings(max_examples=15, deadline=None)
@given(
    page_size=st.sampled_from([1, 3, 8, 16]),
    max_num_seqs=st.integers(1, 5),
    max_num_batched_tokens=st.integers(2, 40),
    seed=st.integers(0, 10**6),
)
def test_greedy_parity_any_batch_shape(page_size, max_num_seqs, max_num_batched_tokens, seed):
    model, _ = pair("qwen3")  # sliding-window layers exercise the window masks at every page size
    rng = random.Random(seed)
    prompts = random_prompts(rng, 4, (1, 50))
    max_tokens = [rng.randint(1, 20) for _ in prompts]
    engine = make_engine(model, page_size=page_size, num_pages=200 // page_size + 40, max_num_seqs=max_num_seqs,
                         max_num_batched_tokens=max_num_batched_tokens)
    out = engine.generate(prompts, [greedy(m) for m in max_tokens])
    assert out == [ref_tokens("qwen3", tuple(p), m) for p, m in zip(prompts, max_tokens)]


def test_float32_engine_runs_and_matches():
    model, ref = model_pair("llama", dtype=torch.float32, seed=3)
    rng = random.Random(1)
    prompts = random_prompts(rng, 3, (5, 80))
    engine = make_engine(model, num_pages=64, max_num_batched_tokens=32)
    assert engine.dtype == torch.float32 and engine.cache.k.dtype == torch.float32
    assert engine.generate(prompts, greedy(12)) == [reference(ref, p, 12) for p in prompts]


# ---------------------------------------------------------------------------- EOS


def _model_with_eos(eos):
    """A copy of the llama pair's model whose EOS token is ``eos``, and a reference copy of it."""
    model = copy.deepcopy(pair("llama")[1])
    model.generation_config.eos_token_id = eos
    return model, copy.deepcopy(model)


def test_eos_stops_a_request_like_generate():
    prompt = [7, 99, 250, 31, 4]
    free = ref_tokens("llama", tuple(prompt), 40)
    # make a token that greedy decoding produces at position >= 5 the EOS token
    k = next(i for i in range(5, 40) if free[i] not in free[:i])
    eos = free[k]
    model, ref = _model_with_eos(eos)
    expected = reference(ref, prompt, 40, eos=True)
    assert expected == free[:k + 1] and expected[-1] == eos
    engine = make_engine(model, num_pages=32)
    run = drive(engine, {0: [("a", prompt, SamplingParams(max_tokens=40, temperature=0)),
                             ("b", prompt, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)),
                             ("c", prompt, SamplingParams(max_tokens=k, temperature=0))]})
    assert run.tokens("a") == expected  # EOS included, as generate returns it
    assert run.reason("a") == "stop"
    assert run.tokens("b") == free and run.reason("b") == "length"  # ignore_eos runs on
    assert run.tokens("c") == free[:k] and run.reason("c") == "length"  # stops just before


def test_eos_from_a_list_and_from_the_tokenizer():
    small = EngineConfig(num_pages=4)
    model, _ = _model_with_eos([2, 5])
    assert Engine(model, config=small).eos_token_ids == {2, 5}
    model, _ = _model_with_eos(None)

    class Tok:  # eos_token_id is all the engine reads from a tokenizer here
        eos_token_id = 9

    assert Engine(model, Tok(), small).eos_token_ids == {9}
    assert Engine(model, config=small).eos_token_ids == set()


# ---------------------------------------------------------------------------- API (issue 3 item 5)


def test_api_names_and_fields():
    from worker.engine import Engine as E2
    from worker.engine import EngineConfig as C2

    assert E2 is Engine and C2 is EngineConfig
    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    assert {"page_size", "num_pages", "max_num_seqs", "max_num_batched_tokens", "max_model_len",
            "admission_policy", "preemption_mode", "soft_limit", "device"} <= fields
    assert EngineConfig().page_size == 16 and EngineConfig().soft_limit == 0.9
    sp = {f.name for f in dataclasses.fields(SamplingParams)}
    assert {"max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "ignore_eos"} <= sp
    ro = {f.name for f in dataclasses.fields(RequestOutput)}
    assert {"request_id", "new_token_ids", "finished", "finish_reason"} <= ro
    for bad in (dict(admission_policy="greedy"), dict(preemption_mode="drop"), dict(page_size=0), dict(soft_limit=0),
                dict(max_num_seqs=0), dict(max_num_batched_tokens=0)):
        with pytest.raises(ValueError):
            EngineConfig(**bad)


def test_add_step_abort_has_unfinished_and_stats():
    model, _ = pair("llama")
    engine = Engine(model, tokenizer=None, config=EngineConfig(num_pages=20, page_size=4, max_num_seqs=8))
    st0 = engine.stats
    assert (st0.num_steps, st0.num_preemptions, st0.num_free_pages, st0.num_total_pages) == (0, 0, 20, 20)
    assert not engine.has_unfinished() and engine.step() == []
    engine.add_request("x", [5, 6, 7, 8, 9], greedy(6))
    engine.add_request("y", [10, 11], greedy(6), priority=0)
    assert engine.has_unfinished() and "x" in engine and "z" not in engine
    outs = engine.step()
    assert {o.request_id for o in outs} == {"x", "y"}
    assert all(len(o.new_token_ids) == 1 and not o.finished and o.finish_reason is None for o in outs)
    st1 = engine.stats
    assert st1.num_steps == 1 and st1.num_running == 2 and st1.num_free_pages == 20 - 2 - 1
    assert st1.num_prompt_tokens == 7 and st1.num_generated_tokens == 2
    assert engine.abort("x") is True
    assert engine.abort("x") is False and engine.abort("nope") is False
    assert engine.stats.num_free_pages == 20 - 1  # freed at once
    outs = engine.step()
    x = [o for o in outs if o.request_id == "x"]
    assert len(x) == 1 and x[0].finished and x[0].finish_reason == "cancelled" and x[0].new_token_ids == []
    while engine.has_unfinished():
        outs = engine.step()
    assert outs[-1].request_id == "y" and outs[-1].finished and outs[-1].finish_reason == "length"
    assert outs[-1].num_output_tokens == 6 and outs[-1].metrics is not None
    m = outs[-1].metrics
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time
    assert engine.stats.num_free_pages == 20 and engine.stats.num_steps == 6


def test_bad_requests_are_refused_at_add():
    model, _ = pair("llama")
    engine = Engine(model, config=EngineConfig(num_pages=8))
    engine.add_request("a", [3], greedy(2))
    with pytest.raises(ValueError, match="already"):
        engine.add_request("a", [3], greedy(2))
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("b", [], greedy(2))
    with pytest.raises(ValueError, match="vocabulary"):
        engine.add_request("b", [3, 512], greedy(2))
    with pytest.raises(ValueError, match="vocabulary"):
        engine.add_request("b", [-1], greedy(2))
    with pytest.raises(ValueError, match="tokenizer"):
        engine.add_request("b", [3], SamplingParams(stop=["x"]))
    assert "b" not in engine
    with pytest.raises(ValueError, match="exceeds"):  # too long for the cache: generate reports the rejection
        engine.generate([[3] * 200], greedy(2))


def test_unsupported_families_are_refused():
    from transformers import AutoModelForCausalLM, GPTNeoConfig

    neo = AutoModelForCausalLM.from_config(GPTNeoConfig(num_layers=2, hidden_size=32, num_heads=2, vocab_size=64,
                                                        attention_types=[[["global"], 2]]))
    with pytest.raises(UnsupportedModelError, match="gpt_neo"):
        Engine(neo)
    # (tests/test_families.py covers every family, served or refused)


def test_cache_size_and_model_len():
    model, _ = pair("llama")
    e = Engine(model, config=EngineConfig(num_pages=10, page_size=4))
    assert e.max_model_len == 40  # capped by the cache
    e = Engine(model, config=EngineConfig(num_pages=1000, page_size=4, max_model_len=100))
    assert e.max_model_len == 100
    e = Engine(model, config=EngineConfig(num_pages=1000, page_size=4))
    assert e.max_model_len == 2048  # the model's own limit
    e = Engine(model, config=EngineConfig(kv_cache_memory=1 / 1024, page_size=16))
    per_page = 2 * 2 * 16 * 2 * 16 * 8  # K+V, layers, page, kv heads, head dim, float64
    assert e.stats.num_total_pages == 2**20 // per_page


def test_resume_with_generated_ids():
    """A request resumed from tokens another worker produced continues exactly, from seq len(generated)."""
    model, ref = pair("llama")
    prompt = [40, 41, 42, 43]
    full = ref_tokens("llama", tuple(prompt), 20)
    engine = make_engine(model, num_pages=16)
    engine.add_request("r", prompt, greedy(20), generated_ids=full[:8])
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert outs[0].seq == 8
    assert [t for o in outs for t in o.new_token_ids] == full[8:]
    assert outs[-1].num_output_tokens == 20 and outs[-1].finish_reason == "length"
