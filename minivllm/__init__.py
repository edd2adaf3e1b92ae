"""minivllm: a readable, test-verified re-implementation of vLLM in PyTorch.

The public API mirrors vLLM's::

    from minivllm import LLM, SamplingParams
    llm = LLM("smollm2")
    print(llm.generate("Hello", SamplingParams(max_tokens=8))[0].outputs[0].text)
"""

import os as _os
import sys as _sys

# OpenMP's worker threads (torch's thread pool) spin for milliseconds after each
# parallel region by default (libgomp: 300000 turns). A decode step's own loops
# run on the C++ kernels' thread team (minivllm/fast/csrc/thread_team.h), so a
# torch worker still spinning after the sampler's ops takes a core from that team
# for much of the next step. libgomp reads this when torch loads it: import
# minivllm before torch, or set GOMP_SPINCOUNT yourself (docs/kernels.md, "Threads").
if "torch" not in _sys.modules:
    _os.environ.setdefault("GOMP_SPINCOUNT", "2000")

from minivllm.backend import get_backend, set_backend, use_backend
from minivllm.sampling_params import (
    BeamSearchParams,
    RequestOutputKind,
    SamplingParams,
    StructuredOutputsParams,
)

__all__ = [
    "LLM", "Profiler", "RequestOutput", "CompletionOutput", "SamplingParams",
    "RequestOutputKind", "StructuredOutputsParams", "BeamSearchParams", "BeamSearchOutput",
    "BeamSearchSequence", "LoRARequest",
    "get_backend", "set_backend", "use_backend",
]
__version__ = "0.1.0"


def __getattr__(name: str):
    # Import the engine lazily: `import minivllm` stays cheap (and Triton stays
    # unimported) until the engine is actually used.
    if name == "LLM":
        from minivllm.llm import LLM

        return LLM
    if name == "Profiler":
        from minivllm.profiler import Profiler

        return Profiler
    if name == "LoRARequest":
        from minivllm.lora.request import LoRARequest

        return LoRARequest
    if name in ("RequestOutput", "CompletionOutput", "BeamSearchOutput", "BeamSearchSequence"):
        from minivllm import outputs

        return getattr(outputs, name)
    raise AttributeError(f"module 'minivllm' has no attribute {name!r}")
