"""Sampling on real tiny models: temperature, top-k, top-p, seeds that do not depend on the
batch, stop token ids, stop strings, max_tokens, ignore_eos, and UTF-8-safe text deltas."""

from __future__ import annotations

import functools
import random

import pytest
import torch
from engine_helpers import drive, greedy, make_engine, model_pair, random_prompts, reference
from tiny import tiny_tokenizer

from common.protocol import SamplingParams
from worker import sampler
from worker.detokenizer import IncrementalDetokenizer
from worker.sequence import Sequence


@functools.cache
def pair():
    return model_pair("llama", seed=4)


@functools.cache
def tok():
    return tiny_tokenizer()


@functools.cache
def ref_tokens(prompt: tuple[int, ...], max_tokens: int) -> list[int]:
    return reference(pair()[1], list(prompt), max_tokens)


def ref_logits(prompt: list[int], out: list[int]) -> torch.Tensor:
    """The reference model's logits at every output position: row i scored out[i]."""
    ref = pair()[1]
    with torch.no_grad():
        logits = ref(torch.tensor([prompt + out])).logits[0]
    return logits[len(prompt) - 1:len(prompt) - 1 + len(out)].double()


PROMPTS = random_prompts(random.Random(3), 4, (2, 40))


# ---------------------------------------------------------------------------- the sampler itself


def _rows(n: int, **params) -> list[Sequence]:
    sp = SamplingParams(**params)
    return [Sequence(f"s{i}", [1, 2, 3], 3, sp, 1, i, 0.0, seed=i) for i in range(n)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_greedy_takes_the_first_of_equal_maxima(dtype):
    # as transformers' argmax does (the engine takes max(dim).indices, which is faster)
    logits = torch.full((3, 49152), -1.0, dtype=dtype)
    logits[0, [7, 9, 40000]] = 2.5
    logits[1, [48000, 3]] = 1.0
    logits[2] = 0.0
    assert sampler.sample(logits, _rows(3, temperature=0)) == [7, 3, 0] == logits.argmax(-1).tolist()


def test_distribution_follows_temperature_top_k_top_p():
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -1.0, -3.0, -9.0], dtype=torch.float64)
    n = 6000
    batch = logits.expand(n, -1)

    def freq(seqs):
        counts = torch.bincount(torch.tensor(sampler.sample(batch, seqs)), minlength=8).double()
        return counts / n

    for t in (1.0, 0.5, 2.0):
        expect = torch.softmax(logits / t, -1)
        assert (freq(_rows(n, temperature=t)) - expect).abs().max() < 0.025, t
    f = freq(_rows(n, temperature=1.0, top_k=3))
    expect = torch.softmax(logits[:3], -1)
    assert f[3:].sum() == 0 and (f[:3] - expect).abs().max() < 0.025
    # top_p 0.6: the smallest head of tokens holding 0.6 of the mass (here tokens 0 and 1)
    p = torch.softmax(logits, -1)
    keep = int((torch.cumsum(p, 0) - p < 0.6).sum())
    assert keep == 2 and p[:2].sum() >= 0.6 > p[0]
    f = freq(_rows(n, temperature=1.0, top_p=0.6))
    assert f[keep:].sum() == 0 and (f[:keep] - p[:keep] / p[:keep].sum()).abs().max() < 0.025
    # both at once: the tighter one wins
    f = freq(_rows(n, temperature=1.0, top_k=2, top_p=0.9))
    assert f[2:].sum() == 0 and f[1] > 0.2
    # greedy rows stay greedy in a mixed batch
    mixed = _rows(4, temperature=1.0) + _rows(4, temperature=0)
    assert sampler.sample(logits.expand(8, -1), mixed)[4:] == [0] * 4


