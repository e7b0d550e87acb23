"""The native paged attention kernels (worker/native.py, worker/csrc/paged_attention.cpp), decode
and prefill, against a dense float64 reference, and where the engine uses them.

End to end, the kernels are part of the fast path: tests/test_fastpath.py's greedy agreement
(200 requests per family) and per-step logits (1e-4) compare an engine that attends through
them with the eager engine, which attends through the torch path (worker/attention.py).
"""

from __future__ import annotations

import logging
import random

import pytest
import torch
from engine_helpers import make_engine
from helpers import thp_mode
from tiny import tiny_model

from worker import native

pytestmark = pytest.mark.skipif(not native.usable(torch.device("cpu"), torch.float32),
                                reason=f"the native kernel cannot be built here: {native.error()}")

# float32: summation order only; half precision: the output's own rounding dominates
TOL = {torch.float32: 2e-6, torch.bfloat16: 2e-2, torch.float16: 3e-3}


def _dense(q, kc, vc, tables, ctx, scale, window=None, softcap=None, sinks=None) -> torch.Tensor:
    """Each decode's attention over its first ctx slots, in float64, one sequence at a time."""
    n, H, D = q.shape
    kvh = kc.shape[1]
    g = H // kvh
    out = torch.empty(n, H, D, dtype=torch.float64)
    for i in range(n):
        pages = torch.tensor(tables[i])
        k = kc[pages].transpose(0, 1).reshape(kvh, -1, D)[:, :ctx[i]].double().repeat_interleave(g, 0)
        v = vc[pages].transpose(0, 1).reshape(kvh, -1, D)[:, :ctx[i]].double().repeat_interleave(g, 0)
        s = torch.einsum("hd,hsd->hs", q[i].double(), k) * scale
        if softcap:
            s = torch.tanh(s / softcap) * softcap
        if window:
            s[:, :max(0, ctx[i] - window)] = float("-inf")
        if sinks is not None:
            s = torch.cat([s, sinks.double()[:, None]], 1)
        p = torch.softmax(s, -1)[:, :ctx[i]]
        out[i] = torch.einsum("hs,hsd->hd", p, v)
    return out


