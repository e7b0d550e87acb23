"""The compiled forward (worker/compiled.py): one graph for every batch shape, the same tokens
as the eager path, and a clear fallback where it does not apply.

Greedy agreement over 200 requests per family and step logits within 1e-4 are in
tests/test_fastpath.py (its fast engines run the compiled forward); here: no recompilation
after warm-up, whatever the step's shape, and when it is not used.
"""

from __future__ import annotations

import gc
import logging
import random

import pytest
import torch
from engine_helpers import drive, make_engine
from test_families import ROPE
from tiny import tiny_model

from common.protocol import SamplingParams
from worker import compiled

ENGINE = dict(page_size=8, num_pages=1024, max_num_seqs=32, max_num_batched_tokens=96)


@pytest.fixture(scope="module")
def llama32():
    return tiny_model("llama", dtype=torch.float32, seed=3)


def _shapes_workload(seed: int):
    """Arrivals that make every kind of step: prefills only (a burst arrives), decodes only
    (nothing new for a while), mixed, a single sequence (one token: the padded row), many,
    prompts of one token, chunked prompts longer than a step's budget."""
    rng = random.Random(seed)
    arrivals: dict[int, list[tuple]] = {}
    n = 0

    def add(step, count, lo, hi):
        nonlocal n
        for _ in range(count):
            prompt = [rng.randrange(3, 500) for _ in range(rng.randint(lo, hi))]
            params = SamplingParams(max_tokens=rng.randint(1, 24), temperature=0, ignore_eos=True)
            arrivals.setdefault(step, []).append((f"r{n}", prompt, params))
            n += 1

    add(0, 1, 1, 1)  # one sequence, one token: prefill of T=1, then decodes of T=1
    add(30, 20, 1, 40)  # a burst: prefill-only steps, then mixed
    add(45, 1, 200, 250)  # a prompt longer than the step budget: chunked, alongside decodes
    for step in range(60, 200, 7):  # a trickle: mixed steps of every size
        add(step, rng.randint(1, 6), 1, 60)
    return arrivals


def test_no_recompilation_at_any_batch_shape(llama32, caplog):
    with caplog.at_level(logging.INFO, logger="tokenq.engine"):
        engine = make_engine(llama32, **ENGINE)
    assert engine.runner.compiled is not None, caplog.text
    assert any("compiled forward: on" in r.getMessage() for r in caplog.records)
    sizes: list[tuple[int, int]] = []  # (decodes, prefill tokens) of each step
    schedule = engine.scheduler.schedule

    def observed(*a, **kw):
        out = schedule(*a, **kw)
        dec = sum(1 for s in out.scheduled if s.num_tokens == 1 and s.start >= s.seq.num_prompt_tokens)
        sizes.append((dec, sum(s.num_tokens for s in out.scheduled) - dec))
        return out

    engine.scheduler.schedule = observed
    before = compiled.compile_count()
    run = drive(engine, _shapes_workload(seed=1))
    assert compiled.compile_count() == before, "the compiled forward recompiled after warm-up"
    # the workload did make every kind of step
    tokens = {d + p for d, p in sizes}
    assert 1 in tokens and max(tokens) == ENGINE["max_num_batched_tokens"]
    assert any(d == 0 and p > 1 for d, p in sizes), "no prefill-only step"
    assert any(d > 1 and p == 0 for d, p in sizes), "no decode-only step of several sequences"
    assert any(d and p for d, p in sizes), "no mixed step"
    assert len(tokens) > 20
    # and produced what the eager forward does
    eager = drive(make_engine(llama32, fast_path=False, **ENGINE), _shapes_workload(seed=1))
    for rid in run.added:
        got = [t for o in run.outputs[rid] for t in o.new_token_ids]
        assert got == [t for o in eager.outputs[rid] for t in o.new_token_ids], rid


