"""Process-wide settings that make the engine's CPU steps fast. Call :func:`set_openmp_env`
before torch is imported and :func:`tune_process` once, early, in any process that runs the
engine (the worker entry point, the benchmark).

OpenMP: idle math threads spin before they sleep. libgomp's default spin (300,000 rounds)
wins a little on an idle machine, but when another busy process shares the cores (the
producer reading results, other workers) the spinning threads starve it and each other: a
worker next to its client ran 3x slower, and 10x slower on a loaded machine. A short spin
(GOMP_SPINCOUNT=3000) kept the idle-machine speed and was as robust as never spinning.

glibc's malloc hands large freed blocks straight back to the OS (``mmap`` for blocks
above 128 KiB, and trimming the heap top), so every large tensor a step allocates is
fresh memory that page-faults on first touch: a 25 MB ``index_select`` ran 2.5x slower
for it. Raising the mmap threshold and the trim threshold keeps freed blocks in the
process for reuse. This costs nothing on other platforms (it does nothing there).

Huge pages: decode attention reads each sequence's K and V one page of the pool at a time,
pages anywhere in a pool of a GiB or more, so on 4 KiB memory pages nearly every cache page
read is a TLB miss. Where Linux offers transparent huge pages only on request (``madvise``,
a common default), the pools ask for them (:func:`zeros_on_huge_pages`). On the AVX2
machine (float32, SmolLM2's shapes, 30 layers, 64 sequences of 200-350 tokens) the decode
kernel alone took 8-16% less time (310 tokens: best 54 ms against 60-64); whole decode steps,
two engines interleaved in one process: 16 sequences 71.6 against 79.9 ms (best of 3), 64
sequences level (94.8 against 95.2, best of 6), where the step is mostly its GEMMs. The
packed weights that decode steps stream (worker/csrc/packed_gemm.cpp) lie on huge pages too.

Writes to Redis: the service writes a step's results in a thread of its own while the engine
runs the next step (worker/service/outbox.py), which is free where a core is left over from
the engine's math threads (a GPU worker, whose CPU mostly waits on the device; a CPU worker
given fewer threads than cores). Where the math threads take every core, the writer thread
can only run by preempting one of them, and every parallel region then waits for that one:
there the loop writes between steps instead (:func:`spare_core`). The tiny model in bf16
through Redis, one worker, rounds of 64 requests alternated between the two ways (AMD EPYC
Zen 4, 2 cores): 5,609 against 5,271 and 5,568 against 5,275 tok/s (+6%); float32 3,660
against 3,577, the small model in bf16 561 against 572 (level: its steps are 20x longer).
The loop also waits for Redis's reply there, rather than sending the transaction and reading
its reply at the next flush: Redis then executes the step's scripts (about 0.35 ms for 64
result streams) while the worker's second core is idle, not while the next step's threads
need both. Tried the other way (tiny float32 through Redis, 8 pairs of runs alternated, a
fresh worker each): 3,251 against 3,437 tok/s, 5% slower.

Garbage collection: start-up (loading, compiling the forward) leaves millions of objects
that live as long as the process, and every full collection walks them all: 0.3-0.4 s on
a small model, the first one falling in the first steps served (a 0.44 s stall seen in a
worker's first second). :func:`freeze_heap`, once the engine is built, collects once and
moves them out of the collector's sight.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import logging
import os
import sys
import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

log = logging.getLogger("tokenq.tuning")

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MADV_HUGEPAGE = 14

_done = False
OPENMP_ENV = {"GOMP_SPINCOUNT": "3000"}


def spare_core(device: str) -> bool:
    """Whether a core is left over from the engine's math threads (see above): on any device
    but the CPU, or when torch's threads are fewer than the cores this process may run on."""
    import torch

    if not device.startswith("cpu"):
        return True
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return torch.get_num_threads() < cores


