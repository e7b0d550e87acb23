"""Logprobs, prompt logprobs, penalties, min_tokens and logit_bias on real tiny models, against
transformers (float64): its generate's logits, and its own logits processors. Exact with and
without forced preemption, greedy and seeded."""

from __future__ import annotations

import copy
import functools
import random

import pytest
import torch
from engine_helpers import FAMILIES, drive, make_engine, model_pair, random_prompts
from tiny import FAMILY_CONFIGS, family_model
from transformers import (
    LogitsProcessor,
    MinNewTokensLengthLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
)

from common.protocol import SamplingParams
from worker import sampler

EOS = 2
MODES = ["recompute", "swap"]


@functools.cache
def pair(family: str = "llama"):
    return model_pair(family, seed=7)


class OpenAIPenalties(LogitsProcessor):
    """OpenAI's presence/frequency penalties over the output tokens (transformers has none)."""

    def __init__(self, prompt_len: int, presence: float, frequency: float):
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids, scores):
        out = input_ids[:, self.prompt_len:]
        counts = torch.zeros_like(scores).scatter_add_(1, out, torch.ones_like(out, dtype=scores.dtype))
        return scores - self.frequency * counts - self.presence * (counts > 0)


def processors(prompt_len: int, p: SamplingParams) -> list:
    procs = []
    if p.logit_bias:
        procs.append(SequenceBiasLogitsProcessor(sequence_bias=[[[t], b] for t, b in p.logit_bias.items()]))
    if p.repetition_penalty != 1.0:
        procs.append(RepetitionPenaltyLogitsProcessor(p.repetition_penalty))
    if p.min_tokens:
        procs.append(MinNewTokensLengthLogitsProcessor(prompt_len, p.min_tokens, EOS))
    if p.presence_penalty or p.frequency_penalty:
        procs.append(OpenAIPenalties(prompt_len, p.presence_penalty, p.frequency_penalty))
    return procs


def reference(family: str, prompt: list[int], p: SamplingParams, seed: int = 0) -> list[int]:
    """Token by token on the reference model with transformers' processors; greedy, or the
    engine's sampling rule (the inverse CDF at its counter-based uniform) replayed."""
    ref = pair(family)[1]
    ids = torch.tensor([prompt])
    out: list[int] = []
    with torch.no_grad():
        for step in range(p.max_tokens):
            scores = ref(ids).logits[:, -1].double()
            for proc in processors(len(prompt), p):
                scores = proc(ids, scores)
            if p.temperature == 0:
                tok = int(scores.argmax())
            else:
                x = scores.float() / p.temperature
                tok = int(sampler.draw(x, sampler.uniform(torch.tensor([seed]), torch.tensor([step])))[0])
            out.append(tok)
            ids = torch.cat([ids, torch.tensor([[tok]])], 1)
            if tok == EOS and not p.ignore_eos:
                break
    return out


# ---------------------------------------------------------------------------- logprobs


@pytest.mark.parametrize("family", FAMILIES)
def test_logprobs_equal_log_softmax_of_generate(family):
    model, ref = pair(family)
    prompts = random_prompts(random.Random(1), 3, (5, 40))
    p = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=5, prompt_logprobs=3)
    # chunks of 16 tokens: prompt logprobs come from several steps
    engine = make_engine(model, num_pages=64, max_num_batched_tokens=16)
    run = drive(engine, {0: [(f"r{i}", pr, p) for i, pr in enumerate(prompts)]})
    for i, prompt in enumerate(prompts):
        ids = torch.tensor([prompt])
        g = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False, eos_token_id=None,
                         pad_token_id=0, output_logits=True, return_dict_in_generate=True)
        tokens = g.sequences[0, len(prompt):].tolist()
        assert run.tokens(f"r{i}") == tokens
        lps = [lp for o in run.outputs[f"r{i}"] for lp in (o.logprobs or [])]
        assert len(lps) == 12
        # generate's output_logits are float32 (transformers 5 casts them): 1e-5 there, and 1e-9
        # against the float64 logits of the same model over the generated sequence
        with torch.no_grad():
            full = torch.log_softmax(ref(g.sequences).logits[0].double(), -1)
        for j, (lp, tok, logits) in enumerate(zip(lps, tokens, g.logits)):
            assert abs(lp.logprob - torch.log_softmax(logits[0].double(), -1)[tok].item()) < 1e-5
            want = full[len(prompt) - 1 + j]
            assert lp.id == tok and abs(lp.logprob - want[tok].item()) < 1e-9
            vals, idx = want.topk(5)
            assert [t for t, _ in lp.top] == idx.tolist()
            assert max(abs(a - b) for (_, a), b in zip(lp.top, vals.tolist())) < 1e-9
        want = full
        plp = run.outputs[f"r{i}"][0].prompt_logprobs
        assert plp[0].id == prompt[0] and plp[0].logprob is None and len(plp) == len(prompt)
        for pos in range(1, len(prompt)):
            e = plp[pos]
            assert e.id == prompt[pos] and abs(e.logprob - want[pos - 1, prompt[pos]].item()) < 1e-9
            assert [t for t, _ in e.top] == want[pos - 1].topk(3).indices.tolist()
        assert all(o.prompt_logprobs is None for o in run.outputs[f"r{i}"][1:])