def test_steps_of_sizes_not_run_at_start_are_padded_where_linears_are_onednn(llama32, monkeypatch):
    """oneDNN builds a kernel for each new row count of a GEMM (compiled.ROW_STEP): a step of a
    size the engine did not run at start goes through the graph padded to a multiple of 16
    rows, with the tokens the eager path gives. (float32 linears are oneDNN's here whatever
    this CPU would pick: MKL's packed SGEMM has no such cost and is never padded.)"""
    from worker import native

    monkeypatch.setattr(native, "packed_gemm_preferred", lambda dtype: False)
    engine = make_engine(llama32, **ENGINE)
    fwd = engine.runner.compiled
    assert fwd.onednn and not fwd.packed
    assert set(range(1, ENGINE["max_num_seqs"] + 1)) <= fwd.warm_sizes  # every decode batch size, exact
    assert [fwd.rows(t) for t in (1, 2, 17, 33, 47, 48, 49, 96)] == [2, 2, 17, 48, 48, 48, 64, 96]
    rows, steps = [], []
    graph, execute = fwd.graph, engine.runner.execute
    monkeypatch.setattr(fwd, "graph", lambda ids, pos: rows.append(len(ids)) or graph(ids, pos))
    monkeypatch.setattr(engine.runner, "execute", lambda out: steps.append(out.num_batched_tokens) or execute(out))
    run = drive(engine, _shapes_workload(seed=2))
    assert len(rows) == len(steps)
    padded = [(t, r) for t, r in zip(steps, rows) if t not in fwd.warm_sizes]
    assert len(padded) > 5 and any(r > t for t, r in padded)
    assert all(r == t for t, r in zip(steps, rows) if t in fwd.warm_sizes and t > 1)
    assert all(r % 16 == 0 and t <= r < t + 16 for t, r in padded)
    eager = drive(make_engine(llama32, fast_path=False, **ENGINE), _shapes_workload(seed=2))
    for rid in run.added:
        got = [t for o in run.outputs[rid] for t in o.new_token_ids]
        assert got == [t for o in eager.outputs[rid] for t in o.new_token_ids], rid


def test_packed_linears_are_warmed_shape_by_shape_not_through_the_graph(llama32, monkeypatch):
    """Where the packed kernels take every linear, a step size is warmed by running each
    distinct linear shape and the LM head once at that many rows (oneDNN's primitives depend on
    the shape and the row count, not the weights), not the whole graph; the sizes then run
    unpadded, with the tokens the eager path gives."""
    engine = make_engine(llama32, **ENGINE)
    fwd = engine.runner.compiled
    if not fwd.packed:
        pytest.skip("the packed kernels do not take the linears on this CPU")
    cfg = llama32.config
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    h, inter = cfg.hidden_size, cfg.intermediate_size
    assert {(out, k) for L in fwd.decoder.layers for _, out, k in L.gemm_shapes} == {
        (q + 2 * kv, h), (h, q), (2 * inter, h), (h, inter)}
    assert all(len(L.gemm_shapes) == 4 for L in fwd.decoder.layers)
    assert set(range(1, ENGINE["max_num_seqs"] + 1)) <= fwd.warm_sizes
    graph_rows, head_rows = [], []
    graph, head = fwd.graph, fwd.head
    monkeypatch.setattr(fwd, "graph", lambda ids, pos: graph_rows.append(len(ids)) or graph(ids, pos))
    monkeypatch.setattr(fwd, "head", lambda x: head_rows.append(x.shape[0]) or head(x))
    shape = dict(num_layers=cfg.num_hidden_layers, num_kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
                 page_size=ENGINE["page_size"])
    kernels = (engine.runner.native_decode, engine.runner.native_prefill)
    new = [37, 53, 70]
    assert not set(new) & fwd.warm_sizes and [fwd.rows(t) for t in new] == ([48, 64, 80] if fwd.onednn else new)
    assert compiled.warm_sizes(fwd, shape, torch.device("cpu"), torch.float32, kernels, new + [5]) > 0
    assert graph_rows == [] and head_rows == new  # 5 was warm already
    assert set(new) <= fwd.warm_sizes and [fwd.rows(t) for t in new] == new
    run = drive(engine, _shapes_workload(seed=2))
    eager = drive(make_engine(llama32, fast_path=False, **ENGINE), _shapes_workload(seed=2))
    for rid in run.added:
        got = [t for o in run.outputs[rid] for t in o.new_token_ids]
        assert got == [t for o in eager.outputs[rid] for t in o.new_token_ids], rid


