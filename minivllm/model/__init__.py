"""The Llama-family model and its loaders.

- :mod:`minivllm.model.llama`: the decoder (Llama 2/3, SmolLM2, Mistral, Qwen2, Qwen3).
- :mod:`minivllm.model.architectures`: which class serves an HF config.
- :mod:`minivllm.model.weights`: checkpoint tensors into the fused parameters.
- :mod:`minivllm.model.rope`: the rotary-embedding cache and its scaling variants.
- :mod:`minivllm.model.loader`: :func:`load_model` from an HF directory, a GGUF
  file or a registered name.
- :mod:`minivllm.model.gguf_loader`: GGUF -> HF config and float tensors.
- :mod:`minivllm.model.registry`: the default model (SmolLM2), converted once
  into a local cache.
"""

from minivllm.model.architectures import get_model_class
from minivllm.model.llama import LlamaForCausalLM
from minivllm.model.loader import ModelNotFoundError, load_model, resolve_model_path
from minivllm.model.registry import ensure_model

__all__ = [
    "LlamaForCausalLM",
    "ModelNotFoundError",
    "ensure_model",
    "get_model_class",
    "load_model",
    "resolve_model_path",
]
