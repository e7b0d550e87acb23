"""The engine's native CPU kernels: paged attention (worker/csrc/paged_attention.cpp), the
compiled forward's packed linears (worker/csrc/packed_gemm.cpp: MKL, AMX tiles, AVX-512 and
AVX2 panels) and the sampler's greedy picks (worker/csrc/greedy.cpp).

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

They are compiled on first use with the machine's own compiler (``-march=native``; 30 s of
g++ in all) as two libraries of torch ops (``torch.ops.tokenq_native``, see LIBRARIES), which
``tokenq-worker`` builds in the background while the model loads and its graph compiles, and
cached by torch's extension builder (``TORCH_EXTENSIONS_DIR``, default
``~/.cache/torch_extensions``), keyed by the sources and this CPU's instruction sets, so a
restart loads them at once. Where they cannot be built (no compiler, not on CPU), the engine
keeps the torch path (worker/attention.py) and says so in one log line.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
import os
import platform
import subprocess
import threading
import time
from pathlib import Path

import torch

log = logging.getLogger("tokenq.native")

CSRC = Path(__file__).with_name("csrc")
# Two libraries, each built and cached on its own: the linears', which the compiled forward
# needs before it is traced (it packs the weights the graph names by handle), and the one steps
# run (paged attention, greedy picks, SiLU times up: 21 s of g++ on an AMD EPYC, paged_attention.cpp
# 14 s of it), which the compile does not wait for: the graph's ops from it are declared below, the
# graph is traced and compiled while that library builds (build_in_background), and its first
# step waits for it (worker/compiled.py). A first start on two cores spent 13 s waiting for
# the whole build with one core idle, then compiled on one core (the compile is one Python thread).
LINEARS, STEPS = "linears", "steps"
LIBRARIES = {  # name: (sources, headers: part of the build's key, not compiled alone)
    LINEARS: ([CSRC / "packed_gemm.cpp"], [CSRC / "amx.h"]),
    STEPS: ([CSRC / "paged_attention.cpp", CSRC / "greedy.cpp", CSRC / "activations.cpp"],
            [CSRC / "amx.h", CSRC / "exp.h"]),
}
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Built for this CPU: the sources pick their path (AVX-512, AVX2, portable) by the compiler's
# macros, so every path must compile (tests/test_native_sources.py builds each for other CPUs).
CFLAGS = ["-O3", "-march=native", "-fopenmp"]

_locks = {name: threading.Lock() for name in LIBRARIES}
_loaded: set[str] = set()  # libraries built and loaded in this process
_error: str | None = None  # why one could not be built (then neither is tried again)
_ops = torch.ops.tokenq_native  # the op namespace both libraries register into

# The compiled graph's ops from the steps' library (attention, SiLU times up), declared here rather
# than by it so that the graph can be traced before it is built; paged_attention.cpp and
# activations.cpp register their CPU kernels.
_lib = torch.library.Library("tokenq_native", "FRAGMENT")
_lib.define("attend(Tensor q, Tensor k, Tensor v, int layer) -> Tensor")
_lib.define("silu_mul(Tensor gate_up) -> Tensor")


@torch.library.register_fake("tokenq_native::attend", lib=_lib)
def _attend_fake(q, k, v, layer):
    return q.new_empty(q.shape[0], q.shape[1] * q.shape[2])


@torch.library.register_fake("tokenq_native::silu_mul", lib=_lib)
def _silu_mul_fake(gate_up):
    return gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)


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


def _name(library: str) -> str:
    sources, headers = LIBRARIES[library]
    text = b"".join(path.read_bytes() for path in sources + headers)
    key = hashlib.sha1(text + _cpu_key().encode() + torch.__version__.encode()).hexdigest()[:12]
    return f"tokenq_native_{library}_{key}"


def build_directory(library: str) -> str:
    """Where torch's extension builder keeps this library's build for this CPU (created if missing)."""
    from torch.utils import cpp_extension

    return cpp_extension._get_build_directory(_name(library), False)


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


_path_lock = threading.Lock()


def _our_ninja() -> None:
    """Torch's builder runs whichever ``ninja`` comes first on PATH, and ninja rebuilds everything
    when the build log was written by another version (1.11 and 1.13 hash commands differently):
    processes started with the virtual environment's bin on PATH and processes started without it
    (a system ninja first) rebuilt the kernels in turn, 25-45 s each time, while every engine
    start waited on the build lock. The ``ninja`` package (a dependency) is put first on PATH, so
    every process uses the same one. For good: the two libraries build at once in two threads,
    and one putting PATH back while the other's builder started ran the other ninja."""
    try:
        import ninja

        first = ninja.BIN_DIR
    except (ImportError, AttributeError):  # no package: whatever PATH finds, as torch would
        return
    with _path_lock:
        path = os.environ.get("PATH", "")
        if not path.startswith(first + os.pathsep):
            os.environ["PATH"] = first + os.pathsep + path


