"""Which CPU the C++ kernels are built for: this one, or another named by ``$MINIVLLM_CPU_ARCH``.

``MINIVLLM_CPU_ARCH=x86-64-v3`` (AVX2, FMA, F16C: an AVX2 laptop) builds the kernels
for that CPU on a newer machine (:mod:`minivllm.fast.cpu_ops`, docs/kernels.md): the
compiler vectorises for it only, the W8A8 kernels choose no instruction set past it,
and ``dtype="auto"`` (:mod:`minivllm.dtype`) chooses as on it. The benchmarks name
such a build in their headers.
"""

from __future__ import annotations

import functools
import os
import platform
import re
import subprocess

ARCH_ENV = "MINIVLLM_CPU_ARCH"


def target_arch() -> str:
    """The CPU the library is built for: ``$MINIVLLM_CPU_ARCH``, or ``"native"`` (this one).

    Any ``-march`` (x86) / ``-mcpu`` (ARM) name of the compiler, e.g. ``x86-64-v3``
    (AVX2, FMA, F16C: the AVX2 laptops) or ``haswell``, to run an older CPU's code paths
    on a newer machine: the compiler then vectorises for that CPU only, and the W8A8
    kernels, which choose their instruction set at run time, use none past it.
    """
    arch = os.environ.get(ARCH_ENV, "").strip() or "native"
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._+-]*", arch):
        raise ValueError(f"{ARCH_ENV} must be a compiler -march / -mcpu name such as "
                         f"'x86-64-v3' or 'native', got {arch!r}")
    return arch


#: A CPU flag (as ``/proc/cpuinfo`` names it) and the compiler macro of a target that has it.
TARGET_MACROS = (("avx2", "__AVX2__"), ("fma", "__FMA__"), ("f16c", "__F16C__"),
                 ("avx512f", "__AVX512F__"), ("avx512vl", "__AVX512VL__"),
                 ("avx512bw", "__AVX512BW__"), ("avx512_vnni", "__AVX512VNNI__"),
                 ("avx_vnni", "__AVXVNNI__"),
                 ("avx512_bf16", "__AVX512BF16__"), ("amx_tile", "__AMX_TILE__"),
                 ("amx_int8", "__AMX_INT8__"), ("amx_bf16", "__AMX_BF16__"))


def target_cpu_flags() -> frozenset[str] | None:
    """The CPU flags of :data:`TARGET_MACROS` that the build target has, as the compiler
    says (``c++ -march=... -dM -E``); None for a native build (this CPU's own flags
    hold) or where the compiler cannot say."""
    arch = target_arch()
    if arch == "native" or platform.machine().lower() not in ("x86_64", "amd64"):
        return None
    return _flags_of(arch)


@functools.cache
def _flags_of(arch: str) -> frozenset[str] | None:
    try:
        macros = subprocess.run(["c++", f"-march={arch}", "-dM", "-E", "-"], input="",
                                capture_output=True, text=True, check=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return frozenset(flag for flag, macro in TARGET_MACROS if f"#define {macro} " in macros)
