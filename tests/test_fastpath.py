"""The fast path (worker/fastpath.py, worker/compiled.py, worker/native.py) against the exact
eager path it replaces.

Greedy agreement is measured over 200 requests per family on the same engine settings: a
request whose tokens differ must differ at a near tie of the eager model (its two best
logits within NEAR_TIE), and such requests stay under MAX_TIE_RATE. Logits of every step
agree within 1e-4 (float32). float64 and ``fast_path=False`` run the caller's model as it is.
"""

from __future__ import annotations

import copy
import logging
import random

import pytest
import torch
import torch.nn.functional as F
from engine_helpers import FAMILIES, make_engine, random_prompts
from tiny import tiny_model

from common.protocol import SamplingParams
from worker import fastpath
from worker.models import resolve_dtype

N_REQUESTS = 200
NEAR_TIE = 1e-3  # float32: a gap between the two best logits this small can flip with GEMM order
MAX_TIE_RATE = 0.005
LOGIT_TOL = 1e-4
ENGINE = dict(page_size=8, num_pages=2048, max_num_seqs=48, max_num_batched_tokens=256)


@pytest.fixture(scope="session")
def fp32_models():
    """One float32 tiny model per family, with an sdpa deep copy for reference logits."""
    out = {}
    for fam in FAMILIES:
        model = tiny_model(fam, dtype=torch.float32, seed=11)
        ref = copy.deepcopy(model)
        ref.set_attn_implementation("sdpa")
        out[fam] = (model, ref)
    return out


def _workload(seed: int, n: int, logprobs: int | None = None):
    rng = random.Random(seed)
    prompts = random_prompts(rng, n, lengths=(1, 48))
    params = [SamplingParams(max_tokens=rng.randint(4, 12), temperature=0, ignore_eos=True, logprobs=logprobs)
              for _ in prompts]
    return prompts, params


def _record_logits(engine) -> list[tuple[torch.Tensor, list[str]]]:
    """Observe every step's logits (the runner runs as it is; this only keeps a copy)."""
    seen = []
    execute = engine.runner.execute

    def observed(out):
        logits, sampled, prompt = execute(out)
        seen.append((logits.clone(), [s.seq.request_id for s in sampled]))
        return logits, sampled, prompt

    engine.runner.execute = observed
    return seen


def _top2_gap(ref, ids: list[int]) -> float:
    with torch.inference_mode():
        logits = ref(torch.tensor([ids])).logits[0, -1].double()
    top = logits.topk(2).values
    return float(top[0] - top[1])


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_agreement_with_eager(fp32_models, family):
    model, ref = fp32_models[family]
    prompts, params = _workload(seed=FAMILIES.index(family), n=N_REQUESTS)
    fast_engine = make_engine(model, **ENGINE)
    assert fast_engine.runner.model is not model  # the fast path is the default
    assert fast_engine.runner.compiled is not None  # and with it the compiled forward (worker/compiled.py)
    fast = fast_engine.generate(prompts, params)
    eager = make_engine(model, fast_path=False, **ENGINE).generate(prompts, params)
    ties, far = [], []
    for p, a, b in zip(prompts, fast, eager):
        if a == b:
            continue
        i = next(k for k, (x, y) in enumerate(zip(a, b)) if x != y)
        gap = _top2_gap(ref, p + b[:i])
        (ties if gap < NEAR_TIE else far).append(gap)
    assert not far, f"{family}: {len(far)} requests differ away from a near tie (top-2 gaps {far})"
    assert len(ties) / N_REQUESTS <= MAX_TIE_RATE, f"{family}: near-tie rate {len(ties) / N_REQUESTS:.2%}"