def test_leftovers_in_reused_pages_change_nothing(llama32):
    """With the native kernels the runner does not zero a page it hands out again: nothing
    reads a slot past a sequence's context. A pool full of NaN and inf from the start, its pages
    reused many times over (a few pages for the whole workload), gives the same tokens."""
    rng = random.Random(2)
    arrivals = {step: [(f"r{step}-{i}", [rng.randrange(3, 500) for _ in range(rng.randint(5, 60))],
                        SamplingParams(max_tokens=rng.randint(4, 20), temperature=0, ignore_eos=True))
                       for i in range(8)] for step in (0, 12, 24, 36)}
    cfg = dict(ENGINE, num_pages=32)  # 256 slots for 32 requests of up to 80 tokens
    clean = drive(make_engine(llama32, **cfg), arrivals)
    engine = make_engine(llama32, **cfg)
    assert engine.runner.native_decode, "the native kernels did not load"
    engine.runner.cache.k.fill_(float("nan"))
    engine.runner.cache.v.fill_(float("inf"))
    dirty = drive(engine, arrivals)
    needed = sum(-(-(len(p) + sp.max_tokens) // cfg["page_size"]) for reqs in arrivals.values() for _, p, sp in reqs)
    assert needed > 2 * cfg["num_pages"]  # every page is handed out again, some several times
    for rid in clean.added:
        got = [t for o in dirty.outputs[rid] for t in o.new_token_ids]
        assert got == [t for o in clean.outputs[rid] for t in o.new_token_ids], rid


@pytest.mark.parametrize("kind", list(ROPE))
def test_rope_tables_are_exact_for_every_rope_type(kind):
    # the graph reads cos/sin from a table built once by the model's rotary module
    model = tiny_model("llama", dtype=torch.float32, rope_parameters={**ROPE[kind], "rope_theta": 10000.0}, head_dim=16)
    rng = random.Random(4)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randint(1, 50))] for _ in range(8)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    fast = make_engine(model, page_size=4, num_pages=256)
    assert fast.runner.compiled is not None
    assert fast.generate(prompts, params) == make_engine(model, page_size=4, num_pages=256, fast_path=False).generate(prompts, params)


def test_engines_on_one_model_share_the_graph(llama32):
    a = make_engine(llama32, **ENGINE)
    before = compiled.compile_count()
    b = make_engine(llama32, **ENGINE)
    # a cache of another size (another max_model_len, page size) reuses the graph too: the RoPE
    # table covers the model's whole length (compiled.TABLE_LEN), not one engine's
    c = make_engine(llama32, page_size=8, num_pages=20)
    assert c.max_model_len != a.max_model_len
    assert b.runner.compiled is a.runner.compiled and c.runner.compiled is a.runner.compiled
    assert compiled.compile_count() == before
    prompts = [[5, 6, 7, 8, 9], [11, 12, 13]]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    assert c.generate(prompts, params) == a.generate(prompts, params)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linears_run_through_packed_weights_freed_with_the_graph(dtype):
    """On CPU the decoder's four linears a layer go through worker/csrc/packed_gemm.cpp where
    asked, by default where its kernel is the faster one (float32: AVX-512, then MKL on Intel
    CPUs or oneDNN on AMD ones, MKL past a decode step's rows there; bf16: AMX tiles or AVX512-BF16 (on
    Intel past 12 rows widened to float32), else widened to float32); the packed copies are released with the decoder that made them, and its products
    are the eager model's."""
    from worker import native

    if not native.packed_gemm_usable(dtype):
        pytest.skip(f"no packed {dtype} kernel here")
    model = tiny_model("llama", dtype=dtype, seed=11)
    default = compiled.CompiledForward(model, 64, model.get_output_embeddings(), native_attention=True)
    assert default.packed == native.packed_gemm_preferred(dtype)
    del default
    fwd = compiled.CompiledForward(model, 64, model.get_output_embeddings(), native_attention=True, packed=True)
    layer = fwd.decoder.layers[0]
    handles = [h for L in fwd.decoder.layers for h in L.handles()]
    assert fwd.packed and len(handles) == 4 * len(fwd.decoder.layers) and layer.qkv_w is None
    f32 = (native.MKL, "AVX2 vectors (MKL's packed SGEMM past 192 rows)",  # without AVX-512 (or AVX2)
           "AVX-512 vectors (oneDNN past 32 rows, 128 for a weight it would split unevenly)",  # Zen 4
           "AVX-512 vectors (oneDNN past 128 rows)",  # Zen 5
           "AVX-512 vectors (MKL's packed SGEMM past 128 rows)")
    kernels = {torch.bfloat16: ("AMX tiles (oneDNN past 128 rows)", "AVX512-BF16 vectors (oneDNN past 64 rows, 128 for a weight it would split unevenly)",  # Zen 4
                                "AVX512-BF16 vectors (oneDNN past 128 rows)",  # Zen 5
                                f"AVX512-BF16 vectors (past 12 rows widened to float32: {f32[-1]})",  # Intel, no AMX
                                *(f"{native.WIDENED}: {k}" for k in f32)),
               torch.float32: f32}[dtype]
    assert fwd.linears() in kernels
    assert fwd.onednn == ("oneDNN" in fwd.linears())  # rows past the kernel's go to oneDNN: padded
    at = model.model.layers[0].self_attn
    for rows in (5, 64, 200):  # the packed kernel, then those past its rows
        x = torch.randn(rows, model.config.hidden_size).to(dtype)
        want = torch.cat([at.q_proj(x), at.k_proj(x), at.v_proj(x)], -1)
        tol = dict(rtol=1.6e-2, atol=1e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(torch.ops.tokenq_native.gemm_packed(x, layer.qkv_h), want, **tol)
    del fwd, layer
    gc.collect()
    with pytest.raises(RuntimeError, match="no packed weight"):
        torch.ops.tokenq_native.gemm_packed(x, handles[0])


def test_rope_table_length():
    assert compiled.table_len(40000, 2**20) == 40000  # an engine longer than the table's cap: its own length
    assert compiled.table_len(256, 2048) == compiled.table_len(1024, 2048) == 2048  # shared by every engine on it
    assert compiled.table_len(256, 2**31) == compiled.TABLE_LEN


def _compiled_log(caplog, model, **cfg) -> str:
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="tokenq.engine"):
        engine = make_engine(model, num_pages=64, **cfg)
    assert engine.runner.compiled is None
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("compiled forward")]
    assert len(lines) == 1, lines
    return lines[0]


