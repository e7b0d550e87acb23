"""n choices of one request: each its own random stream (the same whatever the batch, with or
without preemption), each ending on its own, and exactly one final output for the request."""

from __future__ import annotations

import functools
import random

import pytest
from engine_helpers import drive, make_engine, model_pair, random_prompts, reference

from common.protocol import SamplingParams


@functools.cache
def pair():
    return model_pair("llama", seed=2)


PROMPT = random_prompts(random.Random(4), 1, (9, 9))[0]


def test_greedy_choices_are_all_the_greedy_output():
    model, ref = pair()
    run = drive(make_engine(model, num_pages=64), {0: [("g", PROMPT, SamplingParams(n=3, max_tokens=10, temperature=0, ignore_eos=True,
                                                                                  logprobs=2, prompt_logprobs=1))]})
    want = reference(ref, PROMPT, 10)
    # every choice has its logprobs; the prompt's come once, with choice 0's first token
    assert all(len(o.logprobs) == len(o.new_token_ids) for o in run.outputs["g"] if o.new_token_ids)
    with_prompt = [o for o in run.outputs["g"] if o.prompt_logprobs]
    assert [(o.index, o.seq, len(o.prompt_logprobs)) for o in with_prompt] == [(0, 0, len(PROMPT))]
    assert [run.choice("g", i) for i in range(3)] == [want] * 3
    final = run.final("g")
    assert final.finish_reasons == ["length"] * 3 and final.finish_reason == "length" and final.num_output_tokens == 30
    ends = [o for o in run.outputs["g"] if o.choice_finish_reason]
    assert sorted(o.index for o in ends) == [0, 1, 2] and all(o.new_token_ids for o in ends)


def test_seeded_choices_are_distinct_and_the_same_whatever_the_batch():
    model, _ = pair()
    sp = SamplingParams(n=4, max_tokens=16, temperature=1.0, seed=77, ignore_eos=True)
    alone = drive(make_engine(model, num_pages=64), {0: [("c", PROMPT, sp)]})
    choices = [alone.choice("c", i) for i in range(4)]
    assert len({tuple(c) for c in choices}) == 4 and all(len(c) == 16 for c in choices)
    # choice 0 is what n=1 with that seed gives
    one = drive(make_engine(model, num_pages=64), {0: [("o", PROMPT, SamplingParams(max_tokens=16, temperature=1.0, seed=77, ignore_eos=True))]})
    assert one.tokens("o") == choices[0]
    others = random_prompts(random.Random(5), 4, (3, 30))
    busy = make_engine(model, page_size=4, num_pages=200, max_num_seqs=3, max_num_batched_tokens=16)
    run = drive(busy, {0: [("x0", others[0], SamplingParams(max_tokens=20, seed=1)), ("x1", others[1], SamplingParams(n=2, max_tokens=9))],
                       2: [("c", PROMPT, sp)], 4: [("x2", others[2], SamplingParams(max_tokens=7, temperature=0))]})
    assert [run.choice("c", i) for i in range(4)] == choices


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_choices_exact_under_preemption(mode):
    model, _ = pair()
    rng = random.Random(6)
    prompts = random_prompts(rng, 4, (3, 16))
    arrivals = {0: [(f"r{i}", p, SamplingParams(n=3, max_tokens=20, temperature=1.0, seed=i, ignore_eos=True,
                                                repetition_penalty=1.2), i % 2)
                    for i, p in enumerate(prompts)]}
    roomy = drive(make_engine(model, num_pages=200), dict(arrivals))
    engine = make_engine(model, page_size=4, num_pages=16, max_num_seqs=6, max_num_batched_tokens=16, preemption_mode=mode, swap_pages=8)
    tight = drive(engine, dict(arrivals))
    assert engine.stats.num_preemptions >= 3
    for i in range(4):
        for c in range(3):
            assert tight.choice(f"r{i}", c) == roomy.choice(f"r{i}", c)


def test_choices_end_on_their_own_and_abort_ends_all():
    model, _ = pair()
    engine = make_engine(model, num_pages=64)
    # stop on EOS made likely: the choices end at different lengths
    sp = SamplingParams(n=5, max_tokens=30, temperature=1.0, seed=3, logit_bias={2: 4.0})
    run = drive(engine, {0: [("e", PROMPT, sp), ("a", PROMPT, SamplingParams(n=3, max_tokens=50, seed=1, ignore_eos=True))]},
                aborts={4: ["a"]})
    lens = [len(run.choice("e", i)) for i in range(5)]
    final = run.final("e")
    assert len(set(lens)) > 1 and final.num_output_tokens == sum(lens)
    for i in range(5):
        assert final.finish_reasons[i] == ("stop" if run.choice("e", i)[-1] == 2 else "length")
    fa = run.final("a")
    assert fa.finish_reason == "cancelled" and fa.finish_reasons == ["cancelled"] * 3
    assert sum(o.finished for o in run.outputs["a"]) == 1


def test_choices_share_the_prompt_pages_and_a_scored_prompt_is_computed():
    """With prefix caching, choices 1.. start from choice 0's full prompt pages; a request that
    asks for prompt logprobs computes its whole prompt even when it is cached (each position
    must be scored), and gets the same logprobs as when nothing was cached."""
    model, ref = pair()
    prompt = random_prompts(random.Random(11), 1, (37, 37))[0]  # 2 full pages of 16, 5 tokens more
    eng = make_engine(model, num_pages=64, page_size=16)
    greedy = dict(max_tokens=6, temperature=0, ignore_eos=True)
    run = drive(eng, {0: [("n", prompt, SamplingParams(n=3, **greedy))]})
    assert [run.choice("n", i) for i in range(3)] == [reference(ref, prompt, 6)] * 3
    assert eng.stats.prefix_cache_hits >= 2 * 32  # choices 1 and 2 each found 2 pages
    scored = SamplingParams(prompt_logprobs=2, **greedy)
    first = drive(make_engine(model, num_pages=64, page_size=16), {0: [("a", prompt, scored)]})
    hits_before = eng.stats.prefix_cache_hits
    again = drive(eng, {0: [("b", prompt, scored)]})  # the prompt is cached in eng
    assert eng.stats.prefix_cache_hits == hits_before
    want, got = first.outputs["a"][0].prompt_logprobs, again.outputs["b"][0].prompt_logprobs
    assert len(got) == len(prompt) and [t.logprob for t in got[1:]] == pytest.approx([t.logprob for t in want[1:]], abs=1e-12)
