"""The engine's native CPU kernels: paged attention (worker/csrc/paged_attention.cpp), the
compiled forward's packed linears (worker/csrc/packed_gemm.cpp: MKL, AMX tiles, AVX-512
panels) and the sampler's greedy picks (worker/csrc/greedy.cpp).

Decode attention is a few tiny products per page and sequence; through torch ops that is
hundreds of small bmm calls and a segmented softmax a layer, and in bfloat16 (whose small
bmms have no fast kernel on CPU) it was a third of a SmolLM2 decode step. The decode kernel
reads each sequence's pages in place, once, with an online softmax in float32.

Prefill chunks went through SDPA, one call per chunk and layer (at about 80 GFLOP/s on two
cores, a fifth of a 2048-token SmolLM2 step), with a chunk that continues a cached prefix
first gathering its pages into a copy. The prefill kernel (AVX-512 or AVX2, float32 and bf16,
head sizes 32 to 256) takes every chunk of the step in one call, reads keys and values from the
pool in place and runs at about 240 GFLOP/s with AVX-512 (60 with AVX2 on an AMD EPYC, where
SDPA reached 42); elsewhere SDPA stays. In bfloat16 on a CPU with AMX the kernel runs both
products as AMX tile products (prefill_amx): 400 GFLOP/s on SmolLM2's chunks, where torch's
SDPA (AMX too, each chunk gathered out of the pool first) reached 230 and the vector loops 140;
with AVX512-BF16 alone as dot products of bf16 pairs (186-204 GFLOP/s on an AMD EPYC, against
122-130 converting to float32).

It is compiled on first use with the machine's own compiler (``-march=native``; 15-20 s,
which ``tokenq-worker`` spends while the model loads) as a library of torch ops
(``torch.ops.tokenq_native``), and cached by torch's extension builder (``TORCH_EXTENSIONS_DIR``, default
``~/.cache/torch_extensions``), keyed by the source and this CPU's instruction sets, so a
restart loads it at once. Where it cannot be built (no compiler, not on CPU), the engine
keeps the torch path (worker/attention.py) and says so in one log line.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import platform
import threading
from pathlib import Path

import torch

log = logging.getLogger("tokenq.native")

# paged attention, the compiled forward's packed linears (MKL, AMX tiles, AVX-512 panels), greedy picks
SOURCES = [Path(__file__).with_name("csrc") / name for name in ("paged_attention.cpp", "packed_gemm.cpp", "greedy.cpp")]
HEADERS = [Path(__file__).with_name("csrc") / "amx.h"]  # part of the build's key, not compiled alone
DTYPES = (torch.float32, torch.bfloat16, torch.float16)

_lock = threading.Lock()
_module = None
_error: str | None = None


def _cpuinfo(field: str) -> str | None:
    """The first ``field`` line of /proc/cpuinfo (None where there is none: not Linux)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(field):
                return line
    except OSError:
        pass
    return None


def _cpu_key() -> str:
    """The CPU's instruction-set flags (the build is -march=native: another CPU needs its own)."""
    return _cpuinfo("flags") or platform.processor() or platform.machine()


def _name() -> str:
    sources = b"".join(path.read_bytes() for path in SOURCES + HEADERS)
    key = hashlib.sha1(sources + _cpu_key().encode() + torch.__version__.encode()).hexdigest()[:12]
    return f"tokenq_native_{key}"


def build_directory() -> str:
    """Where torch's extension builder keeps this source's build for this CPU (created if missing)."""
    from torch.utils import cpp_extension

    return cpp_extension._get_build_directory(_name(), False)


