"""Build and load the C++ CPU kernels (``minivllm/fast/csrc``) as ``torch.ops.minivllm.*``.

What you learn here: the custom-op flow vLLM uses for its CPU kernels, in one page.

1. The kernels are plain C++ over ``torch::Tensor`` in ``csrc/*.cpp``
   (attention, cache write and block copies, RMSNorm, SiLU-and-mul, RoPE, the small-M
   linear, quantized matmuls, W8A8 integer dot products, a decode step's whole layer stack, the structured-output
   token bitmask, the LoRA delta; shared helpers in
   ``csrc/ops.h``).
2. ``csrc/torch_bindings.cpp`` registers them with ``TORCH_LIBRARY(minivllm, m)``:
   a schema per op (``Tensor(a!)`` marks what it writes) and a CPU
   implementation. Registered ops are real torch operators: the profiler names
   them, ``torch.compile`` traces through them, and Python calls them as
   ``torch.ops.minivllm.rms_norm(out, x, weight, eps)``.
3. :func:`build` compiles the sources just in time with
   ``torch.utils.cpp_extension.load`` (ninja, the host compiler, ``-O3`` and
   the native instruction set, OpenMP for ``at::parallel_for``) into torch's
   extension cache (``$TORCH_EXTENSIONS_DIR``, default
   ``~/.cache/torch_extensions``), never into the source tree, and loads the
   library into the process, which runs the registrations. The first build
   takes a minute or so and prints one line saying so; later processes reuse
   the cached library (torch rebuilds it when a source or flag changes).
   ``make setup`` builds it ahead of time (``python -m minivllm.fast.cpu_ops``).
   The build runs under minivllm's build lock (:mod:`minivllm.fast.cpp_build`),
   so one stopped part-way never leaves the next waiting forever.
4. If there is no compiler, or the build fails, :func:`build` returns the
   reason instead of raising; :mod:`minivllm.backend` then serves the kernel
   components from ``minivllm.ref`` with one warning giving that reason.

The Python wrappers that allocate outputs and call these ops are in the fast
component modules (``minivllm/fast/layernorm.py``: ``rms_norm_cpu`` ...), next
to their Triton twins; ``minivllm.fast.cpu`` collects them as a backend.
``MINIVLLM_NO_CPP=1`` skips the build (as if it had failed), e.g. to measure
the ref on a CPU. ``MINIVLLM_CPU_ARCH=x86-64-v3`` builds for another CPU than this
one (here: AVX2 and FMA, an AVX2 laptop), in a cache folder of its own, and the
kernels then use no instruction set past it (:func:`compile_flags`).
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import sys
import time
from pathlib import Path

import torch

from minivllm.cpu_target import target_arch
from minivllm.fast import cpp_build

CSRC = Path(__file__).with_name("csrc")
SOURCES = ("attention.cpp", "cache_write.cpp", "copy_blocks.cpp", "layernorm.cpp",
           "activation.cpp", "rotary.cpp", "gemv.cpp", "gemm_panels.cpp", "quant.cpp",
           "quant_w8a8.cpp", "layer_stack.cpp", "token_bitmask.cpp", "argmax.cpp", "lora.cpp",
           "thread_team.cpp", "torch_bindings.cpp")  # fmt: skip
#: Headers the sources include (a change to one rebuilds the library).
HEADERS = ("ops.h", "thread_team.h", "attention_rows.h", "attention_tile.h", "quant_tiles.h",
           "quant_w8a8_tiles.h", "quant_w8a8_gemm.h", "quant_w8a8_gemm256.h", "quant_w8a8_panels.h",
           "quant_w8a8_amx.h", "quant_w8a8_portable.h", "quant_w8a8_row512.h", "quant_w8a8_problem.h",
           "quant_w8a8_prepacked.h", "quant_w8a8_isas.h", "kv_cache.h", "layer_stack_clock.h")


def _extension_name() -> str:
    """The extension's name, and so its folder in torch's extension cache.

    Keyed by this environment (``sys.prefix``) and this source tree: two
    virtual environments, or two checkouts, on one machine each build once
    into a folder of their own, instead of rebuilding over each other's
    library at every switch (a minute each time); and so is a build for
    another CPU (:func:`minivllm.cpu_target.target_arch`).
    """
    key, arch = f"{sys.prefix}\0{CSRC.resolve()}".encode(), target_arch()
    if arch != "native":  # another CPU's build: a folder of its own
        key += f"\0{arch}".encode()
    return f"minivllm_cpu_ops_{hashlib.sha1(key).hexdigest()[:10]}"


#: The extension's name: its folder in torch's extension cache (one per environment
#: and source tree).
NAME = _extension_name()


def compile_flags() -> list[str]:
    """``-O3``, OpenMP (on Linux) and the native instruction set of this machine.

    The library is built on the machine that runs it, so ``-march=native`` is
    safe and lets the compiler vectorise the loops with AVX2/AVX-512 (x86) or
    NEON/SVE (ARM). macOS's clang has no OpenMP: ``at::parallel_for`` then runs
    on one thread. :func:`~minivllm.cpu_target.target_arch` names another CPU instead (then
    ``-DMINIVLLM_FOREIGN_ARCH`` tells the run-time choices to stay within it).
    """
    # -fno-trapping-math: the kernels never read floating-point exception flags, and
    # without it GCC will not if-convert a float comparison (fast_exp's clamps, a
    # causal mask's select), so every loop holding one stays scalar.
    flags = ["-O3", "-fno-trapping-math"]
    if sys.platform.startswith("linux"):
        flags.append("-fopenmp")
    machine, arch = platform.machine().lower(), target_arch()
    if machine in ("x86_64", "amd64"):
        flags.append(f"-march={arch}")
    elif machine in ("arm64", "aarch64"):
        flags.append(f"-mcpu={arch}")
    if arch != "native":
        flags.append("-DMINIVLLM_FOREIGN_ARCH")
    return flags


def build_directory() -> Path:
    """Where torch's extension cache keeps this library (outside the repository)."""
    return cpp_build.build_directory(NAME)


