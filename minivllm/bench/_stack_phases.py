"""Inside the C++ layer stack: where a decode step's one C++ call spends its time.

On a CPU the fast path's decode step is one call (``torch.ops.minivllm.decode_layers``:
``minivllm/fast/csrc/layer_stack.cpp``), so neither torch's profiler nor an op range
sees into it. The call keeps a clock of its own (``csrc/layer_stack_clock.h``), off
unless ``decode_layers_timing(True)`` turns it on: each phase boundary reads the steady
clock, and the phases run exactly the kernels they run with it off.

:func:`measure` runs the decode steps of one batch with the clock on (the prefill step
before it does not count) and returns each phase's milliseconds per step; for the
projections and the LM head also the GB/s at which their weights were read (the bytes a
step of ``rows`` rows reads: at one row a quantized weight's prepacked copy where it has
one). ``minivllm bench latency`` prints them under its table.
"""

from __future__ import annotations

import contextlib
from types import MappingProxyType

from minivllm.bench._harness import decode_after_prefill

#: The phases that read a weight: which projection of a layer (or the LM head).
_PROJECTION_OF = MappingProxyType({"qkv": 0, "o": 1, "gate_up": 2, "down": 3, "lm head": None})


def weight_bytes(kernel, rows: int) -> int:
    """Bytes of one :class:`~minivllm.fast.linear_kernel.ProjectionKernel`'s weight that a
    call on ``rows`` rows of x reads (the tensors the layer stack's kernel for it reads)."""
    weight, second, third, packed = kernel.tensors
    if kernel.kind == "float":
        return weight.nbytes
    if rows == 1 and packed is not weight:  # the prepacked copy holds the scales too
        return packed.nbytes
    return weight.nbytes + second.nbytes + (0 if third is second else third.nbytes)


def measure(llm, prompts: list[list[int]], max_tokens: int) -> dict | None:
    """``{"calls": decode steps, "phases": {name: {"ms": per step, "gbps": ...}}}`` of the
    decode steps of ``prompts``, or None where those steps were not the C++ layer stack."""
    from minivllm.fast import cpu_ops

    runner = getattr(llm.llm_engine.executor.worker, "model_runner", None)
    stack = getattr(runner, "layer_stack", None)
    if stack is None or not cpu_ops.available():
        return None
    ops = cpu_ops.ops()
    got: list[float] = []

    @contextlib.contextmanager
    def clock_on():  # the decode steps only: the prefill is not timed
        ops.decode_layers_timing(True)
        try:
            yield
        finally:
            got.extend(ops.decode_layers_timing(False))

    decode_after_prefill(llm, prompts, max_tokens, clock_on())
    calls, seconds = int(got[0]), got[1:]
    if calls == 0:
        return None
    rows = len(prompts)
    phases = {}
    for name, s in zip(ops.decode_layers_phases(), seconds):
        ms = 1000 * s / calls
        phases[name] = {"ms": ms}
        if name in _PROJECTION_OF and ms > 0:
            p = _PROJECTION_OF[name]
            kernels = ([stack.lm_head] if p is None else stack.projections[p::4])
            if None not in kernels:
                phases[name]["gbps"] = sum(weight_bytes(k, rows) for k in kernels) / ms / 1e6
    return {"calls": calls, "phases": phases}


def format_lines(result: dict) -> list[str]:
    """The phases of one :func:`measure` as table lines (ms a step, share of the call, GB/s)."""
    phases = result["phases"]
    total = sum(p["ms"] for p in phases.values())
    lines = [f"  inside the C++ layer stack ({result['calls']} decode steps, "
             f"{total:.2f} ms a call):"]
    for name, p in phases.items():
        gbps = f"  {p['gbps']:5.1f} GB/s" if "gbps" in p else ""
        lines.append(f"    {name:<20}{p['ms']:>8.3f} ms {p['ms'] / total:>6.1%}{gbps}")
    return lines


__all__ = ["format_lines", "measure", "weight_bytes"]