@contextlib.contextmanager
def _build_lock(build_dir: str):
    """Held around torch's extension build. torch marks a build in progress with a plain
    ``lock`` file and waits, without end, while it exists; a process killed during the build
    (a worker stopped in its first start, while the kernels build beside the model load) leaves
    it behind, and every later start hung there. This lock is an flock, which the OS releases
    when its holder dies: every builder takes it first, so whoever holds it knows that a
    ``lock`` file it finds is stale, and removes it."""
    with open(os.path.join(build_dir, "tokenq.flock"), "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        stale = os.path.join(build_dir, "lock")
        if os.path.exists(stale):
            log.warning("native kernels: removing %s, left by a build that did not finish", stale)
            os.remove(stale)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@contextlib.contextmanager
def _our_ninja():
    """Torch's builder runs whichever ``ninja`` comes first on PATH, and ninja rebuilds everything
    when the build log was written by another version (1.11 and 1.13 hash commands differently):
    processes started with the virtual environment's bin on PATH and processes started without it
    (a system ninja first) rebuilt the kernels in turn, 25-45 s each time, while every engine
    start waited on the build lock. The ``ninja`` package (a dependency) is put first for the
    build, so every process uses the same one."""
    try:
        import ninja

        first = ninja.BIN_DIR
    except (ImportError, AttributeError):  # no package: whatever PATH finds, as torch would
        yield
        return
    path = os.environ.get("PATH", "")
    os.environ["PATH"] = first + os.pathsep + path
    try:
        yield
    finally:
        os.environ["PATH"] = path


def load():
    """The compiled module (None when it cannot be built here; ``error()`` says why)."""
    global _module, _error
    with _lock:
        if _module is None and _error is None:
            if os.environ.get("TOKENQ_NATIVE", "1") == "0":
                _error = "turned off (TOKENQ_NATIVE=0)"
                log.info("native decode attention %s: the torch path runs", _error)
                return None
            try:
                from torch.utils import cpp_extension

                name, build_dir = _name(), build_directory()
                with _build_lock(build_dir), _our_ninja():
                    # a library of torch ops (torch.ops.tokenq_native), not a Python module: see
                    # the source's end
                    cpp_extension.load(
                        name=name,
                        sources=[str(path) for path in SOURCES],
                        extra_cflags=["-O3", "-march=native", "-fopenmp"],
                        extra_ldflags=["-fopenmp"],
                        build_directory=build_dir,
                        is_python_module=False,
                        verbose=False,
                    )
                _module = torch.ops.tokenq_native
            except Exception as e:  # noqa: BLE001 - no compiler, no headers, a build error: the torch path
                _error = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else e}"
                log.warning("native decode attention unavailable (%s): the torch path runs", _error)
    return _module


def error() -> str | None:
    return _error