def test_where_it_does_not_apply_the_engine_says_why(caplog, monkeypatch):
    assert "float64" in _compiled_log(caplog, tiny_model("llama", dtype=torch.float64))
    assert "turned off" in _compiled_log(caplog, tiny_model("llama", dtype=torch.float32), fast_path=False)
    monkeypatch.setenv("TOKENQ_COMPILE", "0")
    assert "TOKENQ_COMPILE=0" in _compiled_log(caplog, tiny_model("llama", dtype=torch.float32))


def test_a_graph_that_disagrees_with_eager_is_not_used(caplog, monkeypatch):
    # a wrong norm inside the graph (epsilon 1e3 times too large): the warm-up check catches it
    real = compiled._rms_norm
    monkeypatch.setattr(compiled, "_rms_norm", lambda x, w, eps: real(x, w, eps + 1.0))
    line = _compiled_log(caplog, tiny_model("llama", dtype=torch.float32, seed=8))
    assert "logits differ from the eager forward's" in line
    # the engine still serves, on the eager fast path
    engine = make_engine(tiny_model("llama", dtype=torch.float32, seed=8), num_pages=64)
    assert engine.runner.compiled is None
    assert len(engine.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))[0]) == 3


def test_a_bfloat16_graph_is_held_to_the_exact_result(caplog, monkeypatch):
    # bf16: the graph is checked against a float32 evaluation of the same weights (two bf16
    # forwards rounding in different places may differ by more than either is off); a right
    # graph serves, a wrong one is refused with the figures
    with caplog.at_level(logging.INFO, logger="tokenq.engine"):
        engine = make_engine(tiny_model("llama", dtype=torch.bfloat16, seed=8), num_pages=64)
    assert engine.runner.compiled is not None, caplog.text
    real = compiled._rms_norm
    monkeypatch.setattr(compiled, "_rms_norm", lambda x, w, eps: real(x, w, eps + 1.0))
    line = _compiled_log(caplog, tiny_model("llama", dtype=torch.bfloat16, seed=9))
    assert "from a float32 evaluation of the same weights" in line, line


