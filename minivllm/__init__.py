"""minivllm: a readable, test-verified re-implementation of vLLM in PyTorch.

The public API mirrors vLLM's::

    from minivllm import LLM, SamplingParams
    llm = LLM("smollm2")
    print(llm.generate("Hello", SamplingParams(max_tokens=8))[0].outputs[0].text)
"""

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