def usable(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the kernel serves decode attention for a pool on ``device`` in ``dtype``."""
    return device.type == "cpu" and dtype in DTYPES and load() is not None


def paged_decode(q, kc, vc, tables, offsets, ctx, scale: float, window: int | None, softcap: float | None,
                 sinks: torch.Tensor | None) -> torch.Tensor:
    """q [n, H, D] -> [n, H, D]; see worker/csrc/paged_attention.cpp."""
    return _module.paged_decode(q, kc, vc, tables, offsets, ctx, float(scale), int(window or 0), float(softcap or 0.0),
                                sinks if sinks is not None else _EMPTY)


def prefill_usable(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether the prefill kernel serves a pool on ``device`` in ``dtype`` with this head size."""
    return usable(device, dtype) and _module.prefill_supported(dtype, head_dim)


def paged_prefill(q, kc, vc, tables, offsets, starts, lens, scale: float, window: int | None,
                  sinks: torch.Tensor | None) -> torch.Tensor:
    """q [T, H, D] (the step's prefill chunks) -> [T, H, D]; see worker/csrc/paged_attention.cpp."""
    return _module.paged_prefill(q, kc, vc, tables, offsets, starts, lens, float(scale), int(window or 0),
                                 sinks if sinks is not None else _EMPTY)


def set_step(meta, scales: list[float], windows: list[int]) -> None:
    """The step (a worker.attention.StepMeta with the native tables) that the compiled graph's
    ``tokenq_native::attend`` calls in this thread serve, with each layer's scale and window."""
    dec = meta.dec_tables if meta.dec_tables is not None else (_EMPTY_LONG,) * 3
    pre = meta.pre_tables if meta.pre_tables is not None else (_EMPTY_LONG,) * 4
    _module.set_step(meta.k, meta.v, meta.write_pages, meta.write_offs, meta.n_dec, *dec, *pre, scales, windows)


def clear_step() -> None:
    _module.clear_step()


def write_kv(k, v, kc, vc, pages, offs) -> None:
    """k, v [T, kv_heads, D] into kc, vc [pages, kv_heads, page_size, D] at (pages[t], offs[t])."""
    _module.write_kv(k, v, kc, vc, pages, offs)


_EMPTY = torch.empty(0)
_EMPTY_LONG = torch.empty(0, dtype=torch.long)


def packed_gemm_usable(dtype: torch.dtype) -> bool:
    """Whether linears in ``dtype`` can run through weights packed here (worker/csrc/packed_gemm.cpp):
    float32 through MKL's packed SGEMM (a torch with MKL) or AVX-512 vector panels (an AMD CPU),
    bf16 on AMX tiles (a CPU with AMX) or AVX512-BF16 dot products (one without)."""
    return load() is not None and bool(_module.gemm_supported(dtype))


MKL = "MKL's packed SGEMM"  # packed_gemm_kernel's name for it


def packed_gemm_kernel(dtype: torch.dtype) -> str:
    """Which kernel serves packed linears in ``dtype`` here, in words (the engine's log line)."""
    return _module.gemm_kernel(dtype) if load() is not None else "none"


def packed_gemm_preferred(dtype: torch.dtype) -> bool:
    """Whether linears in ``dtype`` should take the packed kernels here: bf16 wherever AMX or
    AVX512-BF16 is, float32 on an AMD CPU with AVX-512 (decode steps' linears overlap reading their
    weights with their products there, oneDNN's did not: worker/csrc/packed_gemm.cpp), and
    float32 where MKL serves and the CPU is Intel's. At decode row counts (SmolLM2's shapes, 2
    threads) MKL beat oneDNN's packed linears on an Intel Xeon (AVX-512: decode steps 6-15%
    faster) and lost on an AMD EPYC (AVX2: decode steps at 64 / 16 / 1 sequences 220 / 114 / 63
    ms against oneDNN's 193 / 76 / 39; MKL's kernels there ran no faster than its unpacked SGEMM)."""
    if dtype == torch.bfloat16:
        return packed_gemm_usable(dtype)
    if dtype != torch.float32 or not packed_gemm_usable(dtype):
        return False
    return packed_gemm_kernel(dtype) != MKL or "GenuineIntel" in (_cpuinfo("vendor_id") or "")


def argmax_usable(logits: torch.Tensor) -> bool:
    """Whether ``argmax_rows`` serves these logits (on a CPU, float32 or bf16, vector build).
    Asked every step: the answer is kept per dtype."""
    if logits.device.type != "cpu" or load() is None:
        return False
    ok = _argmax_dtypes.get(logits.dtype)
    if ok is None:
        ok = _argmax_dtypes[logits.dtype] = bool(_module.argmax_supported(logits.dtype))
    return ok


_argmax_dtypes: dict[torch.dtype, bool] = {}


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """Each row's first largest value's index (a row with a NaN: its first NaN), as
    ``logits.max(dim=-1).indices``; see worker/csrc/greedy.cpp."""
    return _module.argmax_rows(logits)


def gemm_pack(w: torch.Tensor) -> int:
    """A handle to ``w`` [N, K] (float32: for MKL; bf16: in AMX tiles and for oneDNN); free it
    with gemm_release. The graph calls ``torch.ops.tokenq_native.gemm_packed(x, handle)``."""
    return int(_module.gemm_pack(w))


def gemm_release(handle: int) -> None:
    if _module is not None:
        _module.gemm_release(handle)