def test_uniforms_are_a_function_of_seed_and_step():
    seeds = torch.tensor([1, 1, 2, 2**62 + 5, 3], dtype=torch.int64)
    steps = torch.tensor([0, 1, 0, 0, 7], dtype=torch.int64)
    u = sampler.uniform(seeds, steps)
    assert u.shape == (5,) and u.dtype == torch.float64 and (u > 0).all() and (u < 1).all()
    assert torch.equal(u, sampler.uniform(seeds.flip(0), steps.flip(0)).flip(0))  # row order does not matter
    assert len(set(u.tolist())) == 5
    many = sampler.uniform(torch.arange(20000, dtype=torch.int64), torch.zeros(20000, dtype=torch.int64))
    assert abs(many.mean().item() - 0.5) < 0.01 and abs((many < 0.1).double().mean().item() - 0.1) < 0.01


def test_draw_inverts_the_distribution_and_never_takes_an_impossible_token():
    x = torch.tensor([[0.0, float("-inf"), 1.0, float("-inf")]] * 3)
    p = torch.softmax(x[0].double(), -1)
    u = torch.tensor([1e-12, float(p[0]) - 1e-9, 1 - 1e-12], dtype=torch.float64)
    assert sampler.draw(x, u).tolist() == [0, 0, 2]
    assert sampler.draw(x, torch.tensor([float(p[0]) + 1e-9] * 3, dtype=torch.float64)).tolist() == [2, 2, 2]


# ---------------------------------------------------------------------------- on the model


def test_top_k_1_and_tiny_top_p_are_greedy():
    model, _ = pair()
    engine = make_engine(model, num_pages=64, max_num_batched_tokens=32)
    n = 20
    expected = [ref_tokens(tuple(p), n) for p in PROMPTS]
    for kw in (dict(top_k=1), dict(top_p=1e-9), dict(top_k=1, temperature=3.0), dict(top_p=1e-9, top_k=50)):
        kw.setdefault("temperature", 1.0)
        params = [SamplingParams(max_tokens=n, ignore_eos=True, seed=i, **kw) for i in range(len(PROMPTS))]
        assert engine.generate(PROMPTS, params) == expected, kw


@pytest.mark.parametrize("kw", [dict(top_k=3, temperature=1.5), dict(top_p=0.3, temperature=1.0), dict(top_k=5, top_p=0.5, temperature=0.8)])
def test_samples_stay_in_the_top_k_and_nucleus(kw):
    model, _ = pair()
    engine = make_engine(model, num_pages=64, max_num_seqs=3)
    outs = engine.generate(PROMPTS, [SamplingParams(max_tokens=25, ignore_eos=True, seed=100 + i, **kw) for i in range(len(PROMPTS))])
    not_greedy = 0
    for p, out in zip(PROMPTS, outs):
        assert len(out) == 25
        logits = ref_logits(p, out) / kw["temperature"]
        probs = torch.softmax(logits, -1)
        for i, t in enumerate(out):
            rank = int((logits[i] > logits[i, t]).sum())
            if "top_k" in kw:
                assert rank < kw["top_k"], f"token of rank {rank} sampled with top_k {kw['top_k']}"
            if "top_p" in kw:
                before = probs[i][logits[i] > logits[i, t]].sum().item()
                assert before < kw["top_p"] + 1e-5, f"mass {before} before the token, top_p {kw['top_p']}"
            not_greedy += rank > 0
    assert not_greedy > 5  # it really samples


def test_same_seed_same_tokens_whatever_the_batch():
    model, _ = pair()
    sp = SamplingParams(max_tokens=30, temperature=1.0, top_p=0.95, seed=1234, ignore_eos=True)
    target = PROMPTS[1]
    alone = make_engine(model, num_pages=64).generate([target], sp)[0]
    rng = random.Random(9)
    others = random_prompts(rng, 5, (1, 90))
    # batched with others arriving at different times, chunked prefill, few slots, page size 4
    engine = make_engine(model, page_size=4, num_pages=200, max_num_seqs=3, max_num_batched_tokens=20)
    arrivals = {0: [("o0", others[0], SamplingParams(max_tokens=12, seed=1)), ("o1", others[1], greedy(40))],
                2: [("t", target, sp)], 3: [("o2", others[2], SamplingParams(max_tokens=30, seed=1234))],
                7: [("o3", others[3], SamplingParams(max_tokens=5)), ("o4", others[4], SamplingParams(max_tokens=9, temperature=0.5))]}
    run = drive(engine, arrivals)
    assert run.tokens("t") == alone
    assert engine.generate([target, target], [sp, sp]) == [alone, alone]
    other_seed = make_engine(model, num_pages=64).generate([target], SamplingParams(max_tokens=30, temperature=1.0, top_p=0.95, seed=1235, ignore_eos=True))[0]
    assert other_seed != alone
    # no seed: a fresh random one each time
    unseeded = make_engine(model, num_pages=64).generate([target] * 2, SamplingParams(max_tokens=30, temperature=1.0, ignore_eos=True))
    assert unseeded[0] != unseeded[1]