FAST_FAMILIES = ("gemma2", "gpt2", "mixtral", "gpt_oss")  # soft-capping, learned positions, MoE, sinks
# transformers' own attention for these runs its softmax in float32 even in a float64 model (eager paths
# they force): the reference is only that exact; the engine's attention stays in float64
FLOAT32_SOFTMAX = {"gemma2": 1e-6, "granite_swa": 1e-6, "granitemoe_swa": 1e-6}


@pytest.mark.parametrize("model_type", [pytest.param(m, marks=() if m in FAST_FAMILIES else pytest.mark.slow)
                                        for m in FAMILY_CONFIGS])
def test_logprobs_on_every_family(model_type):
    """Generated and prompt logprobs within 1e-9 of log-softmax of the model's own float64 logits."""
    model = family_model(model_type, seed=1)
    ref = copy.deepcopy(model)
    prompt = random_prompts(random.Random(3), 1, (20, 20))[0]
    p = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    run = drive(make_engine(model, num_pages=64, max_num_batched_tokens=8), {0: [("r", prompt, p)]})
    out = run.tokens("r")
    with torch.no_grad():
        want = torch.log_softmax(ref(torch.tensor([prompt + out])).logits[0].double(), -1)
    lps = [lp for o in run.outputs["r"] for lp in o.logprobs]
    assert [lp.id for lp in lps] == out
    tol = FLOAT32_SOFTMAX.get(model_type, 1e-9)
    for i, lp in enumerate(lps):
        row = want[len(prompt) - 1 + i]
        assert abs(lp.logprob - row[out[i]].item()) < tol and [t for t, _ in lp.top] == row.topk(3).indices.tolist()
    plp = run.outputs["r"][0].prompt_logprobs
    assert max(abs(plp[j].logprob - want[j - 1, prompt[j]].item()) for j in range(1, len(prompt))) < tol


def test_logprobs_are_of_the_raw_distribution_and_zero_means_the_chosen_only():
    """Sampled with temperature, penalties and bias: still log-softmax of the raw logits."""
    model, ref = pair()
    prompt = random_prompts(random.Random(2), 1, (10, 10))[0]
    p = SamplingParams(max_tokens=10, temperature=1.3, seed=3, ignore_eos=True, logprobs=0, repetition_penalty=1.5,
                       logit_bias={7: 5.0})
    run = drive(make_engine(model, num_pages=64), {0: [("r", prompt, p)]})
    out = run.tokens("r")
    with torch.no_grad():
        want = torch.log_softmax(ref(torch.tensor([prompt + out])).logits[0].double(), -1)
    for i, lp in enumerate(lp for o in run.outputs["r"] for lp in o.logprobs):
        assert lp.top == [] and abs(lp.logprob - want[len(prompt) - 1 + i, out[i]].item()) < 1e-9


# ---------------------------------------------------------------------------- penalties


PENALTIES = [
    dict(repetition_penalty=1.8),
    dict(repetition_penalty=0.7),
    dict(presence_penalty=1.5, frequency_penalty=0.7),
    dict(frequency_penalty=-0.8),
    dict(logit_bias={5: 3.0, 9: -100.0, 300: 2.5}),
    dict(repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.3, logit_bias={11: 4.0}),
]


def _workload(temperature: float):
    rng = random.Random(5)
    prompts = random_prompts(rng, len(PENALTIES), (3, 20))
    reqs = {}
    for i, (kw, prompt) in enumerate(zip(PENALTIES, prompts)):
        reqs[f"p{i}"] = (prompt, SamplingParams(max_tokens=30, temperature=temperature, seed=100 + i, ignore_eos=True, **kw))
    return reqs


