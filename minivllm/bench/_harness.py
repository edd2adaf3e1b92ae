"""What every benchmark shares: how a time is taken, how a row is written, which machine.

- :func:`median_ms`: the median of repeated runs (CUDA events on a GPU; on a
  CPU the wall clock, or the thread's CPU time with one torch thread, which
  other processes on a busy machine do not inflate);
- :func:`copy_bandwidth` / :func:`read_bandwidth`: the memory limits a
  kernel's GB/s is a fraction of, measured in the same run;
- :func:`speedup_row`: one ref-vs-fast row, with GB/s and the fraction of the
  bandwidth where the minimum bytes moved are known;
- :func:`machine`: the CPU model, the instruction-set flags that change which
  kernels run (AVX2, AVX-512, ``avx512_bf16``, AMX), the cores and the load
  average, printed with every figure: a ratio means little without them.
"""

from __future__ import annotations

import contextlib
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from minivllm.cpu_target import target_arch

#: CPU flags that change which kernels run (the C++ ops dispatch on them).
KERNEL_CPU_FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16",
                    "amx_int8", "avx_vnni")


def median_ms(fn: Callable[[], object], repeats: int | None = None) -> float:
    """Median milliseconds of ``fn()`` (one untimed warm-up run first).

    ``repeats`` None: at least 5 runs, more (up to 50) until half a second is
    spent. In Triton's interpreter on a CPU one run is timed (the time means
    nothing there; ``--tiny`` runs only check that the benchmark works).
    """
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") == "1":
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    if torch.cuda.is_available():
        import triton.testing

        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
    clock = time.thread_time if torch.get_num_threads() == 1 else time.perf_counter
    fn()  # warm-up
    times: list[float] = []
    while (len(times) < repeats if repeats is not None
           else len(times) < 5 or (sum(times) < 0.5 and len(times) < 50)):
        start = clock()
        fn()
        times.append(clock() - start)
    return sorted(times)[len(times) // 2] * 1e3


def max_abs_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """``max |a - b|`` in float32."""
    return (a.float() - b.float()).abs().max().item()


def copy_bandwidth(device: str, n: int = 2**30) -> float:
    """Bytes/s of an ``n``-byte device-to-device copy, counting bytes read + written."""
    src = torch.ones(n, dtype=torch.uint8, device=device)  # touched: no page faults timed
    dst = torch.zeros_like(src)
    ms = median_ms(lambda: dst.copy_(src))
    return 2 * n / (ms * 1e-3)


def read_bandwidth(device: str, n: int = 2**30) -> float:
    """Bytes/s of reading ``n`` bytes (a float32 ``sum``: one add per 4 bytes read)."""
    src = torch.ones(n // 4, dtype=torch.float32, device=device)
    ms = median_ms(lambda: src.sum())
    return n / (ms * 1e-3)


def dtype_name(dtype: torch.dtype) -> str:
    """``bf16``, ``fp16`` or ``fp32``."""
    return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[dtype]


def speedup_row(name: str, t_ref: float, t_fast: float, err: float,
                gbytes: float | None = None, extra: dict | None = None,
                bw: float | None = None) -> dict:
    """One table row; with ``gbytes`` (the minimum bytes moved) also GB/s and its
    fraction of the bandwidth ``bw``."""
    row = dict(kernel=name, ref_ms=t_ref, fast_ms=t_fast, speedup=t_ref / t_fast,
               max_abs_err=err)
    if gbytes is not None:
        row["fast_GBps"] = gbytes / (t_fast * 1e-3)
        if bw:
            row["bandwidth_fraction"] = row["fast_GBps"] / bw
    row.update(extra or {})
    return row


def cpu_flags(cpuinfo: str | None = None, every: bool = False) -> list[str]:
    """The :data:`KERNEL_CPU_FLAGS` this CPU has (``/proc/cpuinfo`` on Linux); all of its
    flags with ``every``."""
    if cpuinfo is None:
        path = Path("/proc/cpuinfo")
        cpuinfo = path.read_text(errors="replace") if path.exists() else ""
    flags: set[str] = set()
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            flags.update(line.split(":", 1)[-1].split())
            break
    return sorted(flags) if every else [f for f in KERNEL_CPU_FLAGS if f in flags]


def machine() -> dict:
    """The machine a figure was measured on: CPU model, kernel flags, cores, load average."""
    model = platform.processor() or platform.machine()
    path = Path("/proc/cpuinfo")
    if path.exists():
        for line in path.read_text(errors="replace").splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[-1].strip()
                break
    load = os.getloadavg() if hasattr(os, "getloadavg") else (float("nan"),) * 3
    # What the code may use, where it is held below the CPU's flags (an AVX2 laptop's paths
    # measured on a newer CPU: MINIVLLM_CPU_ARCH, ATEN_CPU_CAPABILITY; docs/kernels.md).
    return dict(cpu=model, flags=cpu_flags(), cores=os.cpu_count(),
                torch_threads=torch.get_num_threads(), load_average=[round(x, 2) for x in load],
                kernels_built_for=target_arch(),
                torch_cpu_capability=torch.backends.cpu.get_cpu_capability())


def decode_after_prefill(llm, prompts: list[list[int]], max_tokens: int,
                         during: contextlib.AbstractContextManager) -> int:
    """Submit ``prompts`` (greedy, ``ignore_eos``; the prefix cache reset first), run their
    prefill step, then every decode step inside the context ``during`` (a profiler, a
    clock); returns how many decode steps ran."""
    from minivllm import SamplingParams

    engine = llm.llm_engine
    engine.scheduler.reset_prefix_cache()
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
    for p in prompts:
        engine.add_request(None, p, params)
    engine.step()  # the prefill
    steps = 0
    with during:
        while engine.has_unfinished_requests():
            engine.step()
            steps += 1
    return steps


def describe_machine(info: dict | None = None) -> str:
    """One line for a table's header, e.g. ``AMD EPYC (avx2 fma), 2 cores, load 1.02``."""
    info = machine() if info is None else info
    held = ""
    if info.get("kernels_built_for", "native") != "native":
        held = (f"; C++ kernels built for {info['kernels_built_for']}, torch's for "
                f"{info.get('torch_cpu_capability', '?')}")
    return (f"{info['cpu']} ({' '.join(info['flags']) or 'no SIMD flags'}), "
            f"{info['cores']} cores, load average {info['load_average'][0]:.2f}{held}")


@contextlib.contextmanager
def busy_core(enabled: bool = True):
    """Keep one core busy with another process (a busy loop) for the ``with`` block.

    A laptop is never idle: a browser tab or a compile holds a core. ``bench
    latency --busy-core`` and ``bench throughput --busy-core`` measure under
    this load; the process is started here and killed on the way out, whatever
    happens.
    """
    if not enabled:
        yield None
        return
    proc = subprocess.Popen([sys.executable, "-c", "while True: pass"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        time.sleep(0.5)  # let it reach the scheduler's steady state
        yield proc
    finally:
        proc.kill()
        proc.wait()