def _assert_step_logits_match_eager(model, seed: int):
    """40 requests through the fast path and the eager one: the same tokens, and every step's
    logits within LOGIT_TOL. Returns the fast engine. (They ask for logprobs, so that every step
    makes logits: plain greedy steps may pick through the screened head instead,
    tests/test_screened_head.py.)"""
    prompts, params = _workload(seed=seed, n=40, logprobs=0)
    runs = []
    for on in (True, False):
        engine = make_engine(model, fast_path=on, **ENGINE)
        seen = _record_logits(engine)
        runs.append((engine, engine.generate(prompts, params), seen))
    (fast_engine, fast, seen_fast), (_, eager, seen_eager) = runs
    assert fast == eager
    assert len(seen_fast) == len(seen_eager) > 5
    worst = 0.0
    for (lf, ids_f), (le, ids_e) in zip(seen_fast, seen_eager):
        assert ids_f == ids_e
        worst = max(worst, float((lf - le).abs().max()))
    assert worst <= LOGIT_TOL, worst
    return fast_engine


@pytest.mark.parametrize("family", FAMILIES)
def test_step_logits_match_eager(fp32_models, family):
    _assert_step_logits_match_eager(fp32_models[family][0], seed=100 + FAMILIES.index(family))


def test_the_float32_linear_kernel_not_picked_here_matches_eager_too(fp32_models, monkeypatch):
    """The compiled forward's float32 linears run through AVX-512 vector panels (and past their rows
    MKL's packed SGEMM on Intel CPUs, oneDNN on AMD ones), and oneDNN's packed linears elsewhere (worker/native.py:
    packed_gemm_preferred); the tests above hold this machine's pick to eager, this one the other
    kernel."""
    from worker import native

    if not native.packed_gemm_usable(torch.float32):
        pytest.skip("no packed float32 kernel here (AVX-512, or MKL on Intel)")
    other = not native.packed_gemm_preferred(torch.float32)
    monkeypatch.setattr(native, "packed_gemm_preferred", lambda dtype: other)
    engine = _assert_step_logits_match_eager(fp32_models["llama"][0], seed=150)
    assert engine.runner.compiled.packed == other


def test_callers_model_is_left_alone_and_weights_shared(fp32_models):
    model, _ = fp32_models["llama"]
    fast = make_engine(model, num_pages=64).runner.model
    assert all(type(m) is not fastpath.FastLinear for m in model.modules())
    assert sum(isinstance(m, torch.nn.Linear) for m in model.modules()) == 2 * 7 + 1
    kinds = {type(m) for m in fast.modules()}
    assert {fastpath.MergedPart, fastpath.FastLinear, fastpath.FastRMSNorm} <= kinds and torch.nn.Linear not in kinds
    assert not any(type(m).__name__ == "LlamaRMSNorm" for m in fast.modules())
    assert fast.model.embed_tokens.weight is model.model.embed_tokens.weight
    assert fast.model.norm.weight is model.model.norm.weight


def test_float64_and_off_run_the_eager_model(caplog):
    model = tiny_model("llama", dtype=torch.float64)
    with caplog.at_level(logging.INFO, logger="tokenq.fastpath"):
        assert make_engine(model, num_pages=64).runner.model is model
        assert make_engine(model.float(), num_pages=64, fast_path=False).runner.model is model
    lines = [r.getMessage() for r in caplog.records if r.name == "tokenq.fastpath"]
    assert len(lines) == 2
    assert "eager (torch.float64" in lines[0] and "turned off" in lines[1]


