"""minivllm: a readable, test-verified re-implementation of vLLM in PyTorch."""

from minivllm.backend import get_backend, set_backend, use_backend
from minivllm.sampling_params import SamplingParams

__all__ = ["SamplingParams", "get_backend", "set_backend", "use_backend"]
__version__ = "0.1.0"
