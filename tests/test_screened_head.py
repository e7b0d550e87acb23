"""The float32 LM head's greedy picks screened in bf16 (worker/screened_head.py,
worker/csrc/greedy.cpp's ``screened_argmax``).

The kernel: every bf16 approximation lies within the bound the kernel screens with; its picks
are the float32 head's, at ties too fine for bf16 to see; a row that is not finite answers as
``argmax_rows`` does. The engine: a step whose sampled rows are all plain greedy picks through
it, any other step makes logits; over 200 requests per family it gives the float32 head's tokens
(a request that differs must differ at a near tie, and such requests stay under 0.5%).
"""

from __future__ import annotations

import random

import pytest
import torch
from engine_helpers import FAMILIES, make_engine, random_prompts
from tiny import tiny_model

from common.protocol import SamplingParams
from worker import native, sampler, screened_head
from worker.sequence import Sequence

pytestmark = pytest.mark.skipif(native.load() is None, reason=f"the native kernels cannot be built here: {native.error()}")

N_REQUESTS = 200
NEAR_TIE = 1e-3  # float32: as tests/test_fastpath.py
MAX_TIE_RATE = 0.005
ENGINE = dict(page_size=8, num_pages=2048, max_num_seqs=48, max_num_batched_tokens=256)


def _head(w: torch.Tensor) -> screened_head.ScreenedHead:
    return screened_head.ScreenedHead(w)


def _bound(approx: torch.Tensor, h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The kernel's eps_j for every entry (worker/csrc/greedy.cpp), in float64."""
    d = h.shape[1]
    c1 = 1.01 / 256 + d / 2**23
    return c1 * h.double().norm(dim=1, keepdim=True) * w.double().norm(dim=1)[None] + approx.double().abs() / 256 + 1e-30


def test_each_approximation_is_within_its_bound():
    """The screen's premise: |approx - h . w| <= eps for every entry, on rows and weights whose
    scales spread over twelve orders of magnitude, an outlier dimension, and sizes that fill no
    whole vector."""
    gen = torch.Generator().manual_seed(0)
    worst = 0.0
    for S, V, d in ((7, 1003, 100), (64, 4096, 576), (3, 512, 2048)):
        w = torch.randn(V, d, generator=gen) * torch.logspace(-3, 3, V)[torch.randperm(V, generator=gen)][:, None]
        h = torch.randn(S, d, generator=gen) * torch.logspace(-3, 3, S)[:, None]
        h[:, 5] *= 100  # an outlier dimension, as trained models' hidden states have
        head = _head(w)
        approx = torch.ops.tokenq_native.gemm_packed(h.to(torch.bfloat16), head.handle).double()
        err = (approx - h.double() @ w.double().T).abs()
        ratio = float((err / _bound(approx, h, w)).max())
        worst = max(worst, ratio)
        assert ratio <= 1.0, (S, V, d, ratio)
    assert worst > 0.05  # the bound is not vacuous: some entries come within a factor of 20 of it


@pytest.mark.parametrize("S,V,d", [(1, 32000, 64), (64, 4096, 576), (9, 1003, 100)])
def test_picks_are_the_float32_heads(S, V, d):
    """On random rows the picks are the exact (float64) argmax, but where the two best products
    lie within float32's rounding of each other."""
    gen = torch.Generator().manual_seed(S)
    w = torch.randn(V, d, generator=gen) * 0.05
    h = torch.randn(S, d, generator=gen)
    got = _head(w).picks(h)
    exact = h.double() @ w.double().T
    top = exact.topk(2, dim=1)
    differ = got != top.indices[:, 0]
    assert bool(((top.values[:, 0] - top.values[:, 1])[differ] < 1e-4).all())
    assert got.dtype == torch.long and got.shape == (S,)


def test_ties_finer_than_bf16_are_settled_in_float32():
    """Each row gets a rival of its best token, 1e-3 above or below it, or equal: far finer than
    the bf16 products resolve (their bound here is about 0.1), far coarser than float32 rounding.
    The picks are the exact argmax in every row, the first of equal maxima at a tie; picking
    from the approximations alone gets about half of them wrong."""
    gen = torch.Generator().manual_seed(1)
    V, d, S = 4096, 576, 48
    w = torch.randn(V, d, generator=gen) * 0.05
    h = torch.randn(S, d, generator=gen)
    for r in range(S):
        top = int((h[r] @ w.T).argmax())
        rival = (top + 1 + 37 * r) % V
        step = (1e-3, -1e-3, 0.0)[r % 3]
        w[rival] = w[top] + step * h[r] / h[r].norm() ** 2
    exact = h.double() @ w.double().T
    want = exact.argmax(dim=1)  # float64's first of equal maxima
    got = _head(w).picks(h)
    assert torch.equal(got, want)


def test_a_row_that_is_not_finite_answers_as_argmax_rows():
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(300, 40, generator=gen)
    h = torch.randn(4, 40, generator=gen)
    h[1, 3] = float("nan")
    h[2, 7] = float("inf")
    got = _head(w).picks(h)
    assert torch.equal(got, native.argmax_rows(h @ w.T))


# ---------------------------------------------------------------------------- in the engine


def test_plain_greedy_is_a_step_that_only_takes_each_rows_largest_logit():
    def seq(out=0, grammar=None, **params):
        s = Sequence("r", [5, 6, 7] + [8] * out, 3, SamplingParams(**({"temperature": 0} | params)), 1, 0, 0.0, 0)
        s.grammar = grammar
        return s

    assert sampler.plain_greedy([seq(), seq(n=2), seq(min_tokens=2, out=2), seq(prompt_logprobs=1)])
    for other in (seq(temperature=0.5), seq(logprobs=0), seq(repetition_penalty=1.1), seq(presence_penalty=0.5),
                  seq(frequency_penalty=0.5), seq(logit_bias={3: 1.0}), seq(min_tokens=2, out=1), seq(grammar=object())):
        assert not sampler.plain_greedy([seq(), other])


@pytest.fixture(scope="module")
def screened_models():
    """One float32 tiny model per family, where the engine screens its head here."""
    model = tiny_model("llama", dtype=torch.float32, seed=11)
    reason = screened_head.why_not(model.get_output_embeddings(), torch.device("cpu"))
    if reason is not None:
        pytest.skip(f"the head is not screened here: {reason}")
    return {fam: model if fam == "llama" else tiny_model(fam, dtype=torch.float32, seed=11) for fam in FAMILIES}


def _kinds(engine) -> list[tuple[str, list]]:
    """Each step's (what the runner returned: picks or logits, its sampled rows' params)."""
    seen = []
    execute = engine.runner.execute

    def observed(out):
        got, sampled, prompt = execute(out)
        seen.append(("picks" if got.dim() == 1 else "logits", [s.seq.params for s in sampled]))
        return got, sampled, prompt

    engine.runner.execute = observed
    return seen


def test_plain_greedy_steps_pick_through_the_screened_head(screened_models):
    model = screened_models["llama"]
    engine = make_engine(model, **ENGINE)
    assert engine.runner.compiled.screened is not None
    seen = _kinds(engine)
    rng = random.Random(3)
    prompts = random_prompts(rng, 24, lengths=(1, 40))
    others = [dict(logprobs=0), dict(temperature=0.7, seed=1), dict(repetition_penalty=1.3), dict(logit_bias={5: 2.0})]
    params = [SamplingParams(max_tokens=rng.randint(2, 9), temperature=0, ignore_eos=True) for _ in prompts[:20]]
    params += [SamplingParams(max_tokens=rng.randint(2, 9), **({"temperature": 0} | o)) for o in others]
    engine.generate(prompts, params)
    plain = [all(p.greedy and p.logprobs is None and not p.logit_bias and p.repetition_penalty == 1.0 for p in ps)
             for _, ps in seen if ps]
    kinds = [k for k, ps in seen if ps]
    assert "picks" in kinds and "logits" in kinds
    for k, ok in zip(kinds, plain):
        assert (k == "picks") == ok
    # a step whose prompt rows want logprobs makes logits too
    engine2 = make_engine(model, **ENGINE)
    seen2 = _kinds(engine2)
    engine2.generate([prompts[0]], [SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1)])
    assert [k for k, _ in seen2] == ["logits"]