@pytest.mark.parametrize("pack", [None, torch.float32])
def test_merged_projections_any_order_any_input(pack):
    if pack is not None and not fastpath.onednn_packs(pack):
        pytest.skip("oneDNN does not pack float32 here")
    torch.manual_seed(0)
    lins = [torch.nn.Linear(16, n, bias=b) for n, b in ((8, True), (4, False), (12, True))]
    group = fastpath.MergedLinear(lins, pack)
    parts = [fastpath.MergedPart(group, i) for i in range(3)]
    x, y = torch.randn(2, 5, 16), torch.randn(3, 16)
    with torch.inference_mode():
        for order, inp in (([0, 1, 2], x), ([2, 0, 1], y), ([1, 1, 0, 2, 2], x), ([0], y), ([2, 1, 0], y)):
            for i in order:
                torch.testing.assert_close(parts[i](inp), F.linear(inp, lins[i].weight, lins[i].bias), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("pick", ["here", "other", "widened"])
def test_bfloat16_fast_path_agrees_with_eager(pick, monkeypatch):
    """bf16 linears run on AMX tiles where the CPU has AMX, on AVX512-BF16 dot products where
    it has that alone (worker/csrc/packed_gemm.cpp), and as oneDNN's packed linears elsewhere,
    in float32 where the CPU has no bf16 products and the packed kernels do not serve (an AMD
    EPYC with AVX2: worker/compiled.py's _widened): each held to eager ("other": oneDNN where a
    packed kernel is picked here; "widened": as on such a CPU, whatever this one has)."""
    from worker import native

    if pick == "other":
        if not native.packed_gemm_usable(torch.bfloat16):
            pytest.skip("no AMX or AVX512-BF16 here: oneDNN's linears are the only bf16 kernel")
        monkeypatch.setattr(native, "packed_gemm_preferred", lambda dtype: False)
    if pick == "widened":
        if not fastpath.onednn_packs(torch.float32):
            pytest.skip("oneDNN does not pack float32 here")
        monkeypatch.setattr(fastpath, "cpu_has_native_bf16", lambda: False)
        monkeypatch.setattr(native, "packed_gemm_preferred", lambda dtype: False)
    model = tiny_model("llama", dtype=torch.bfloat16, seed=5)
    prompts, params = _workload(seed=7, n=48)
    fast_engine = make_engine(model, **ENGINE)
    assert fast_engine.runner.model is not model
    fwd = fast_engine.runner.compiled
    assert fwd.packed == (pick == "here" and native.packed_gemm_preferred(torch.bfloat16))
    # the graph's linears multiply in float32 exactly where oneDNN would emulate bf16
    widened = not fwd.packed and fastpath.pack_dtype(torch.bfloat16, torch.device("cpu")) == torch.float32
    assert widened or pick != "widened"
    assert fwd.decoder.layers[0].o_w.dtype == (torch.float32 if widened else torch.bfloat16)
    assert ("in torch.float32" in fwd.linears()) == widened
    fast = fast_engine.generate(prompts, params)
    eager = make_engine(model, fast_path=False, **ENGINE).generate(prompts, params)
    # bf16 keeps 8 bits of mantissa: a different summation order flips more near ties;
    # the first token (the prefill, merged vs separate GEMMs) must agree nearly always
    first = sum(a[0] == b[0] for a, b in zip(fast, eager))
    assert first >= len(prompts) - 2, first


def test_auto_dtype_on_cpu_is_bf16_only_where_native():
    native = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    assert fastpath.cpu_has_native_bf16() == native
    assert resolve_dtype("auto", torch.device("cpu")) == (torch.bfloat16 if native else torch.float32)
    assert resolve_dtype("float32", torch.device("cpu")) == torch.float32


def test_bf16_weights_are_multiplied_natively_or_widened():
    """Where the CPU has no bf16 products oneDNN emulates them (a fifth of float32's rate on an
    Ice Lake): the fast path's bf16 linears are packed as float32 there, as bf16 elsewhere."""
    from worker import native

    cpu = torch.device("cpu")
    if not fastpath.onednn_packs(torch.float32):
        pytest.skip("oneDNN does not pack float32 here")
    want = torch.bfloat16 if fastpath.cpu_has_native_bf16() else torch.float32
    assert fastpath.pack_dtype(torch.bfloat16, cpu) == want
    assert fastpath.pack_dtype(torch.float32, cpu) == torch.float32
    if native.packed_gemm_usable(torch.float32):  # the compiled forward's kernels: widened where not native
        assert native.packed_gemm_usable(torch.bfloat16)
        widened = native.packed_gemm_kernel(torch.bfloat16).startswith(native.WIDENED)
        assert widened == (want == torch.float32)
        if widened:
            assert native.packed_gemm_preferred(torch.bfloat16) == native.packed_gemm_preferred(torch.float32)


# SmolLM2 in bfloat16 against transformers' generate in bfloat16: bf16 logits are spaced
# 2^-7 of their size apart, so a different GEMM summation order (merged, packed, or here
# float32-packed bf16 weights) can flip a greedy choice whose two best logits lie within a
# few such steps. A request may differ only there: the reference's top-2 gap at the first
# differing token is at most BF16_NEAR_TIE of the top logit.
BF16_NEAR_TIE = 2.0**-5


@pytest.mark.slow  # bf16 SmolLM2 is 36 s on an AVX2-only CPU; test_bfloat16_fast_path_agrees_with_eager covers bf16 by default
@pytest.mark.smollm
def test_smollm2_bfloat16_greedy_matches_generate_but_near_ties(smollm2_dir):
    from worker.models import load

    model, tok = load(smollm2_dir, device="cpu", dtype="bfloat16")
    ref = copy.deepcopy(model)
    ref.set_attn_implementation("sdpa")
    prompts = [tok.encode(t) for t in ("The quick brown fox", "def fibonacci(n):\n    ",
                                        "Once upon a time, in a small village by the sea, there lived")]
    n = 10
    engine = make_engine(model, tok, num_pages=64, max_num_seqs=3)
    assert engine.runner.model is not model
    outs = engine.generate(prompts, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
    exact = 0
    for p, got in zip(prompts, outs):
        ids = torch.tensor([p])
        want = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                            eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
        if got == want:
            exact += 1
            continue
        i = next(k for k, (a, b) in enumerate(zip(got, want)) if a != b)
        with torch.inference_mode():
            top = ref(torch.tensor([p + want[:i]])).logits[0, -1].float().topk(2).values
        assert float(top[0] - top[1]) <= BF16_NEAR_TIE * abs(float(top[0])), (i, tok.decode(got), tok.decode(want), top)
    assert exact >= len(prompts) - 1, exact


def test_worker_setting_turns_the_fast_path_off():
    from common.settings import Settings
    from worker.main import engine_config

    assert engine_config(Settings(), "cpu").fast_path is True
    assert engine_config(Settings.from_env({"TOKENQ_FAST_PATH": "off"}), "cpu").fast_path is False
    with pytest.raises(ValueError):
        Settings.from_env({"TOKENQ_FAST_PATH": "maybe"})


def test_a_model_it_cannot_copy_runs_eager(caplog):
    import threading

    model = tiny_model("llama", dtype=torch.float32)
    model.model.lock = threading.Lock()  # a module holding something deepcopy refuses
    with caplog.at_level(logging.INFO, logger="tokenq.fastpath"):
        engine = make_engine(model, num_pages=64)
    assert engine.runner.model is model
    assert any("fast path failed to build" in r.getMessage() for r in caplog.records)
    assert engine.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))[0]