def _build(library: str) -> bool:
    """Build (or find built) and load one library; False, with ``_error`` set, where it cannot be."""
    global _error
    if library in _loaded:  # (asked every step, through argmax_usable: no lock then)
        return True
    with _locks[library]:
        if library in _loaded or _error is not None:
            return library in _loaded
        if os.environ.get("TOKENQ_NATIVE", "1") == "0":
            _error = "turned off (TOKENQ_NATIVE=0)"
            log.info("native kernels %s: the torch path runs", _error)
            return False
        try:
            from torch.utils import cpp_extension

            t = time.perf_counter()
            name, build_dir = _name(library), build_directory(library)
            _our_ninja()
            with _build_lock(build_dir):
                # a library of torch ops (torch.ops.tokenq_native), not a Python module: see
                # the sources' ends
                cpp_extension.load(
                    name=name,
                    sources=[str(path) for path in LIBRARIES[library][0]],
                    extra_cflags=CFLAGS,
                    extra_ldflags=["-fopenmp"],
                    build_directory=build_dir,
                    is_python_module=False,
                    verbose=False,
                )
            _loaded.add(library)
            log.info("native kernels: the %s library is ready (%.1f s)", library, time.perf_counter() - t)
        except Exception as e:  # noqa: BLE001 - no compiler, no headers, a build error: the torch path
            _error = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else e}"
            log.warning("native kernels unavailable (%s): the torch path runs", _error)
    return library in _loaded


def load_linears():
    """The op namespace once the linears' library (the packed linears and their queries) is
    loaded, building it if need be; None where it cannot be (``error()`` says why)."""
    return _ops if _build(LINEARS) else None


def load():
    """The op namespace once both libraries are loaded (None when they cannot be built here;
    ``error()`` says why)."""
    return _ops if _build(LINEARS) and _build(STEPS) else None


def build_in_background() -> None:
    """Start both builds, each in a thread of its own (``tokenq-worker``, at start): the linears'
    beside the model's load, the steps' below the process's priority (its compilers inherit
    the thread's nice), so that on two cores it takes only what the load and then the compile,
    one Python thread, leave idle."""
    # What the builds import, imported here, in the caller's thread: the builds' threads then
    # import nothing while the caller goes on importing (tokenq-worker: transformers). Two threads
    # importing at once deadlocked on Python's import locks once; Python then hands one of them
    # a partly initialised module, and the worker died ("cannot import name ... from partially
    # initialized module 'transformers'").
    from torch.utils import cpp_extension  # noqa: F401

    with contextlib.suppress(ImportError):
        import ninja  # noqa: F401

    def build(library: str, nice: int):
        if nice:
            with contextlib.suppress(OSError, AttributeError):  # (per thread: Linux)
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
        _build(library)

    for library, nice in ((LINEARS, 0), (STEPS, 10)):
        threading.Thread(target=build, args=(library, nice), name=f"native-build-{library}", daemon=True).start()


def error() -> str | None:
    return _error


