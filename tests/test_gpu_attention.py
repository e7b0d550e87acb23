"""The CUDA attention path, checked on the CPU: the Triton kernels (worker/gpu_attention.py) run
under Triton's interpreter here, and the CUDA graphs' step buffers (worker/cuda_graphs.py:
padding, the scratch page, block tables padded to one width) run without capture. On a GPU the
same tests run the compiled kernels, and one more captures the graphs; what only a GPU can show
(the capture, the speed) is measured by scripts/cuda_check.sh.
"""

from __future__ import annotations

import random

import pytest
import torch
from engine_helpers import drive, greedy, make_engine, model_pair, random_prompts, reference

from worker import compiled, cuda_graphs, gpu_attention
from worker.cache import KVCache

# On a machine without a GPU, tests/conftest.py sets TRITON_INTERPRET=1: the kernel runs on CPU tensors.
pytest.importorskip("triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _reference(q, kc, vc, table, c, scaling, window):
    """The attention of a sequence's last len(q) positions (up to position c - 1) in float64
    from its pages, causal: q [L, H, D] -> [L, H, D]."""
    kvh, ps, D = kc.shape[1:]
    L, H = q.shape[:2]
    pages = table[:-(-c // ps)].long()
    K = kc[pages].transpose(0, 1).reshape(kvh, -1, D)[:, :c].double().repeat_interleave(H // kvh, 0)
    V = vc[pages].transpose(0, 1).reshape(kvh, -1, D)[:, :c].double().repeat_interleave(H // kvh, 0)
    s = q.double().transpose(0, 1) @ K.transpose(1, 2) * scaling  # [H, L, c]
    qpos = torch.arange(c - L, c, device=q.device)[:, None]
    kpos = torch.arange(c, device=q.device)[None, :]
    see = (kpos <= qpos) & ((kpos > qpos - window) if window else True)
    s = s.masked_fill(~see, float("-inf"))
    return (s.softmax(-1) @ V).transpose(0, 1)


def _pool(pages, kvh, ps, D, dtype):
    """K/V pools of random values; the last page NaN (no sequence holds it: the tables' padding)."""
    kc = torch.randn(pages, kvh, ps, D, dtype=dtype, device=DEVICE)
    vc = torch.randn_like(kc)
    kc[pages - 1] = vc[pages - 1] = float("nan")
    return kc, vc


def _tables(lengths, pages, ps, dtype):
    """Block tables for sequences of ``lengths`` on distinct random pages, padded with the NaN page,
    and NaN written past each sequence's last slot (never to be read)."""
    order = torch.randperm(pages - 1).tolist()
    width = max(-(-c // ps) for c in lengths) + 1
    tables = torch.full((len(lengths), width), pages - 1, dtype=dtype, device=DEVICE)
    for i, c in enumerate(lengths):
        for p in range(-(-c // ps)):
            tables[i, p] = order.pop()
    return tables


def _spoil_tails(kc, vc, tables, lengths, ps):
    for i, c in enumerate(lengths):
        p, o = divmod(c, ps)
        if o:
            kc[tables[i, p], :, o:] = vc[tables[i, p], :, o:] = float("nan")


def _tolerance(dtype):
    return 1e-5 if dtype == torch.float32 else 1e-2  # the output's own rounding in half precision


@pytest.mark.parametrize("dtype,H,kvh,D,ps,window,index", [
    (torch.float32, 9, 3, 64, 16, None, torch.int32),  # SmolLM2's heads
    (torch.float32, 14, 2, 64, 8, None, torch.int64),  # 7 query heads a group (padded to 8)
    (torch.bfloat16, 4, 4, 32, 16, 5, torch.int32),  # no grouping, a sliding window
    (torch.float16, 8, 2, 16, 4, 11, torch.int64),
])
def test_decode_kernel_matches_attention_over_the_pages(dtype, H, kvh, D, ps, window, index):
    torch.manual_seed(0)
    pages, ctxs = 64, [1, ps - 1, ps, ps + 1, 3 * ps + 2, 7 * ps]
    kc, vc = _pool(pages, kvh, ps, D, dtype)
    tables = _tables(ctxs, pages, ps, index)
    _spoil_tails(kc, vc, tables, ctxs, ps)
    q = torch.randn(len(ctxs), H, D, dtype=dtype, device=DEVICE)
    out = gpu_attention.paged_decode(q, kc, vc, tables, torch.tensor(ctxs, dtype=index, device=DEVICE), D**-0.5, window)
    for i, c in enumerate(ctxs):
        want = _reference(q[i:i + 1], kc, vc, tables[i], c, D**-0.5, window)[0]
        assert torch.isfinite(out[i]).all()
        assert (out[i].double() - want).abs().max().item() <= _tolerance(dtype) * max(1.0, want.abs().max().item()), (i, c)


@pytest.mark.parametrize("dtype,H,kvh,D,ps,window", [
    (torch.float32, 9, 3, 64, 16, None),  # SmolLM2's heads
    (torch.bfloat16, 4, 2, 32, 8, 20),  # a sliding window shorter than the chunks
    (torch.float16, 4, 4, 16, 16, None),
])
def test_prefill_kernel_matches_causal_attention_over_the_pages(dtype, H, kvh, D, ps, window):
    """Chunks of several lengths (1 row, under a block, several blocks), some after a cached
    prefix, all in one call: each row attends its prefix and its chunk up to itself."""
    torch.manual_seed(1)
    starts, lens = [0, 0, 13, 40, 7], [1, 29, 5, 70, 33]
    ends = [a + n for a, n in zip(starts, lens)]
    pages = 64
    kc, vc = _pool(pages, kvh, ps, D, dtype)
    tables = _tables(ends, pages, ps, torch.int32)
    _spoil_tails(kc, vc, tables, ends, ps)
    q = torch.randn(sum(lens), H, D, dtype=dtype, device=DEVICE)
    rows = [sum(lens[:i]) for i in range(len(lens))]
    i32 = dict(dtype=torch.int32, device=DEVICE)
    out = gpu_attention.paged_prefill(q, kc, vc, tables, torch.tensor(starts, **i32), torch.tensor(lens, **i32),
                                      torch.tensor(rows, **i32), torch.tensor(gpu_attention.work(lens), **i32),
                                      D**-0.5, window)
    for i, (r, n, c) in enumerate(zip(rows, lens, ends)):
        want = _reference(q[r:r + n], kc, vc, tables[i], c, D**-0.5, window)
        got = out[r:r + n].double()
        assert torch.isfinite(got).all(), i
        assert (got - want).abs().max().item() <= _tolerance(dtype) * max(1.0, want.abs().max().item()), i


def test_why_not():
    assert gpu_attention.why_not("cpu", torch.float32, 64) == "it runs on CUDA"
    assert "float64" in gpu_attention.why_not("cuda", torch.float64, 64)
    assert "head size 80" in gpu_attention.why_not("cuda", torch.float32, 80)


def test_sizes():
    assert cuda_graphs.sizes(1) == [2]
    assert cuda_graphs.sizes(8) == [2, 4, 8]
    assert cuda_graphs.sizes(20) == [2, 4, 8, 16, 24]
    assert cuda_graphs.sizes(256)[-3:] == [240, 248, 256] and len(cuda_graphs.sizes(256)) == 34


class _Eager:
    """The model's own forward with tokenq's attention, as DecodeGraphs calls a compiled one."""

    def __init__(self, model):
        self.model, self.head = model, model.get_output_embeddings()
        self.rows: list[int] = []  # the padded size of each step run

    def hidden(self, ids, positions, meta):
        self.rows.append(ids.shape[0])
        return self.model.model(input_ids=ids[None], position_ids=positions[None], use_cache=False, tokenq=meta)[0][0]


@pytest.mark.parametrize("family", ["llama", "qwen3"])  # qwen3: q/k norms and a sliding-window layer
def test_steps_through_the_kernels_and_the_graph_buffers_match_generate(family):
    """An engine whose decodes and prefill chunks attend through the kernels (chunked prompts, so
    some chunks follow a cached prefix) and whose decode-only steps run on the
    CUDA graphs' buffers (padded rows on a scratch page, tables padded to the engine's width):
    greedy output equals transformers' generate on every request."""
    model, ref = model_pair(family, dtype=torch.float32, seed=5)
    model, ref = model.to(DEVICE), ref.to(DEVICE)
    engine = make_engine(model, page_size=8, num_pages=96, max_num_seqs=6, max_num_batched_tokens=64, fast_path=False)
    runner = engine.runner
    n_pages = engine.allocator.num_pages
    runner.cache = engine.cache = KVCache(num_pages=n_pages + 1, dtype=torch.float32, device=DEVICE,
                                          num_layers=engine.cache.k.shape[0], page_size=8,
                                          num_kv_heads=engine.cache.k.shape[2], head_dim=engine.cache.k.shape[4])
    runner.cache.k[:, n_pages] = float("nan")  # the scratch page's contents never reach a real row
    runner.gpu_attention = True
    fwd = _Eager(model)
    runner.graphs = cuda_graphs.DecodeGraphs(fwd, engine.cache, 6, -(-engine.max_model_len // 8), n_pages, capture=False)
    rng = random.Random(1)
    prompts = random_prompts(rng, 9, (1, 40))
    arrivals = {0: [], 3: []}
    for i, p in enumerate(prompts):
        arrivals[0 if i < 5 else 3].append((f"r{i}", p, greedy(rng.randint(4, 14))))
    run = drive(engine, arrivals)
    for i, p in enumerate(prompts):
        want = reference(ref, p, len(run.tokens(f"r{i}")))
        assert run.tokens(f"r{i}") == want, i
    # decode-only steps ran on the buffers, padded to a size: 5 or 6 sequences as 8
    assert set(fwd.rows) <= {2, 4, 8} and 8 in fwd.rows, fwd.rows


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs are captured on a GPU (scripts/cuda_check.sh)")
def test_engine_on_cuda_replays_decode_graphs_and_matches_generate(caplog):
    """On a GPU the engine's default: the compiled forward, decodes through the kernel, decode-only
    steps replayed as CUDA graphs; greedy output equals generate on every request."""
    import logging

    model, ref = model_pair("llama", dtype=torch.float32, seed=7)
    model, ref = model.to("cuda"), ref.to("cuda")
    with caplog.at_level(logging.INFO, logger="tokenq.engine"):
        engine = make_engine(model, page_size=8, num_pages=256, max_num_seqs=12, max_num_batched_tokens=96)
    assert engine.runner.graphs is not None and engine.runner.graphs.graphs, caplog.text
    compiled_before = compiled.compile_count()
    rng = random.Random(2)
    prompts = random_prompts(rng, 20, (1, 60))
    arrivals: dict[int, list] = {}
    for i, p in enumerate(prompts):
        arrivals.setdefault(3 * (i % 5), []).append((f"r{i}", p, greedy(rng.randint(2, 30))))
    run = drive(engine, arrivals)
    assert engine.runner.graphs.steps > 10
    assert compiled.compile_count() == compiled_before  # prefill, mixed and captured steps: no recompile
    for i, p in enumerate(prompts):
        assert run.tokens(f"r{i}") == reference(ref, p, len(run.tokens(f"r{i}"))), i