def test_small_weights_at_few_rows_take_plain_f_linear():
    if not fastpath.onednn_packs(torch.float32):
        pytest.skip("oneDNN does not pack float32 here")
    torch.manual_seed(1)
    small, big = torch.nn.Linear(64, 96), torch.nn.Linear(64, fastpath.PLAIN_MAX_WEIGHT // 64 + 1, bias=False)
    fs, fb = (fastpath.FastLinear(m.weight, m.bias, torch.float32) for m in (small, big))
    assert fs.plain is not None and fb.plain is None
    few, many = torch.randn(1, fastpath.PLAIN_MAX_ROWS, 64), torch.randn(1, 4 * fastpath.PLAIN_MAX_ROWS, 64)
    with torch.inference_mode():
        assert torch.equal(fs(few), F.linear(few, small.weight, small.bias))  # the very same kernel
        for f, m, x in ((fs, small, many), (fb, big, few), (fb, big, many)):
            torch.testing.assert_close(f(x), F.linear(x, m.weight, m.bias), rtol=1e-5, atol=1e-5)


def test_other_families_run_eager(caplog):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("gemma2", vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    model = AutoModelForCausalLM.from_config(config).float().eval()
    with caplog.at_level(logging.INFO, logger="tokenq.fastpath"):
        assert make_engine(model, num_pages=64).runner.model is model
    assert any("not 'gemma2'" in r.getMessage() for r in caplog.records)