def test_stop_token_ids_and_max_tokens():
    model, _ = pair()
    p = PROMPTS[0]
    free = ref_tokens(tuple(p), 40)
    k = next(i for i in range(3, 40) if free[i] not in free[:i])
    engine = make_engine(model, num_pages=64)
    run = drive(engine, {0: [
        ("stop", p, greedy(40, stop_token_ids=[free[k], 511 if free[k] != 511 else 510])),
        ("len", p, greedy(k)),
        ("sampled", p, SamplingParams(max_tokens=17, seed=5, ignore_eos=True)),
    ]})
    assert run.tokens("stop") == free[:k + 1] and run.reason("stop") == "stop"
    assert run.tokens("len") == free[:k] and run.reason("len") == "length"
    assert len(run.tokens("sampled")) == 17 and run.reason("sampled") == "length"


def test_ignore_eos_with_sampling():
    model, _ = pair()
    ign = [SamplingParams(max_tokens=40, seed=s, temperature=2.0, ignore_eos=True) for s in range(6)]
    sp = [SamplingParams(max_tokens=40, seed=s, temperature=2.0) for s in range(6)]
    b = make_engine(model, num_pages=64).generate([PROMPTS[2]] * 6, ign)
    assert all(len(y) == 40 for y in b)
    eos = b[0][10]  # a token that does get sampled: make it the EOS
    saved = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = eos
    try:
        engine = make_engine(model, num_pages=64)
    finally:
        model.generation_config.eos_token_id = saved
    assert engine.eos_token_ids == {eos}
    assert engine.generate([PROMPTS[2]] * 6, ign) == b
    a = engine.generate([PROMPTS[2]] * 6, sp)
    for x, y in zip(a, b):  # same seed: identical up to the first EOS, where it stops
        assert x == (y[:y.index(eos) + 1] if eos in y else y)
    assert len(a[0]) <= 11


# ---------------------------------------------------------------------------- text


def _text_prompt(s: str) -> list[int]:
    return tok().encode(s)