@pytest.mark.parametrize("family", FAMILIES)
def test_screened_greedy_agrees_with_the_float32_head(screened_models, family):
    """200 requests on one engine, screened and then through the float32 head's logits."""
    model = screened_models[family]
    rng = random.Random(FAMILIES.index(family))
    prompts = random_prompts(rng, N_REQUESTS, lengths=(1, 48))
    params = [SamplingParams(max_tokens=rng.randint(4, 12), temperature=0, ignore_eos=True) for _ in prompts]
    engine = make_engine(model, **ENGINE)
    fwd = engine.runner.compiled
    screened = fwd.screened
    assert screened is not None
    calls = 0

    def counted(h):
        nonlocal calls
        calls += 1
        return picks(h)

    picks, screened.picks = screened.picks, counted
    try:
        got = engine.generate(prompts, params)
        fwd.screened = None  # (the compiled forward is shared by the model's engines: restored below)
        want = engine.generate(prompts, params)
    finally:
        fwd.screened = screened
        del screened.picks
    assert calls > 0
    ties, far = [], []
    for p, a, b in zip(prompts, got, want):
        if a == b:
            continue
        i = next(k for k, (x, y) in enumerate(zip(a, b)) if x != y)
        with torch.inference_mode():
            top = model(torch.tensor([p + b[:i]])).logits[0, -1].double().topk(2).values
        gap = float(top[0] - top[1])
        (ties if gap < NEAR_TIE else far).append(gap)
    assert not far, f"{family}: {len(far)} requests differ away from a near tie (top-2 gaps {far})"
    assert len(ties) / N_REQUESTS <= MAX_TIE_RATE, f"{family}: near-tie rate {len(ties) / N_REQUESTS:.2%}"
