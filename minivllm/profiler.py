"""``Profiler``: time per engine stage and per model op, and a bounded Chrome trace.

::

    with minivllm.Profiler("trace.json"):
        llm.generate(prompts, params)

or ``llm.start_profile("trace.json")`` ... ``llm.stop_profile()``, as in
vLLM. Open the trace in https://ui.perfetto.dev or chrome://tracing.

Every engine step is split into named ranges (``record_function``):
``schedule``, ``prepare_inputs``, ``forward``, ``sample`` and ``detokenize``.
Inside ``forward`` the model puts each decoder layer in a ``layer.N`` range and
each kernel call in an ``op.<category>`` range (:func:`op_range`:
linear, attention, norm, rope, activation, cache_write, embedding, lm_head).
On exit two tables are printed: seconds and share per stage, and per op
category (with the sampler), which answers "where does forward time go"
without opening the trace. On a GPU the op table uses device time.

The trace is kept small in two ways (a 64-request SmolLM2 run used to write
492 MB and 1.9 M events):

- **Only the named ranges are recorded** by default. The thousands of ATen
  operator events under them (``aten::mm``, ``aten::copy_``...) are not even
  collected; ``record_ops=True`` turns them on.
- **Only a window of engine steps goes into the trace file**
  (``trace_steps=(first, count)``, default the first 32). The tables always
  cover every step.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from contextlib import AbstractContextManager, nullcontext
from typing import TextIO

import torch
from torch._C._profiler import (
    ProfilerActivity,
    ProfilerConfig,
    ProfilerState,
    RecordScope,
    _ExperimentalConfig,
)


def is_recording() -> bool:
    """Whether a torch profiler is recording in this thread (0.3-1 µs to ask).

    The one place that asks: :func:`op_range` follows it, and the fast model
    runner steps aside for the model's own forward while it is true, so that
    the op table names every kernel.
    """
    return torch._C._autograd._profiler_enabled()


def op_range(name: str) -> AbstractContextManager:
    """A profiler range called ``name`` while a torch profiler records; otherwise a no-op.

    ``record_function`` costs about 7 µs even when nothing records (measured on
    the 2-core development machine), i.e. ~2 ms per step for 30 layers with
    ten ranges each. Asking the profiler whether it is on costs 0.3-1 µs, so
    the ranges follow the profiler itself: no flag for anyone to flip.
    """
    if is_recording():
        return torch.profiler.record_function(name)
    return nullcontext()


STAGES = ("schedule", "prepare_inputs", "forward", "sample", "detokenize")
#: Op categories, as the model names its ranges (``op.<name>``), plus the sampler.
OPS = ("linear", "lm_head", "attention", "norm", "rope", "activation", "cache_write",
       "embedding", "sampler")


class Profiler:
    """Context manager profiling everything inside it; see the module docstring.

    Args:
        path: where to write the Chrome-trace JSON.
        print_summary: print the stage and op tables on exit.
        file: where the tables go (default stdout).
        record_ops: also record every ATen operator (and, on a GPU, keep the
            kernels in the trace). Off by default: it multiplies the events by
            about 30 and slows the run down.
        trace_steps: ``(first, count)``: the engine steps (counted from 0 at
            ``__enter__``) whose events go into the trace file; ``None`` keeps all.
    """

    def __init__(self, path: str = "minivllm_trace.json", print_summary: bool = True,
                 file: TextIO | None = None, *, record_ops: bool = False,
                 trace_steps: tuple[int, int] | None = (0, 32)) -> None:
        if trace_steps is not None and (len(trace_steps) != 2 or trace_steps[0] < 0
                                        or trace_steps[1] < 1):
            raise ValueError(f"trace_steps must be None or (first >= 0, count >= 1), "
                             f"got {trace_steps!r}")
        self.path = path
        self.print_summary = print_summary
        self.file = file
        self.record_ops = record_ops
        self.trace_steps = trace_steps
        self.stage_times: dict[str, float] = {}
        self.op_times: dict[str, float] = {}
        self.num_trace_events = 0
        self._activities = {ProfilerActivity.CPU}
        if torch.cuda.is_available():
            self._activities.add(ProfilerActivity.CUDA)

    def __enter__(self) -> Profiler:
        # torch.profiler.profile has no switch for "ranges only", so this drives the
        # same Kineto profiler one level down, where the recorded scopes can be chosen.
        config = ProfilerConfig(ProfilerState.KINETO, False, False, False, False, False,
                                _ExperimentalConfig())
        scopes = set() if self.record_ops else {RecordScope.USER_SCOPE}  # set(): all
        torch._C._autograd._prepare_profiler(config, self._activities)
        torch._C._autograd._enable_profiler(config, self._activities, scopes)
        return self

    def __exit__(self, *exc) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        result = torch._C._autograd._disable_profiler()
        self.stage_times, self.op_times = self.summarize(result.events())
        result.save(self.path)
        self.num_trace_events = self._keep_trace_window()
        if self.print_summary:
            print(self.format_table(), file=self.file or sys.stdout)

    def summarize(self, events) -> tuple[dict[str, float], dict[str, float]]:
        """(seconds per stage, seconds per op category) from the recorded events."""
        cpu, device = defaultdict(float), defaultdict(float)
        for evt in events:
            name = evt.name()
            if name.startswith("layer."):
                name = "layers (in forward)"
            on_device = evt.device_type() != torch.autograd.DeviceType.CPU
            (device if on_device else cpu)[name] += evt.duration_ns() / 1e9
        stages = {s: cpu[s] for s in STAGES}
        # The sampling worker samples inside the executor's call: "sample" is its own row.
        stages["forward"] = max(0.0, cpu["forward"] - cpu["sample"])
        stages["layers (in forward)"] = cpu["layers (in forward)"]
        # Kernels run asynchronously on a GPU: the CPU time of a range is only its launch.
        times = device if any(device[f"op.{op}"] for op in OPS) else cpu
        ops = {op: times[f"op.{op}"] for op in OPS[:-1]}
        ops["sampler"] = times["sample"]
        return stages, ops

    def format_table(self) -> str:
        """The stage table, then the op table (shares of forward + sample)."""
        total = sum(self.stage_times[s] for s in STAGES) or 1.0
        window = "all steps" if self.trace_steps is None else (
            f"steps {self.trace_steps[0]}..{sum(self.trace_steps) - 1}")
        lines = [f"minivllm profile (trace: {self.path}, {window}, "
                 f"{self.num_trace_events} events)",
                 f"{'stage':<22}{'seconds':>10}{'share':>8}"]
        for name, secs in self.stage_times.items():
            share = f"{100 * secs / total:7.1f}%" if name in STAGES else "       "
            lines.append(f"{name:<22}{secs:>10.3f}{share}")
        op_total = (self.stage_times["forward"] + self.stage_times["sample"]) or 1.0
        lines += ["", f"{'op (forward + sample)':<22}{'seconds':>10}{'share':>8}"]
        for name, secs in self.op_times.items():
            lines.append(f"{name:<22}{secs:>10.3f}{100 * secs / op_total:7.1f}%")
        other = op_total - sum(self.op_times.values())
        lines.append(f"{'other':<22}{other:>10.3f}{100 * other / op_total:7.1f}%")
        return "\n".join(lines)

    def _keep_trace_window(self) -> int:
        """Cut the saved trace down to ``trace_steps``; return its number of events."""
        with open(self.path) as f:
            trace = json.load(f)
        events = trace["traceEvents"]
        if self.trace_steps is not None:
            # Each engine step starts with its "schedule" range.
            starts = sorted(e["ts"] for e in events
                            if e.get("name") == "schedule" and e.get("ph") == "X")
            first, count = self.trace_steps
            lo = starts[first] if first < len(starts) else float("inf")
            hi = starts[first + count] if first + count < len(starts) else float("inf")
            events = [e for e in events if "ts" not in e or e.get("ph") == "M"
                      or lo <= float(e["ts"]) < hi]
            trace["traceEvents"] = events
            with open(self.path, "w") as f:
                json.dump(trace, f, separators=(",", ":"))
        return len(events)