def test_stop_strings_cut_the_text():
    model, _ = pair()
    t = tok()
    prompt = _text_prompt("Once upon a time there was a little queue.")
    engine = make_engine(model, t, num_pages=64)
    free_run = drive(engine, {0: [("free", prompt, greedy(40))]})
    full = free_run.text("free")
    ids = free_run.tokens("free")
    assert full == t.decode(ids, skip_special_tokens=True)
    # a stop string from the middle of the text, at its first occurrence, made of whole characters
    i = next(i for i in range(len(full) // 3, len(full) - 3) if "\ufffd" not in full[i:i + 3] and full.find(full[i:i + 3]) == i)
    stop = full[i:i + 3]
    never = "\u2603\u2603"  # a second stop string that never matches
    run = drive(engine, {0: [("s", prompt, greedy(40, stop=[never, stop]))]})
    assert run.text("s") == full[:i]
    assert run.reason("s") == "stop"
    got = run.tokens("s")
    assert got == ids[:len(got)] and len(got) < len(ids)
    assert stop in t.decode(got) and stop not in t.decode(got[:-1])  # stopped at the token completing it
    # every delta is final: streamed text is never taken back
    assert "".join(o.text for o in run.outputs["s"]) == full[:i]
    # the earliest of two stop strings wins
    j = next(j for j in range(2, i) if "\ufffd" not in full[j:j + 2] and full.find(full[j:j + 2]) == j)
    run = drive(engine, {0: [("e", prompt, greedy(40, stop=[stop, full[j:j + 2]]))]})
    assert run.text("e") == full[:j]


def test_text_deltas_never_split_a_character():
    """Random tokens of a byte-level tokenizer often end mid-character: no delta may carry half a
    character, and all deltas together are the decode of all output ids."""
    model, _ = pair()
    t = tok()
    engine = make_engine(model, t, num_pages=128, max_num_seqs=8)
    prompt = _text_prompt("caf\u00e9 \u4f60\u597d \U0001f600 ")
    arrivals = {0: [(f"r{s}", prompt, SamplingParams(max_tokens=24, seed=s, temperature=1.5, ignore_eos=True)) for s in range(16)]}
    run = drive(engine, arrivals)
    checked = 0
    for rid, outs in run.outputs.items():
        final = t.decode(run.tokens(rid), skip_special_tokens=True)
        so_far = ""
        for o in outs:
            so_far += o.text
            # always a prefix of the final text: a split character would show as U+FFFD here
            assert final.startswith(so_far), (rid, so_far, final)
        assert so_far == final
        checked += "\ufffd" in final or any(ord(c) > 127 for c in final)
    assert checked > 0


def _byte_tokens(text: str) -> list[int]:
    """One token per UTF-8 byte (the byte-level alphabet), so multi-byte characters span tokens."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\u00a1"), ord("\u00ac") + 1)) + list(range(ord("\u00ae"), ord("\u00ff") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    byte_char = {b: chr(c) for b, c in zip(bs, cs)}
    ids = tok().convert_tokens_to_ids([byte_char[b] for b in text.encode()])
    assert None not in ids and tok().unk_token_id not in ids
    return ids


def test_detokenizer_holds_partial_characters_and_stop_prefixes():
    t = tok()
    text = "caf\u00e9 \u4f60\u597d \U0001f600!"
    ids = _byte_tokens(text)
    d = IncrementalDetokenizer(t, _text_prompt("hi "), [])
    out = []
    for i in ids:
        d.add([i])
        out.append(d.delta(final=False))
        assert "\ufffd" not in out[-1]
    out.append(d.delta(final=True))
    assert "".join(out) == text
    assert sum(1 for x in out if x) < len(ids)  # some tokens had to wait for the rest of their character

    # stop string spanning tokens: text that may become the stop string is held back, then cut
    d = IncrementalDetokenizer(t, [], ["o w", "\U0001f600"])
    seen = ""
    for i in _byte_tokens("hello world"):
        d.add([i])
        seen += d.delta(final=False)
        if d.stopped:
            break
    seen += d.delta(final=True)
    assert d.stopped and seen == "hell" and d.text == "hell"
    # ending on an incomplete character: the final delta gives it out as decode would
    d = IncrementalDetokenizer(t, [], [])
    part = _byte_tokens("a\u4f60")[:-1]
    d.add(part[:1])
    d.add(part[1:])
    assert d.delta(final=False) == "a"
    assert d.delta(final=True) == t.decode(part)[1:] and "\ufffd" in t.decode(part)


def test_detokenizer_calls_the_rust_backend_only_where_it_decodes_the_same():
    """The detokenizer skips transformers' decode wrapper (worker/detokenizer.py: _decoder) where
    the backend's decode is the same text: checked here on random id runs over the whole
    vocabulary, special tokens among them; a tokenizer that cleans up spaces keeps the wrapper."""
    from worker.detokenizer import _decoder

    t = tok()
    fast = _decoder(t)
    assert fast.__name__ == "direct" and _decoder(t) is fast  # probed once per tokenizer
    rng = random.Random(0)
    specials = sorted(t.all_special_ids)
    for _ in range(2000):
        ids = [rng.choice(specials) if rng.random() < 0.1 else rng.randrange(len(t)) for _ in range(rng.randint(1, 12))]
        assert fast(ids) == t.decode(ids, skip_special_tokens=True)

    cleaned = tiny_tokenizer()
    cleaned.clean_up_tokenization_spaces = True
    assert _decoder(cleaned).__name__ == "wrapped"