@pytest.mark.parametrize("temperature", [0, 1.0])
def test_penalties_equal_transformers_processors(temperature):
    model, _ = pair()
    reqs = _workload(temperature)
    run = drive(make_engine(model, num_pages=64), {0: [(rid, pr, p) for rid, (pr, p) in reqs.items()]})
    plain = drive(make_engine(model, num_pages=64), {0: [(rid, pr, SamplingParams(max_tokens=30, temperature=temperature, seed=p.seed, ignore_eos=True))
                                                         for rid, (pr, p) in reqs.items()]})
    for rid, (prompt, p) in reqs.items():
        assert run.tokens(rid) == reference("llama", prompt, p, p.seed), (rid, p)
    # the penalties did change something (a sampled run often repeats no token at all)
    changed = sum(run.tokens(rid) != plain.tokens(rid) for rid in reqs)
    assert changed == len(reqs) if temperature == 0 else changed >= len(reqs) // 2


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("temperature", [0, 1.0])
def test_penalties_exact_under_preemption(mode, temperature):
    """A cache of 14 pages of 4 tokens: sequences are evicted and recomputed (or swapped) many
    times; penalties count the same prompt and output tokens, prompt logprobs come out once."""
    model, _ = pair()
    reqs = _workload(temperature)
    for rid in list(reqs)[:3]:
        reqs[rid][1].prompt_logprobs = 2
    arrivals = {0: [(rid, pr, p, i % 3) for i, (rid, (pr, p)) in enumerate(reqs.items()) if i % 2 == 0],
                3: [(rid, pr, p, i % 3) for i, (rid, (pr, p)) in enumerate(reqs.items()) if i % 2]}
    roomy = drive(make_engine(model, num_pages=200), dict(arrivals))
    engine = make_engine(model, page_size=4, num_pages=14, max_num_seqs=6, max_num_batched_tokens=12, preemption_mode=mode,
                         swap_pages=6)
    tight = drive(engine, dict(arrivals))
    assert engine.stats.num_preemptions >= 3, engine.stats.num_preemptions
    for rid, (prompt, p) in reqs.items():
        assert tight.tokens(rid) == roomy.tokens(rid) == reference("llama", prompt, p, p.seed), rid
        a, b = tight.outputs[rid][0].prompt_logprobs, roomy.outputs[rid][0].prompt_logprobs
        assert (a is None) == (p.prompt_logprobs is None)
        if a is not None:  # (the last bits differ with the batch's shape)
            assert len(a) == len(prompt) and a[0] == b[0] and a[0].logprob is None and all(
                x.id == y.id and abs(x.logprob - y.logprob) < 1e-9 and [t for t, _ in x.top] == [t for t, _ in y.top]
                for x, y in zip(a[1:], b[1:]))


def test_min_tokens_masks_eos_and_stop_tokens():
    model, _ = pair()
    prompt = random_prompts(random.Random(8), 1, (6, 6))[0]
    # a strong bias makes EOS (and token 40) the favourite: only min_tokens keeps them away
    for seed, temperature in ((0, 0), (4, 1.0)):
        p = SamplingParams(max_tokens=20, temperature=temperature, seed=seed, min_tokens=6, logit_bias={EOS: 40.0})
        run = drive(make_engine(model, num_pages=64), {0: [("r", prompt, p)]})
        assert run.tokens("r") == reference("llama", prompt, p, seed)
        assert len(run.tokens("r")) == 7 and run.tokens("r")[-1] == EOS and run.reason("r") == "stop"
    p = SamplingParams(max_tokens=20, temperature=0, min_tokens=4, stop_token_ids=[40], logit_bias={40: 40.0}, ignore_eos=True)
    run = drive(make_engine(model, num_pages=64), {0: [("s", prompt, p)]})
    out = run.tokens("s")
    assert len(out) == 5 and out[-1] == 40 and 40 not in out[:4] and run.reason("s") == "stop"


def test_logit_bias_outside_the_vocabulary_is_refused():
    model, _ = pair()
    engine = make_engine(model, num_pages=16)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.add_request("b", [5, 6], SamplingParams(logit_bias={100_000: 1.0}))
    assert not engine.has_unfinished()
