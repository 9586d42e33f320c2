"""What the machine code is compiled for: the CPU features Numba targets.

Numba compiles for ``NUMBA_CPU_NAME`` / ``NUMBA_CPU_FEATURES`` when they are set and
for the host otherwise; its compile cache is keyed on the same name and features,
so a choice made here from them always matches the cached code it shaped.
"""

import platform

from llvmlite import binding as llvm
from numba.core import config

_X86 = ("x86_64", "amd64", "i386", "i686", "x86")


def features():
    """The target's LLVM feature flags, e.g. ``{"+avx2", "-avx512f", ...}``."""
    text = config.CPU_FEATURES
    if text is None:
        text = llvm.get_host_cpu_features().flatten()
    return set(filter(None, text.split(",")))


def is_x86():
    return platform.machine().lower() in _X86


def is_aarch64():
    return platform.machine().lower() in ("aarch64", "arm64")


def half_conversions():
    """The instructions LLVM lowers float16 <-> float32 conversions to on this target,
    or None where it would call a library routine instead: F16C on x86 (an extension
    the target may lack), FCVT on AArch64 (part of its base floating point)."""
    if is_x86():
        return "F16C" if "+f16c" in features() else None
    return "FCVT" if is_aarch64() else None


def vector_bits():
    """Width of the target's float vector registers: 512 with AVX-512F, 256 with AVX,
    otherwise 128 (SSE2 on any x86-64, NEON, and the like)."""
    flags = features() if is_x86() else set()
    if "+avx512f" in flags:
        return 512
    if "+avx" in flags:
        return 256
    return 128


def vector_isa():
    """A short name for the vector instructions ``vector_bits`` came from."""
    return {512: "AVX-512", 256: "AVX"}.get(vector_bits(), "SSE2" if is_x86() else "128-bit")
