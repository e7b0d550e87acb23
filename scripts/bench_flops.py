"""The benchmark's compute yardstick: the machine's GEMM peak, measured in the same run, and
each system's model FLOP utilisation (MFU) against it.

MFU here counts only the model's linear layers (they are nearly all of its FLOPs at these
lengths): every token that goes through the layers costs ``2 * (linear weights of the
layers)`` FLOPs, every sampled token ``2 * (LM head weights)`` more. A workload of prompts
``p_i`` and outputs ``o_i`` runs ``p_i + o_i - 1`` tokens through the layers (the last
output token is never fed back) and samples ``o_i`` tokens. Attention's own FLOPs are left
out, so MFU slightly understates the work done. MFU = those FLOPs / wall time / peak. A
float32 run's greedy picks screened in bf16 (worker/screened_head.py) are still counted as the
float32 head's FLOPs, the model's: the screen's saving shows as MFU.

The ceiling: MFU alone cannot say how far a system is from what the machine allows, because
decode attention is bound by memory, not arithmetic: each decode step reads every running
sequence's K and V, and over the benchmark's workload that is 37-137 GB (small and SmolLM2, in
bf16 and float32), seconds of the run. :func:`ceiling_s` is the time the workload would take
with every linear at the GEMM peak and every decode K/V read at the plain read rate, the two
one after the other (as the ops run) and everything else free (attention's arithmetic, prefill
attention, norms, sampling, the host). A system that runs its ops one after another cannot beat
it (short of a linear faster than the measured peak, as the screened head's bf16 GEMM is); the
table's "of ceiling" is a system's output tok/s over the ceiling's.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

# The peak GEMM: square enough to be compute-bound, the shape of a big prefill's MLP.
PEAK_SHAPE = (1024, 2048, 2048)  # M, K, N


def gemm_peak(dtype: torch.dtype, device: str = "cpu", seconds: float = 1.5) -> tuple[float, str]:
    """(GFLOP/s, how) of the best one GEMM reaches here: on CPU the better of oneDNN-prepacked
    and ``F.linear`` (MKL's SGEMM in float32), in the dtype the fast path packs ``dtype`` weights
    in, else ``F.linear``; the best of several timed rounds (the machine is shared). Both
    libraries count: on an AVX2 EPYC MKL's SGEMM ran this shape at 180 GFLOP/s where oneDNN's
    reached 150, and the engine sends a prefill's rows to MKL there (worker/csrc/packed_gemm.cpp).
    bf16 counts float32's too: on an Intel Xeon with AVX512-BF16 and no AMX bf16 ran this shape
    at 155-169 GFLOP/s and float32 at 255-319, and the engine widens bf16 past a decode step's
    fewest rows there."""
    from worker.fastpath import pack_dtype

    M, K, N = PEAK_SHAPE
    dev = torch.device(device)
    x = torch.randn(M, K, device=dev).to(dtype)
    w = torch.randn(N, K, device=dev).to(dtype)
    pack = pack_dtype(dtype, dev)
    as_ = f" as {pack}" if pack is not None and pack != dtype else ""
    candidates = {}
    if pack is not None:
        wp = torch.ops.mkldnn._reorder_linear_weight(w.to(pack), M)
        xp, wl = x.to(pack), w.to(pack)
        candidates["oneDNN prepacked" + as_] = lambda: torch.ops.mkldnn._linear_pointwise(xp, wp, None, "none", [], "")
        candidates["F.linear" + as_] = lambda: F.linear(xp, wl)
        if pack == torch.bfloat16 and dev.type == "cpu":  # where bf16 runs at half float32's rate the engine widens it
            x32, w32 = x.float(), w.float()
            candidates["F.linear as torch.float32"] = lambda: F.linear(x32, w32)
    else:
        candidates["F.linear"] = lambda: F.linear(x, w)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    threads = f"{torch.get_num_threads()} threads" if dev.type == "cpu" else str(dev)
    times = {}
    with torch.inference_mode():
        for how, fn in candidates.items():
            fn()
            sync()
            best, end = float("inf"), time.perf_counter() + seconds
            while time.perf_counter() < end:
                t = time.perf_counter()
                fn()
                sync()
                best = min(best, time.perf_counter() - t)
            times[how] = best
    how = min(times, key=times.get)
    return 2 * M * K * N / times[how] / 1e9, f"{how}, {M}x{K} by {K}x{N}, {threads}"


def read_mbytes(device: str = "cpu") -> int:
    """How many MB the plain read sums: 256, or on a CPU four times its last-level cache where
    that is more. A sum that fits the cache measures the cache: on an Intel Xeon reporting an L3
    of 300 MiB, 256 MB read at 52-60 GB/s and 1.2 GB at 31-32, the rate a decode step's weights
    and K/V (a GB or more each step) stream in at."""
    if torch.device(device).type != "cpu":
        return 256
    return max(256, 4 * last_level_cache_bytes() // 2**20)


def last_level_cache_bytes() -> int:
    """The size of the CPU's highest cache level as Linux reports it for cpu0 (0 where it does
    not: another OS, a VM that hides it)."""
    from pathlib import Path

    best = (0, 0)
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            level, size = int((index / "level").read_text()), (index / "size").read_text().strip()
        except (OSError, ValueError):
            continue
        unit = {"K": 2**10, "M": 2**20, "G": 2**30}.get(size[-1:], 1)
        digits = size.rstrip("KMG")
        if digits.isdigit():
            best = max(best, (level, int(digits) * unit))
    return best[1]


def read_bandwidth(device: str = "cpu", mbytes: int | None = None, seconds: float = 1.0) -> float:
    """GB/s of a plain read (a sum) of ``mbytes`` MB (:func:`read_mbytes`), the best of several
    rounds: the memory-side yardstick. A decode step reads every weight and the batch's K/V, so
    memory-bound steps move with it; on a shared machine it drifts (16.6 to 23.8 GB/s within one
    session here) while the GEMM peak stays put."""
    dev = torch.device(device)
    x = torch.ones((mbytes or read_mbytes(device)) * 2**20 // 4, device=dev)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    with torch.inference_mode():
        x.sum()
        sync()
        best, end = float("inf"), time.perf_counter() + seconds
        while time.perf_counter() < end:
            t = time.perf_counter()
            x.sum()
            sync()
            best = min(best, time.perf_counter() - t)
    return x.numel() * 4 / best / 1e9


def linear_weights(model) -> tuple[int, int]:
    """(weights in the layers' nn.Linear modules, weights of the LM head)."""
    head = model.get_output_embeddings()
    layers = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear) and m is not head)
    return layers, head.weight.numel()