def set_openmp_env() -> None:
    """Short OpenMP spin-waits (see above), unless the environment already says otherwise.
    Only effective before torch (and its OpenMP runtime) is loaded."""
    for k, v in OPENMP_ENV.items():
        os.environ.setdefault(k, v)


def _libc_function(name: str):
    """glibc's ``name`` (None off Linux, or where the C library has no such function)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return getattr(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True), name)
    except (OSError, AttributeError):
        return None


def trim_heap() -> None:
    """Hand the heap's free memory back to the OS now (glibc's ``malloc_trim``). Called once the
    packed weights are made (worker/compiled.py): the concatenated q/k/v and gate/up weights
    they were packed from are freed then, and the packed copies, on huge pages of their own
    (worker/csrc/packed_gemm.cpp), no longer reuse that memory, so it stayed resident: a
    SmolLM2 float32 worker served at 4.03-4.05 GB RSS, against 3.96 with the copies on 4 KiB
    pages and 3.97-3.98 with this trim. Step buffers are faulted in after it, at warm-up."""
    trim = _libc_function("malloc_trim")
    if trim is not None:
        trim.argtypes = [ctypes.c_size_t]
        trim(0)


def tune_malloc(mmap_threshold: int = 32 << 20, trim_threshold: int = 1 << 30) -> bool:
    """Keep freed blocks up to ``mmap_threshold`` bytes in the heap and trim it only past
    ``trim_threshold`` free bytes (glibc only). Returns whether it applied."""
    mallopt = _libc_function("mallopt")
    if mallopt is None:
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    ok = mallopt(M_MMAP_THRESHOLD, mmap_threshold) == 1
    ok = mallopt(M_TRIM_THRESHOLD, trim_threshold) == 1 and ok
    return ok


def zeros_on_huge_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """``torch.zeros(shape, dtype=dtype)`` on the CPU, its memory advised as huge pages before
    it is first touched (see above; where Linux has no such advice it is plain zeros)."""
    return empty_on_huge_pages(shape, dtype).zero_()


def empty_on_huge_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """``torch.empty(shape, dtype=dtype)`` on the CPU, advised as huge pages (not yet touched)."""
    import torch  # here, not above: set_openmp_env must run before torch loads

    t = torch.empty(shape, dtype=dtype)
    madvise = _libc_function("madvise")
    if madvise is not None and t.numel():
        madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        start = t.data_ptr()
        aligned = (start + 4095) & ~4095  # madvise takes page-aligned addresses
        end = start + t.numel() * t.element_size()
        if end > aligned and madvise(aligned, end - aligned, MADV_HUGEPAGE) != 0:
            log.debug("madvise(MADV_HUGEPAGE) refused: errno %d", ctypes.get_errno())
    return t


def zero_in_background(*tensors: torch.Tensor) -> threading.Thread:
    """Write zeros over ``tensors`` (contiguous, on the CPU) from a thread started here; join it
    before they are read. The first write to fresh memory is what costs (the kernel's page
    faults; on these VMs also the host's: 1 GiB took 3.8 s on an AMD EPYC), and ctypes' memset
    runs without the GIL, so the start-up's compile goes on beside it on the other core."""
    if any(t.device.type != "cpu" or not t.is_contiguous() for t in tensors):
        raise ValueError("zero_in_background: contiguous CPU tensors only (memset writes their bytes)")

    def run() -> None:
        for t in tensors:
            ctypes.memset(t.data_ptr(), 0, t.numel() * t.element_size())

    thread = threading.Thread(target=run, name="tokenq-zeros", daemon=True)
    thread.start()
    return thread


def tune_process() -> None:
    """Apply the process-wide settings once (idempotent)."""
    global _done
    if _done:
        return
    _done = True
    applied = tune_malloc()
    log.debug("malloc tuning %s", "applied" if applied else "not available")


def freeze_heap() -> None:
    """Collect once, then leave everything alive now out of later collections (call it when
    start-up is done; what is freed later by reference counting is freed as usual)."""
    gc.collect()
    gc.freeze()
