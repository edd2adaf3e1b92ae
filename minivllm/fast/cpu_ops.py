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
4. If there is no compiler, or the build fails, :func:`build` returns the
   reason instead of raising; :mod:`minivllm.backend` then serves the kernel
   components from ``minivllm.ref`` with one warning giving that reason.

The Python wrappers that allocate outputs and call these ops are in the fast
component modules (``minivllm/fast/layernorm.py``: ``rms_norm_cpu`` ...), next
to their Triton twins; ``minivllm.fast.cpu`` collects them as a backend.
``MINIVLLM_NO_CPP=1`` skips the build (as if it had failed), e.g. to measure
the ref on a CPU.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import platform
import socket
import sys
import time
from pathlib import Path

import torch

CSRC = Path(__file__).with_name("csrc")
SOURCES = ("attention.cpp", "cache_write.cpp", "copy_blocks.cpp", "layernorm.cpp",
           "activation.cpp", "rotary.cpp", "gemv.cpp", "quant.cpp", "quant_w8a8.cpp", "layer_stack.cpp",
           "token_bitmask.cpp", "lora.cpp", "thread_team.cpp",
           "torch_bindings.cpp")  # fmt: skip
#: Headers the sources include (a change to one rebuilds the library).
HEADERS = ("ops.h", "thread_team.h", "attention_tile.h", "quant_tiles.h", "quant_w8a8_tiles.h", "kv_cache.h")


def _extension_name() -> str:
    """The extension's name, and so its folder in torch's extension cache.

    Keyed by this environment (``sys.prefix``) and this source tree: two
    virtual environments, or two checkouts, on one machine each build once
    into a folder of their own, instead of rebuilding over each other's
    library at every switch (a minute each time).
    """
    key = f"{sys.prefix}\0{CSRC.resolve()}".encode()
    return f"minivllm_cpu_ops_{hashlib.sha1(key).hexdigest()[:10]}"


#: The extension's name: its folder in torch's extension cache (one per environment
#: and source tree).
NAME = _extension_name()


def compile_flags() -> list[str]:
    """``-O3``, OpenMP (on Linux) and the native instruction set of this machine.

    The library is built on the machine that runs it, so ``-march=native`` is
    safe and lets the compiler vectorise the loops with AVX2/AVX-512 (x86) or
    NEON/SVE (ARM). macOS's clang has no OpenMP: ``at::parallel_for`` then runs
    on one thread.
    """
    # -fno-trapping-math: the kernels never read floating-point exception flags, and
    # without it GCC will not if-convert a float comparison (fast_exp's clamps, a
    # causal mask's select), so every loop holding one stays scalar.
    flags = ["-O3", "-fno-trapping-math"]
    if sys.platform.startswith("linux"):
        flags.append("-fopenmp")
    machine = platform.machine().lower()
    if machine in ("x86_64", "amd64"):
        flags.append("-march=native")
    elif machine in ("arm64", "aarch64"):
        flags.append("-mcpu=native")
    return flags


def build_directory() -> Path:
    """Where torch's extension cache keeps this library (outside the repository)."""
    from torch.utils.cpp_extension import _get_build_directory

    return Path(_get_build_directory(NAME, verbose=False))


def _is_built(build_dir: Path) -> bool:
    """True if a library newer than every source is already in the cache."""
    libs = list(build_dir.glob(f"{NAME}*.so")) + list(build_dir.glob(f"{NAME}*.pyd"))
    if not libs:
        return False
    newest_source = max((CSRC / s).stat().st_mtime for s in (*SOURCES, *HEADERS))
    return min(lib.stat().st_mtime for lib in libs) >= newest_source


#: A build lock untouched this long, in a folder untouched this long, is a killed build's
#: (the rule for a lock whose holder cannot be checked: torch's own, or another host's).
STALE_LOCK_SECONDS = 600
#: Seconds between two looks at a lock held by a live build.
LOCK_POLL_SECONDS = 0.5


def clear_stale_lock(build_dir: Path, now: float | None = None) -> bool:
    """Remove torch's ``build_dir/lock`` if a killed build left it; True if it did.

    torch's extension loader takes a ``lock`` file while it builds and waits,
    silently and forever, while that file exists. A build killed part-way
    (Ctrl-C, a timeout) leaves it behind, and every later process hangs. A live
    build writes its object files as it goes, so a lock that is, with every
    file beside it, older than :data:`STALE_LOCK_SECONDS` has no builder left.
    (minivllm's own builds hold :func:`build_lock` around torch's, so torch's lock
    is cleared at once when no minivllm build holds that.)
    """
    lock = build_dir / "lock"
    now = time.time() if now is None else now
    try:
        newest = max(f.stat().st_mtime for f in build_dir.iterdir())
    except (FileNotFoundError, ValueError):  # no folder, or an empty one
        return False
    if not lock.exists() or now - newest < STALE_LOCK_SECONDS:
        return False
    lock.unlink(missing_ok=True)
    print(f"minivllm: removed {lock}, left by a build that was stopped "
          f"{(now - newest) / 60:.0f} min ago", file=sys.stderr, flush=True)
    return True


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


def lock_holder(path: Path) -> dict | None:
    """``{"pid", "host", "started"}`` of the build holding ``path``, or None if none does.

    A holder on this host whose process is gone is no holder: the lock is a
    killed build's. On another host (a shared home directory) it cannot be
    checked; there the age rule of :func:`clear_stale_lock` applies.
    """
    try:
        holder = json.loads(path.read_text())
        pid, host = int(holder["pid"]), str(holder["host"])
    except FileNotFoundError:
        return None
    except (ValueError, KeyError, TypeError, OSError):  # half-written: its writer is live
        return {"pid": -1, "host": "?", "started": path.stat().st_mtime}
    if host == socket.gethostname() and not _pid_alive(pid):
        return None
    if host != socket.gethostname() and time.time() - path.stat().st_mtime > STALE_LOCK_SECONDS:
        return None
    return holder


@contextlib.contextmanager
def build_lock(build_dir: Path):
    """Hold ``build_dir/minivllm.lock`` (this process's pid and host in it) while building.

    A lock held by a live build is waited for, and the wait is said at once:
    which file, which process. A lock whose holder is dead is taken over; then
    torch's own lock, left by the same killed build, is removed too.
    """
    build_dir.mkdir(parents=True, exist_ok=True)
    path = build_dir / "minivllm.lock"
    me = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}
    said = False
    while True:
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            holder = lock_holder(path)
            if holder is None:  # a killed build's: take it over
                path.unlink(missing_ok=True)
                (build_dir / "lock").unlink(missing_ok=True)
                continue
            if not said:
                print(f"minivllm: waiting for the C++ kernels' build by process "
                      f"{holder['pid']} on {holder['host']} (lock {path})",
                      file=sys.stderr, flush=True)
                said = True
            time.sleep(LOCK_POLL_SECONDS)
            continue
        with os.fdopen(fd, "w") as f:
            json.dump(me, f)
        break
    try:
        yield
    finally:
        path.unlink(missing_ok=True)


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
        from torch.utils.cpp_extension import load as cpp_load

        build_dir = build_directory()
        with build_lock(build_dir):  # one build at a time; a dead one's locks are cleared
            clear_stale_lock(build_dir)
            fresh = not _is_built(build_dir)
            start = time.perf_counter()
            path = cpp_load(
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