def workload_flops(model, workload) -> float:
    """Linear-layer FLOPs of running ``workload`` ([(prompt ids, output length)]) on ``model``."""
    layers, head = linear_weights(model)
    fed = sum(len(p) + o - 1 for p, o in workload)
    sampled = sum(o for _, o in workload)
    return 2.0 * (layers * fed + head * sampled)


def mfu_cells(flops: float, wall_s: float, peak_gflops: float) -> tuple[str, str]:
    """The table's (achieved GFLOP/s, MFU) cells."""
    if not flops or not wall_s or not peak_gflops:
        return "—", "—"
    g = flops / wall_s / 1e9
    return f"{g:,.0f}", f"{g / peak_gflops:.0%}"


def workload_kv_bytes(model, workload) -> float:
    """Bytes of K/V the decode steps of ``workload`` read: output token k (k >= 1; the first
    comes from the prompt's step) of a p-token prompt is fed at position p + k - 1 and attends
    p + k slots, its own included (at most the window in a sliding-window layer)."""
    from worker.cache import KVCache, kv_heads_and_dim
    from worker.probe import expected_windows  # each layer's window, as the engine attends it

    c = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    num_kv, head_dim = kv_heads_and_dim(c)
    per = KVCache.bytes_per_page(num_layers=1, page_size=1, num_kv_heads=num_kv, head_dim=head_dim,
                                 dtype=next(model.parameters()).dtype)  # one token's K and V in a layer
    slots = 0
    for window in expected_windows(c, c.num_hidden_layers):
        for p, o in workload:
            slots += sum(min(len(p) + k, window) if window else len(p) + k for k in range(1, o))
    return float(per * slots)


def ceiling_s(flops: float, kv_bytes: float, peak_gflops: float, read_gbs: float) -> float:
    """The ceiling's wall time (see the module's docstring); 0 where a yardstick is missing."""
    if not peak_gflops or not read_gbs:
        return 0.0
    return flops / peak_gflops / 1e9 + kv_bytes / read_gbs / 1e9