def _case(dtype, D, kvh, g, seed, n=12, ps=16, pages=300):
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    kc = torch.randn(pages, kvh, ps, D, generator=gen).to(dtype)
    vc = torch.randn(pages, kvh, ps, D, generator=gen).to(dtype)
    # contexts from one slot to many pages, last pages partly filled; tables scattered over the pool
    ctx = [1, ps, ps + 1] + [rng.randint(1, 12 * ps) for _ in range(n - 3)]
    free = list(range(pages))
    rng.shuffle(free)
    tables = []
    for c in ctx:
        tables.append([free.pop() for _ in range(-(-c // ps))])
    # the step's queries as the model hands them: a strided view of [1, H, T, D]
    q = torch.randn(1, kvh * g, n + 5, D, generator=gen).to(dtype)[0].transpose(0, 1)[:n]
    flat = torch.tensor([p for t in tables for p in t])
    offsets = torch.tensor([0, *torch.cumsum(torch.tensor([len(t) for t in tables]), 0).tolist()])
    return q, kc, vc, tables, flat, offsets, torch.tensor(ctx)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
# 48: read at run time; (128, 1, 4): more query heads than the vector path holds on registers at once
@pytest.mark.parametrize("D,kvh,g", [(64, 3, 3), (128, 2, 1), (32, 1, 4), (256, 1, 2), (48, 2, 2), (128, 1, 4)])
@pytest.mark.parametrize("extra", ["plain", "window", "softcap", "sinks"])
# 12 sequences (at two threads): on AMD's vector paths, a work item a sequence (its kv heads page
# by page); 3: an item a kv head (too few sequences to share between the threads item by item)
@pytest.mark.parametrize("n", [12, 3])
def test_kernel_matches_dense_attention(dtype, D, kvh, g, extra, n):
    q, kc, vc, tables, flat, offsets, ctx = _case(dtype, D, kvh, g, seed=D + g, n=n)
    kw = {"plain": {}, "window": {"window": 37}, "softcap": {"softcap": 4.0},
          "sinks": {"sinks": torch.randn(kvh * g, generator=torch.Generator().manual_seed(1))}}[extra]
    scale = D**-0.5
    ref = _dense(q, kc, vc, tables, ctx.tolist(), scale, **kw)
    got = native.paged_decode(q, kc, vc, flat, offsets, ctx, scale, kw.get("window"), kw.get("softcap"), kw.get("sinks"))
    assert got.dtype == dtype and got.shape == ref.shape
    assert (got.double() - ref).abs().max().item() < TOL[dtype]


def test_kernel_reads_only_each_sequences_own_slots():
    """Slots past a sequence's context, and pages it does not hold, are never read: filling
    them with inf/nan changes nothing."""
    q, kc, vc, tables, flat, offsets, ctx = _case(torch.float32, 64, 3, 3, seed=5)
    before = native.paged_decode(q, kc, vc, flat, offsets, ctx, 0.125, None, None, None)
    held = set(flat.tolist())
    for p in range(kc.shape[0]):
        if p not in held:
            kc[p], vc[p] = float("nan"), float("inf")
    for t, c in zip(tables, ctx.tolist()):
        last, used = t[-1], c - (len(t) - 1) * kc.shape[2]
        kc[last, :, used:], vc[last, :, used:] = float("nan"), float("inf")
    after = native.paged_decode(q, kc, vc, flat, offsets, ctx, 0.125, None, None, None)
    assert torch.equal(before, after)


def _prefill_case(dtype, D, kvh, g, seed, ps=16, pages=400):
    """Chunks as a step holds them: fresh prompts (start 0), chunks continuing a cached prefix,
    one-token chunks, lengths that are no multiple of anything, contexts past one block of the AMX
    kernel's 256 keys (its softmax corrected across blocks); scattered page tables."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    kc = torch.randn(pages, kvh, ps, D, generator=gen).to(dtype)
    vc = torch.randn(pages, kvh, ps, D, generator=gen).to(dtype)
    chunks = [(0, 1), (0, 37), (5, 1), (16, 16), (131, 70), (0, 200), (300, 41), (0, 530),
              (rng.randint(1, 90), rng.randint(1, 90))]
    free = list(range(pages))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(-(-(s + n) // ps))] for s, n in chunks]
    T = sum(n for _, n in chunks)
    q = torch.randn(1, kvh * g, T + 3, D, generator=gen).to(dtype)[0].transpose(0, 1)[:T]  # strided, as handed over
    flat = torch.tensor([p for t in tables for p in t])
    offsets = torch.tensor([0, *torch.cumsum(torch.tensor([len(t) for t in tables]), 0).tolist()])
    starts, lens = torch.tensor([s for s, _ in chunks]), torch.tensor([n for _, n in chunks])
    return q, kc, vc, tables, flat, offsets, starts, lens


def _dense_prefill(q, kc, vc, tables, starts, lens, scale, window=None, sinks=None) -> torch.Tensor:
    """Each chunk's rows against its sequence's slots up to their own positions, in float64."""
    H, D = q.shape[1], q.shape[2]
    kvh = kc.shape[1]
    out, row = [], 0
    for pages, s, n in zip(tables, starts.tolist(), lens.tolist()):
        ctx = s + n
        k = kc[pages].transpose(0, 1).reshape(kvh, -1, D)[:, :ctx].double().repeat_interleave(H // kvh, 0)
        v = vc[pages].transpose(0, 1).reshape(kvh, -1, D)[:, :ctx].double().repeat_interleave(H // kvh, 0)
        sc = torch.einsum("thd,hkd->htk", q[row:row + n].double(), k) * scale
        qp, kp = torch.arange(s, ctx)[:, None], torch.arange(ctx)[None]
        mask = kp <= qp
        if window:
            mask &= kp > qp - window
        sc = sc.masked_fill(~mask, float("-inf"))
        if sinks is not None:
            sc = torch.cat([sc, sinks.double()[:, None, None].expand(H, n, 1)], -1)
        p = torch.softmax(sc, -1)[..., :ctx]
        out.append(torch.einsum("htk,hkd->thd", p, v))
        row += n
    return torch.cat(out)


prefill = pytest.mark.skipif(not native.prefill_usable(torch.device("cpu"), torch.float32, 64),
                             reason="the prefill kernel needs AVX-512 or AVX2 (SDPA serves prefills here)")


@prefill
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("D,kvh,g", [(64, 3, 3), (128, 2, 1), (64, 1, 8), (32, 4, 2), (256, 1, 2)])
@pytest.mark.parametrize("extra", ["plain", "window", "wide window", "sinks"])
def test_prefill_kernel_matches_dense_attention(dtype, D, kvh, g, extra):
    q, kc, vc, tables, flat, offsets, starts, lens = _prefill_case(dtype, D, kvh, g, seed=D + g)
    kw = {"plain": {}, "window": {"window": 29}, "wide window": {"window": 300}, "sinks": {"sinks": torch.randn(kvh * g, generator=torch.Generator().manual_seed(1))}}[extra]
    scale = D**-0.5
    ref = _dense_prefill(q, kc, vc, tables, starts, lens, scale, **kw)
    got = native.paged_prefill(q, kc, vc, flat, offsets, starts, lens, scale, kw.get("window"), kw.get("sinks"))
    assert got.dtype == dtype and got.shape == ref.shape
    assert (got.double() - ref).abs().max().item() < TOL[dtype]


@prefill
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # bf16: tile products where the CPU has AMX
def test_prefill_kernel_reads_only_each_chunks_own_slots(dtype):
    """Slots past a chunk's last position, and pages its sequence does not hold, are never read."""
    q, kc, vc, tables, flat, offsets, starts, lens = _prefill_case(dtype, 64, 3, 3, seed=6)
    before = native.paged_prefill(q, kc, vc, flat, offsets, starts, lens, 0.125, None, None)
    held = set(flat.tolist())
    for p in range(kc.shape[0]):
        if p not in held:
            kc[p], vc[p] = float("nan"), float("inf")
    for t, c in zip(tables, (starts + lens).tolist()):
        last, used = t[-1], c - (len(t) - 1) * kc.shape[2]
        kc[last, :, used:], vc[last, :, used:] = float("nan"), float("inf")
    after = native.paged_prefill(q, kc, vc, flat, offsets, starts, lens, 0.125, None, None)
    assert torch.equal(before, after)
    with pytest.raises(RuntimeError, match="does not cover"):
        native.paged_prefill(q, kc, vc, flat, offsets, starts, lens + 16, 0.125, None, None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_puts_each_token_in_its_slot(dtype):
    g = torch.Generator().manual_seed(2)
    kc, vc = (torch.randn(12, 3, 4, 16, generator=g).to(dtype) for _ in range(2))
    want_k, want_v = kc.clone(), vc.clone()
    slots = random.Random(1).sample(range(12 * 4), 20)  # distinct slots anywhere in the pool
    pages, offs = torch.tensor([s // 4 for s in slots]), torch.tensor([s % 4 for s in slots])
    kv = torch.randn(20, 2, 3, 16, generator=g).to(dtype)  # k and v as views of one tensor: strided
    k, v = kv[:, 0], kv[:, 1]
    want_k[pages, :, offs] = k
    want_v[pages, :, offs] = v
    native.write_kv(k, v, kc, vc, pages, offs)
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v)
    with pytest.raises(RuntimeError, match="out of the pool"):
        native.write_kv(k[:1], v[:1], kc, vc, torch.tensor([12]), torch.tensor([0]))


def test_engine_decodes_natively_on_the_fast_path_only():
    model = tiny_model("llama", dtype=torch.float32, seed=3)
    assert make_engine(model, num_pages=64).runner.native_decode
    assert not make_engine(model, num_pages=64, fast_path=False).runner.native_decode
    assert not make_engine(tiny_model("llama", dtype=torch.float64, seed=3), num_pages=64).runner.native_decode


def test_turned_off_it_says_why_and_the_torch_path_runs(monkeypatch, caplog):
    monkeypatch.setattr(native, "_loaded", set())
    monkeypatch.setattr(native, "_error", None)
    monkeypatch.setenv("TOKENQ_NATIVE", "0")
    with caplog.at_level(logging.INFO, logger="tokenq.native"):
        assert not native.usable(torch.device("cpu"), torch.float32)
    assert "TOKENQ_NATIVE=0" in native.error()
    assert "TOKENQ_NATIVE=0" in caplog.text
    model = tiny_model("llama", dtype=torch.float32, seed=3)
    engine = make_engine(model, num_pages=64)
    assert not engine.runner.native_decode
    from common.protocol import SamplingParams
    out = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert len(out[0]) == 4


def test_a_build_killed_midway_does_not_block_the_next_start():
    """torch's extension builder waits without end for its ``lock`` file to go; one left by a
    killed build must not hang the next start (worker/native.py's build lock removes it)."""
    import contextlib
    import fcntl
    import subprocess
    import sys
    from pathlib import Path

    build_dir = Path(native.build_directory(native.STEPS))
    stale = build_dir / "lock"

    @contextlib.contextmanager
    def no_build_running():
        # torch's builder writes ``lock`` on every load, even one that finds the build current, and
        # the other pytest process loads the kernels too: holding the builders' flock (what
        # worker/native.py takes first) means a ``lock`` seen here is not a live one
        with open(build_dir / "tokenq.flock", "w") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            yield

    with no_build_running():
        stale.touch()
    root = Path(__file__).resolve().parent.parent
    done = subprocess.run([sys.executable, "-c", "from worker import native; print(native.load() is not None)"],
                          cwd=root, capture_output=True, text=True, timeout=300)
    assert done.stdout.strip() == "True", done.stderr[-2000:]
    with no_build_running():
        assert not stale.exists()


def test_a_process_with_another_path_loads_the_build_without_rebuilding():
    """A process started without the virtual environment's bin on PATH (a system ninja first,
    of another version) must load the kernels built by one started with it, not build them
    again (worker/native.py: the ``ninja`` package's binary builds, whatever PATH says)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    assert native.load() is not None
    libs = [Path(native.build_directory(name)) / f"{native._name(name)}.so" for name in native.LIBRARIES]
    before = [lib.stat().st_mtime_ns for lib in libs]
    root = Path(__file__).resolve().parent.parent
    for path in ("/usr/bin:/bin", str(Path(sys.executable).parent) + os.pathsep + "/usr/bin:/bin"):
        done = subprocess.run([sys.executable, "-c", "from worker import native; print(native.load() is not None)"],
                              cwd=root, capture_output=True, text=True, timeout=300, env={**os.environ, "PATH": path})
        assert done.stdout.strip() == "True", done.stderr[-2000:]
    assert [lib.stat().st_mtime_ns for lib in libs] == before


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_gemm_serves_every_row_count(dtype):
    """worker/csrc/packed_gemm.cpp packs a weight once (float32: in panels for AVX-512 up to 128
    rows on Intel, 32 on AMD Zen 4 (128 for a weight oneDNN would split unevenly), 128 on Zen 5,
    and for MKL (told 64 rows) or oneDNN past them;
    without AVX-512 in panels for AVX2 up to 192 rows and for MKL past them;
    bf16: in AMX tiles up to 128 rows, or without AMX in key pairs for AVX512-BF16 up to 64 (Zen
    5, and a weight oneDNN would split unevenly: 128), and for oneDNN past them (Intel: up to 12,
    and past them widened to float32 for the float32 kernels); with neither, widened to float32
    for the float32 kernels);
    the compiled forward runs it at every step's row count, so each must give x @ w.T as closely
    as F.linear does. Shapes whose sizes are not multiples of 32 (bf16: oneDNN's alone) are
    served too."""
    if not native.packed_gemm_usable(dtype):
        pytest.skip(f"no packed {dtype} kernel here (float32: AVX-512 or MKL; bf16: those, widened)")
    gen = torch.Generator().manual_seed(0)
    for K, N in ((64, 96), (576, 960), (1536, 576), (100, 72)):
        w = torch.randn(N, K, generator=gen).to(dtype)
        handle = native.gemm_pack(w)
        try:
            for M in (0, 1, 2, 7, 12, 13, 16, 17, 24, 25, 32, 33, 63, 64, 65, 128, 129, 192, 193, 300, 2048):
                x = torch.randn(M, K, generator=gen).to(dtype)
                y = torch.ops.tokenq_native.gemm_packed(x, handle)
                want = x.double() @ w.double().T
                assert y.shape == (M, N) and y.dtype == dtype
                if M:  # sums of K products: within F.linear's own distance of float64
                    lin = torch.nn.functional.linear(x, w)
                    near = (lin.double() - want).abs().max().item()
                    assert (y.double() - want).abs().max().item() <= max(2 * near, 1e-5 * K ** 0.5)
                    if dtype == torch.bfloat16:  # the same float32 sums rounded once: few outputs differ
                        assert (y != lin).float().mean().item() < 0.01
            # a strided view is read as its values
            x = torch.randn(K, 9, generator=gen).T.to(dtype)
            rtol = 1.6e-2 if dtype == torch.bfloat16 else 1e-5  # bf16: a rounding apart at most
            torch.testing.assert_close(torch.ops.tokenq_native.gemm_packed(x, handle), x @ w.T, rtol=rtol, atol=1e-4)
        finally:
            native.gemm_release(handle)
        with pytest.raises(RuntimeError, match="no packed weight"):
            torch.ops.tokenq_native.gemm_packed(torch.randn(2, K).to(dtype), handle)
    handle = native.gemm_pack(torch.randn(8, 16).to(dtype))
    with pytest.raises(RuntimeError, match=r"x must be \[M, 16\]"):
        torch.ops.tokenq_native.gemm_packed(torch.randn(2, 17).to(dtype), handle)
    with pytest.raises(RuntimeError, match=r"x must be \[M, 16\]"):  # another dtype
        torch.ops.tokenq_native.gemm_packed(torch.randn(2, 16).to(torch.float16), handle)
    native.gemm_release(handle)


def _anon_huge_kib() -> int:
    for line in open("/proc/self/smaps_rollup"):
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return 0


@pytest.mark.skipif(thp_mode() not in ("madvise", "always"), reason="no transparent huge pages here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_copies_lie_on_huge_pages(dtype):
    """A decode step streams every packed weight once, in order; the panels' and the AMX tiles'
    copies are carved from chunks advised as huge pages (worker/csrc/packed_gemm.cpp,
    empty_on_huge_pages), which Linux grants on request in its 'madvise' mode: 32 MB packed
    brings at least 16 MB of them. (MKL's and oneDNN's copies stay on 4 KiB pages.)"""
    kernel = native.packed_gemm_kernel(dtype)
    if "vectors" not in kernel and "tiles" not in kernel:
        pytest.skip(f"{kernel}: not on huge pages")
    K = 1024 if dtype == torch.float32 else 2048
    w = torch.randn(8192, K).to(dtype)  # 32 MiB
    before = _anon_huge_kib()
    handle = native.gemm_pack(w)
    try:
        assert _anon_huge_kib() - before >= 16 * 1024
        x = torch.randn(3, K).to(dtype)
        rtol = 1.6e-2 if dtype == torch.bfloat16 else 1e-5
        torch.testing.assert_close(torch.ops.tokenq_native.gemm_packed(x, handle), x @ w.T, rtol=rtol, atol=1e-3)
    finally:
        native.gemm_release(handle)


def test_float32_panels_give_a_row_the_sums_it_gets_alone():
    """float32 rows up to 32 go to the vector panels on every CPU with AVX-512 or AVX2 (worker/
    csrc/packed_gemm.cpp). Past 12 rows (AVX2: 6) a panel takes several passes, and they go over
    the keys a block of 128 at a time, each keeping its sums between blocks: a row's sums must
    still be the ones it gets in a batch of one (the same products in the same order), bit for
    bit, so that a sequence's greedy tokens do not depend on what else is in its decode step."""
    kernel = native.packed_gemm_kernel(torch.float32) if native.packed_gemm_usable(torch.float32) else ""
    if not kernel.startswith(("AVX-512", "AVX2")):
        pytest.skip("no float32 vector panels here")
    gen = torch.Generator().manual_seed(1)
    for K, N in ((576, 960), (1536, 576), (100, 64)):  # 4.5 blocks of keys, 12, one
        w = torch.randn(N, K, generator=gen)
        handle = native.gemm_pack(w)
        try:
            for M in (13, 24, 25, 32):  # 2 and 3 passes
                x = torch.randn(M, K, generator=gen)
                y = torch.ops.tokenq_native.gemm_packed(x, handle)
                alone = torch.cat([torch.ops.tokenq_native.gemm_packed(x[i:i + 1], handle) for i in range(M)])
                assert torch.equal(y, alone), (K, M)
        finally:
            native.gemm_release(handle)


def test_a_weight_onednn_would_split_unevenly_keeps_the_panels_to_128_rows():
    """Where the rows past the float32 panels' go to oneDNN (AMD with AVX-512: past 32 rows),
    oneDNN would split a weight's columns between the threads in blocks of 64; a weight whose
    blocks do not divide evenly among them (SmolLM2's 576 and 960 columns on two threads) keeps
    the panels to 128 rows (worker/csrc/packed_gemm.cpp, kPanelRowsUneven). Elsewhere the panels
    take 128 rows or more anyway. Seen by the panels' mark: each row's sums are the ones it gets
    alone, bit for bit, where oneDNN's differ (most outputs, at 129 rows)."""
    kernel = native.packed_gemm_kernel(torch.float32) if native.packed_gemm_usable(torch.float32) else ""
    if not kernel.startswith(("AVX-512", "AVX2")):
        pytest.skip("no float32 vector panels here")
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # the suite runs on one thread, where every split is even
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(960, 576, generator=gen)  # 15 blocks: 8 and 7
    handle = native.gemm_pack(w)
    try:
        for M in (33, 64, 100, 128):
            x = torch.randn(M, 576, generator=gen)
            y = torch.ops.tokenq_native.gemm_packed(x, handle)
            alone = torch.cat([torch.ops.tokenq_native.gemm_packed(x[i:i + 1], handle) for i in range(M)])
            assert torch.equal(y, alone), M
    finally:
        native.gemm_release(handle)
        torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_picks_are_torchs(dtype):
    """argmax_rows (worker/csrc/greedy.cpp) answers what max(dim).indices does, on the rows
    where the two could part: ties (the first), -inf rows, NaN (the first), row ends that do
    not fill a vector, one column."""
    if not native.argmax_usable(torch.empty(0, 1, dtype=dtype)):
        pytest.skip("no vector build here: the sampler keeps torch's max")
    gen = torch.Generator().manual_seed(0)
    for n in (1, 15, 16, 17, 33, 1000, 49152):
        x = torch.randint(-4, 4, (40, n), generator=gen).to(dtype)  # small integers: many ties
        x[1] = float("-inf")
        x[2, n // 2] = float("nan")
        x[3, -1], x[3, 0] = float("nan"), float("inf")
        x[4] = torch.randn(n, generator=gen).to(dtype)
        got = native.argmax_rows(x)
        assert got.dtype == torch.long and torch.equal(got, x.max(dim=-1).indices), n
        finite = torch.arange(40) >= 4
        assert torch.equal(got[finite], x[finite].float().argmax(-1))
    # a strided view is read as its values
    x = torch.randn(64, 300, generator=gen).to(dtype).T
    assert torch.equal(native.argmax_rows(x), x.max(dim=-1).indices)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_is_silu_times_up(dtype):
    """silu_mul (worker/csrc/activations.cpp, the compiled graph's SiLU times up) against torch's
    SiLU in float32, as Inductor's loop computes it (not rounded before the product): float32
    within a few ulp (its own exp and reciprocal), bf16 within its rounding; row ends that do not
    fill a vector, one row, saturated and infinite gates, NaN."""
    gen = torch.Generator().manual_seed(0)
    for rows, inter in ((1, 1), (2, 17), (3, 37), (64, 1536), (600, 48)):
        x = (torch.randn(rows, 2 * inter, generator=gen) * 6).to(dtype)
        x[0, 0] = 100.0
        if inter > 5:
            x[0, 1:6] = torch.tensor([-100.0, 0.0, float("inf"), float("-inf"), float("nan")])
        got = native.silu_mul(x)
        g, u = x.float().chunk(2, dim=-1)
        want = (torch.nn.functional.silu(g) * u).to(dtype)
        assert got.dtype == dtype and got.shape == want.shape
        tol = {torch.float32: 1e-6, torch.bfloat16: 2**-7}[dtype]
        torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=1e-30, equal_nan=True)
    # a strided view (the merged projection's output sliced) is read as its values
    x = torch.randn(8, 96, generator=gen).to(dtype)[:, :64]
    torch.testing.assert_close(native.silu_mul(x), native.silu_mul(x.contiguous()), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_engines_prefill_rule_is_the_kernels_own(dtype):
    """The engine decides whether prefills go to the kernel (native.prefill_usable, read off the
    compiler's macros before the kernel is built); the kernel checks its own rule
    (paged_attention.cpp's prefill_supported): the two agree on every head size."""
    for D in (16, 32, 48, 64, 96, 128, 256):
        q, kc, vc, tables, flat, offsets, starts, lens = _prefill_case(dtype, D, 2, 2, seed=D, pages=120)
        served = native.prefill_usable(torch.device("cpu"), dtype, D)
        try:
            native.paged_prefill(q, kc, vc, flat, offsets, starts, lens, D**-0.5, None, None)
            ran = True
        except RuntimeError as e:
            assert "paged_prefill: float32 or bf16" in str(e)
            ran = False
        assert ran == served, (dtype, D)


def test_the_background_builds_import_nothing():
    """tokenq-worker starts the builds (native.build_in_background) and goes on importing
    transformers: a build thread importing at the same time deadlocked on Python's import locks
    once, and the worker died with a partly initialised module. Whatever the builds import is
    imported before their threads start."""
    import subprocess
    import sys
    from pathlib import Path

    code = """
import sys, threading
seen = []
class Spy:
    def find_spec(self, name, path=None, target=None):
        if threading.current_thread().name.startswith("native-build"):
            seen.append((threading.current_thread().name, name))
        return None
import torch
from worker import native
sys.meta_path.insert(0, Spy())
native.build_in_background()
for t in [t for t in threading.enumerate() if t.name.startswith("native-build")]:
    t.join()
assert native.load() is not None, native.error()
print("imports in build threads:", seen)
"""
    root = Path(__file__).resolve().parent.parent
    done = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "imports in build threads: []", done.stdout