def usable(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the kernels serve decode attention for a pool on ``device`` in ``dtype``. Asked of
    the linears' library: the steps' library, built by the same compiler from the same headers,
    may still be building (``load()`` waits for it; where it fails, the engine takes the torch path)."""
    return device.type == "cpu" and dtype in DTYPES and load_linears() is not None


def _attention():
    """The op namespace with the steps' library loaded (waiting for its build)."""
    if STEPS not in _loaded and load() is None:
        raise RuntimeError(f"the native kernels are not available: {_error}")
    return _ops


def paged_decode(q, kc, vc, tables, offsets, ctx, scale: float, window: int | None, softcap: float | None,
                 sinks: torch.Tensor | None) -> torch.Tensor:
    """q [n, H, D] -> [n, H, D]; see worker/csrc/paged_attention.cpp."""
    return _attention().paged_decode(q, kc, vc, tables, offsets, ctx, float(scale), int(window or 0), float(softcap or 0.0),
                                sinks if sinks is not None else _EMPTY)


def prefill_usable(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether the prefill kernel serves a pool on ``device`` in ``dtype`` with this head size:
    float32 or bf16, head sizes 32 to 256, compiled for AVX-512 or AVX2 with FMA (its ``#if``:
    paged_attention.cpp's ``prefill_supported``, which its op checks). Asked of the compiler's
    macros for ``-march=native`` (the build's own flags), so that the engine can choose before
    the steps' library is built."""
    if not usable(device, dtype) or dtype not in (torch.float32, torch.bfloat16) or head_dim not in (32, 64, 128, 256):
        return False
    macros = _compiler_macros()
    return "__AVX512F__" in macros or {"__AVX2__", "__FMA__"} <= macros


@functools.cache
def _compiler_macros() -> frozenset[str]:
    """The macros the builds' compiler (torch's: $CXX, else c++) predefines with -march=native."""
    try:
        done = subprocess.run([os.environ.get("CXX", "c++"), "-march=native", "-dM", "-E", "-x", "c++", os.devnull],
                              capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return frozenset()
    return frozenset(line.split()[1] for line in done.stdout.splitlines() if line.startswith("#define "))


def paged_prefill(q, kc, vc, tables, offsets, starts, lens, scale: float, window: int | None,
                  sinks: torch.Tensor | None) -> torch.Tensor:
    """q [T, H, D] (the step's prefill chunks) -> [T, H, D]; see worker/csrc/paged_attention.cpp."""
    return _attention().paged_prefill(q, kc, vc, tables, offsets, starts, lens, float(scale), int(window or 0),
                                 sinks if sinks is not None else _EMPTY)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up for gate_up [T, 2I] (gate, then up) -> [T, I]; see worker/csrc/activations.cpp."""
    return _attention().silu_mul(gate_up)


def silu_mul_vectorised() -> bool:
    """Whether silu_mul is built with AVX-512 (elsewhere it is a scalar loop, slower than the
    vector loop Inductor writes): asked of the compiler's macros, as prefill_usable is."""
    return "__AVX512F__" in _compiler_macros()


def set_step(meta, scales: list[float], windows: list[int]) -> None:
    """The step (a worker.attention.StepMeta with the native tables) that the compiled graph's
    ``tokenq_native::attend`` calls in this thread serve, with each layer's scale and window."""
    dec = meta.dec_tables if meta.dec_tables is not None else (_EMPTY_LONG,) * 3
    pre = meta.pre_tables if meta.pre_tables is not None else (_EMPTY_LONG,) * 4
    _attention().set_step(meta.k, meta.v, meta.write_pages, meta.write_offs, meta.n_dec, *dec, *pre, scales, windows)


def clear_step() -> None:
    _attention().clear_step()


def write_kv(k, v, kc, vc, pages, offs) -> None:
    """k, v [T, kv_heads, D] into kc, vc [pages, kv_heads, page_size, D] at (pages[t], offs[t])."""
    _attention().write_kv(k, v, kc, vc, pages, offs)


_EMPTY = torch.empty(0)
_EMPTY_LONG = torch.empty(0, dtype=torch.long)


def packed_gemm_usable(dtype: torch.dtype) -> bool:
    """Whether linears in ``dtype`` can run through weights packed here (worker/csrc/packed_gemm.cpp):
    float32 through AVX-512 vector panels at a decode step's fewest rows and MKL's packed SGEMM
    (Intel) or oneDNN (AMD) past them, without AVX-512 through AVX2 panels at decode rows and
    MKL's at prefill rows,
    bf16 on AMX tiles (a CPU with AMX) or AVX512-BF16 dot products (one without; on Intel only
    a decode step's fewest rows, more widened to float32, where those products run at half
    float32's rate), or with neither widened to float32 for the float32 kernels."""
    return load_linears() is not None and bool(_ops.gemm_supported(dtype))


MKL = "MKL's packed SGEMM"  # packed_gemm_kernel's name for it
WIDENED = "bf16 widened to float32"  # how packed_gemm_kernel's name for bf16 starts where it is


def packed_gemm_kernel(dtype: torch.dtype) -> str:
    """Which kernel serves packed linears in ``dtype`` here, in words (the engine's log line)."""
    return _ops.gemm_kernel(dtype) if load_linears() is not None else "none"


def packed_gemm_onednn(dtype: torch.dtype) -> bool:
    """Whether oneDNN serves some row counts of the packed linears in ``dtype`` here (those past
    the packed kernel's): each new row count then costs oneDNN a primitive (worker/compiled.py)."""
    return "oneDNN" in packed_gemm_kernel(dtype)


def packed_gemm_preferred(dtype: torch.dtype) -> bool:
    """Whether linears in ``dtype`` should take the packed kernels here: float32 on a CPU with
    AVX-512 or AVX2 (decode steps' linears overlap reading their weights with their products
    there, oneDNN's and MKL's did not: worker/csrc/packed_gemm.cpp), and elsewhere through MKL's
    kernels on an Intel CPU, oneDNN's on others; bf16 on AMX tiles or AVX512-BF16 dot products
    wherever those are, and where neither is (oneDNN would emulate bf16), widened to float32. At
    decode row counts (SmolLM2's shapes, 2 threads) MKL beat oneDNN's packed linears on an Intel
    Xeon (AVX-512: decode steps 6-15% faster) and lost on an AMD EPYC (AVX2: decode steps at 64 /
    16 / 1 sequences 220 / 114 / 63 ms against oneDNN's 193 / 76 / 39; MKL's kernels there ran no
    faster than its unpacked SGEMM), where AVX2 panels serve them, 10-35% ahead of oneDNN's
    (and MKL's past 192 rows, where it is 3-12% faster than oneDNN's there:
    worker/csrc/packed_gemm.cpp). All named by handle, so a restart finds the graph in Inductor's
    cache instead of compiling it again (a frozen graph names its weights' addresses)."""
    return dtype in (torch.float32, torch.bfloat16) and packed_gemm_usable(dtype)  # the library picks the kernel


def argmax_usable(logits: torch.Tensor) -> bool:
    """Whether ``argmax_rows`` serves these logits (on a CPU, float32 or bf16, vector build).
    Asked every step: the answer is kept per dtype."""
    if logits.device.type != "cpu" or load() is None:
        return False
    ok = _argmax_dtypes.get(logits.dtype)
    if ok is None:
        ok = _argmax_dtypes[logits.dtype] = bool(_ops.argmax_supported(logits.dtype))
    return ok


_argmax_dtypes: dict[torch.dtype, bool] = {}


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """Each row's first largest value's index (a row with a NaN: its first NaN), as
    ``logits.max(dim=-1).indices``; see worker/csrc/greedy.cpp."""
    return _ops.argmax_rows(logits)


def screened_argmax(approx: torch.Tensor, h: torch.Tensor, w: torch.Tensor, norms: torch.Tensor) -> torch.Tensor:
    """Each row's largest ``h @ w.T`` from its bf16 approximation ``approx``; see
    worker/screened_head.py and worker/csrc/greedy.cpp."""
    return _ops.screened_argmax(approx, h, w, norms)


def bf16_double_rate() -> bool:
    """Whether bf16 GEMMs run at about twice float32's rate here (AMX; AVX512-BF16 but on Intel
    without AMX): worker/csrc/packed_gemm.cpp."""
    return load_linears() is not None and bool(_ops.bf16_double_rate())


def gemm_pack(w: torch.Tensor) -> int:
    """A handle to ``w`` [N, K] (float32: for MKL; bf16: in AMX tiles and for oneDNN); free it
    with gemm_release. The graph calls ``torch.ops.tokenq_native.gemm_packed(x, handle)``."""
    return int(_ops.gemm_pack(w))


def gemm_release(handle: int) -> None:
    if LINEARS in _loaded:
        _ops.gemm_release(handle)
