"""The native sources compile on every CPU they have a path for, not only this one.

worker/native.py builds them with ``-march=native``, and each source picks its path (AMX,
AVX512-BF16, AVX-512, AVX2, portable) by the compiler's macros. A machine only ever compiles its
own path, so a name used on one path but declared inside another's ``#if`` broke every AVX2
machine's build (their engines then ran the torch path) while AVX-512 machines passed: here each
source is compiled (syntax and templates, no code) for the other CPUs too. Unlike
tests/test_native.py, nothing here is skipped when this machine's build fails: that failure is
one of the things tested.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sysconfig
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from worker import native

CXX = os.environ.get("CXX", "c++")  # what torch's extension builder runs
pytestmark = pytest.mark.skipif(shutil.which(CXX) is None, reason=f"no C++ compiler ({CXX}) here")

SOURCES = [path for sources, _ in native.LIBRARIES.values() for path in sources]
# AVX2 + FMA (AMD Zen 2/3), the default run's; the others in the slow run: no AVX (the portable
# loops), AVX-512 without bf16 (Ice Lake), AMX with AVX512-BF16 and FP16 (Sapphire Rapids)
DEFAULT_MARCH = "x86-64-v3"
SLOW_MARCHES = ["x86-64", "x86-64-v4", "sapphirerapids"]


def _errors(march: str) -> list[str]:
    """Each source compiled for ``march`` as the build would (its flags, torch's headers); the
    compiler's errors of those that fail."""
    from torch.utils import cpp_extension

    includes = [flag for path in [*cpp_extension.include_paths(), sysconfig.get_paths()["include"]]
                for flag in ("-isystem", path)]
    flags = [f if f != "-march=native" else f"-march={march}" for f in native.CFLAGS]
    assert any(f.startswith("-march=") for f in flags), native.CFLAGS

    def check(source) -> str | None:
        done = subprocess.run([CXX, "-fsyntax-only", "-std=c++20", *flags, *includes,
                               "-DTORCH_EXTENSION_NAME=tokenq_native_check", "-DTORCH_API_INCLUDE_EXTENSION_H",
                               str(source)], capture_output=True, text=True, timeout=600)
        return None if done.returncode == 0 else f"{source.name} (-march={march}):\n{done.stderr[-3000:]}"

    with ThreadPoolExecutor(max(1, min(len(SOURCES), os.cpu_count() or 1))) as pool:
        return [e for e in pool.map(check, SOURCES) if e]


def test_the_sources_compile_for_avx2():
    assert _errors(DEFAULT_MARCH) == []


@pytest.mark.slow
@pytest.mark.parametrize("march", SLOW_MARCHES)
def test_the_sources_compile_for_other_cpus(march):
    assert _errors(march) == []


@pytest.mark.skipif(os.environ.get("TOKENQ_NATIVE", "1") == "0", reason="turned off (TOKENQ_NATIVE=0)")
def test_the_libraries_build_on_this_machine():
    """Where a compiler is, the build works (tests/test_native.py skips itself where it does not,
    so a broken build would otherwise show only as skips)."""
    assert native.load() is not None, native.error()
    assert native.usable(torch.device("cpu"), torch.float32)