def test_engines_stepping_in_two_threads_keep_their_own_steps():
    # the attention op reads its step from a per-thread context: two compiled engines stepping
    # at once in two threads must each get their own model's tokens
    import threading

    models = [tiny_model("llama", dtype=torch.float32, seed=s) for s in (21, 22)]
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randint(1, 30))] for _ in range(6)]
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    engines = [make_engine(m, **ENGINE) for m in models]
    assert all(e.runner.compiled is not None for e in engines)
    alone = [e.generate(prompts, params) for e in engines]
    assert alone[0] != alone[1]
    got: list = [None, None]

    def run(i):
        got[i] = [engines[i].generate(prompts, params) for _ in range(3)]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == [[alone[0]] * 3, [alone[1]] * 3]


def test_the_graph_compiles_before_the_native_attention_kernel_is_waited_for(monkeypatch):
    """worker/native.py builds the steps' kernels (paged attention) while the graph compiles:
    the graph's first call only compiles it, and only then does the engine wait for that build."""
    from worker import native

    if not native.usable(torch.device("cpu"), torch.float32):
        pytest.skip(f"no native kernels here: {native.error()}")
    seen = []
    real = native.load
    monkeypatch.setattr(native, "load", lambda: seen.append(compiled.compile_count()) or real())
    before = compiled.compile_count()
    engine = make_engine(tiny_model("llama", dtype=torch.float32, seed=11, head_dim=32), num_pages=64)
    assert engine.runner.compiled is not None and engine.runner.compiled.native  # the graph calls the native op
    decoder = engine.runner.compiled.decoder
    if native.silu_mul_vectorised():  # and its SiLU layers the native SiLU times up (AVX-512)
        assert decoder.silu_mul is torch.ops.tokenq_native.silu_mul and all(L.silu for L in decoder.layers)
    else:  # elsewhere Inductor's own loop (faster than the op's scalar one)
        assert decoder.silu_mul is None
    assert seen and seen[0] == before + 1  # the first wait came after the graph compiled, not before
    out = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert len(out[0]) == 4


def test_where_the_native_attention_kernel_does_not_build_the_torch_path_serves(caplog, monkeypatch):
    """The linears' library built but the steps' did not (a compiler error in it): the compiled
    graph, traced around the native attention op, is dropped with the reason, and the engine
    attends through torch ops, giving the same tokens."""
    from worker import native

    if not native.usable(torch.device("cpu"), torch.float32):
        pytest.skip(f"no native kernels here: {native.error()}")
    model = tiny_model("llama", dtype=torch.float32, seed=12, head_dim=32)
    prompts = [[5, 6, 7], [9, 10, 11, 12, 13]]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    want = make_engine(model, num_pages=64).generate(prompts, params)
    monkeypatch.setattr(native, "load", lambda: None)
    monkeypatch.setattr(native, "_error", "RuntimeError: a build error")
    with caplog.at_level(logging.INFO, logger="tokenq.engine"):
        engine = make_engine(tiny_model("llama", dtype=torch.float32, seed=12, head_dim=32), num_pages=64)
    assert not engine.runner.native_decode and not engine.runner.native_prefill
    assert engine.runner.compiled is None
    assert "the native attention kernel did not build: RuntimeError: a build error" in caplog.text
    monkeypatch.undo()  # (the sampler's greedy picks ask native.load too)
    assert engine.generate(prompts, params) == want


def test_the_first_step_at_the_token_budget_finds_its_buffers_in_place(llama32):
    """Start-up runs a step at the token budget (compiled.warm_budget), so the first such step
    served does not page-fault its buffers in (they were 15,500 faults and 30 ms of a tiny
    float32 model's first 2,048-token step)."""
    import resource

    engine = make_engine(llama32, page_size=8, num_pages=1024, max_num_seqs=32, max_num_batched_tokens=1024)
    assert engine.runner.compiled is not None
    rng = random.Random(5)
    faults = []
    for run in range(2):  # the same step twice: prompts filling the budget exactly
        for i in range(8):
            prompt = [rng.randrange(3, 500) for _ in range(128)]
            engine.add_request(f"b{run}-{i}", prompt, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        engine.step()
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
        drive(engine)
    # Without the warm-up this first step takes about 1,300 faults (the budget's buffers) and the
    # second none. The slack is for the interpreter's own allocations, which vary with what ran
    # before in the process: a CI run saw 129 against 3 (an arena of Python objects is 256 pages).
    assert faults[0] <= faults[1] + 400, faults
