"""``Profiler``: a Chrome / Perfetto trace of the engine, and time per stage.

::

    with minivllm.Profiler("trace.json"):
        llm.generate(prompts, params)

or ``llm.start_profile("trace.json")`` ... ``llm.stop_profile()``, as in
vLLM. Open the trace in https://ui.perfetto.dev or chrome://tracing.

Every engine step is split into named ranges (``torch.profiler.record_function``):
``schedule``, ``prepare_inputs``, ``forward`` (with one ``layer.N`` range per
decoder layer inside), ``sample`` and ``detokenize``. On exit a table of the
total time spent in each stage is printed.
"""

from __future__ import annotations

import sys
from typing import TextIO

import torch
from torch.profiler import ProfilerActivity, profile

STAGES = ("schedule", "prepare_inputs", "forward", "sample", "detokenize")


class Profiler:
    """Context manager recording a torch.profiler trace of everything inside it.

    Args:
        path: where to write the Chrome-trace JSON.
        print_summary: print the time-per-stage table on exit.
        file: where the table goes (default stdout).
    """

    def __init__(self, path: str = "minivllm_trace.json", print_summary: bool = True,
                 file: TextIO | None = None) -> None:
        self.path = path
        self.print_summary = print_summary
        self.file = file
        self.stage_times: dict[str, float] = {}
        activities = [ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(ProfilerActivity.CUDA)
        self._prof = profile(activities=activities, record_shapes=False)

    def __enter__(self) -> Profiler:
        from minivllm.model import llama

        self._old_flag = llama.PROFILE_LAYERS
        llama.PROFILE_LAYERS = True
        self._prof.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        from minivllm.model import llama

        self._prof.__exit__(*exc)
        llama.PROFILE_LAYERS = self._old_flag
        self._prof.export_chrome_trace(self.path)
        self.stage_times = self.summarize()
        if self.print_summary:
            print(self.format_table(), file=self.file or sys.stdout)

    def summarize(self) -> dict[str, float]:
        """Seconds spent in each stage, and in all decoder layers together."""
        times = dict.fromkeys(STAGES, 0.0)
        times["layers (in forward)"] = 0.0
        for evt in self._prof.key_averages():
            if evt.key in times:
                times[evt.key] += evt.cpu_time_total / 1e6
            elif evt.key.startswith("layer."):
                times["layers (in forward)"] += evt.cpu_time_total / 1e6
        return times

    def format_table(self) -> str:
        total = sum(self.stage_times[s] for s in STAGES) or 1.0
        lines = [f"minivllm profile (trace: {self.path})",
                 f"{'stage':<22}{'seconds':>10}{'share':>8}"]
        for name, secs in self.stage_times.items():
            share = f"{100 * secs / total:7.1f}%" if name in STAGES else "       "
            lines.append(f"{name:<22}{secs:>10.3f}{share}")
        return "\n".join(lines)