def _is_built(build_dir: Path) -> bool:
    """True if a library newer than every source is already in the cache."""
    libs = list(build_dir.glob(f"{NAME}*.so")) + list(build_dir.glob(f"{NAME}*.pyd"))
    if not libs:
        return False
    newest_source = max((CSRC / s).stat().st_mtime for s in (*SOURCES, *HEADERS))
    return min(lib.stat().st_mtime for lib in libs) >= newest_source


@functools.cache
def build() -> tuple[str | None, str | None]:
    """Build (once per machine) and load the C++ ops: ``(library path, None)`` or ``(None, why)``.

    Cached: later calls are free. Never raises: a missing compiler or a compile
    error becomes the reason string, which :mod:`minivllm.backend` puts in its
    one fallback warning.
    """
    if os.environ.get("MINIVLLM_NO_CPP", "0") == "1":
        return None, "MINIVLLM_NO_CPP=1 is set"
    try:
        build_dir = build_directory()
        fresh = not _is_built(build_dir)
        start = time.perf_counter()
        # One build at a time, and a killed build's locks cleared (minivllm.fast.cpp_build).
        path = cpp_build.load(
            name=NAME,
            sources=[str(CSRC / s) for s in SOURCES],
            extra_cflags=compile_flags(),
            extra_ldflags=["-fopenmp"] if sys.platform.startswith("linux") else [],
            is_python_module=False,  # a plain library: loading it runs TORCH_LIBRARY
            verbose=False,
        )
    except Exception as e:  # no compiler, no ninja, a compile error: fall back, never crash
        lines = [line for line in str(e).strip().splitlines() if line.strip()]
        return None, f"{type(e).__name__}: {lines[-1] if lines else 'build failed'}"
    if fresh:
        print(f"minivllm: built the C++ CPU kernels in {time.perf_counter() - start:.1f} s "
              f"(cached in {build_dir})", file=sys.stderr, flush=True)  # fmt: skip
    return path, None


def available() -> bool:
    """True if the C++ ops are built and loaded (builds them on first use)."""
    return build()[0] is not None


def unavailable_reason() -> str | None:
    """Why the C++ ops could not be built or loaded, or None if they were."""
    return build()[1]


def ops():
    """``torch.ops.minivllm``, after making sure the library is loaded."""
    path, why = build()
    if path is None:
        raise RuntimeError(f"the minivllm C++ CPU kernels are not available ({why}); "
                           f"use backend='ref' on a CPU")  # fmt: skip
    return torch.ops.minivllm


if __name__ == "__main__":  # python -m minivllm.fast.cpu_ops: build ahead of time
    path, why = build()
    print(f"minivllm C++ CPU kernels: {path or f'not available ({why}); the ref kernels will run'}")
    # Exit 0 either way: without the ops minivllm still runs (the ref kernels), so set-up goes on.
