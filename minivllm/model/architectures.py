"""Which model class serves a Hugging Face config (vLLM's model registry).

``config.architectures[0]`` names the class (``"LlamaForCausalLM"``, ...); a
config without it is looked up by ``model_type``. Every registered
architecture is a variant of :mod:`minivllm.model.llama` switched by its
config, and ``tests/test_model_runner.py`` runs each one bit for bit through
both model runners.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from minivllm.model.llama import (
    LlamaForCausalLM,
    MistralForCausalLM,
    Qwen2ForCausalLM,
    Qwen3ForCausalLM,
)

#: ``config.architectures[0]`` -> model class.
MODEL_REGISTRY: Mapping[str, type[LlamaForCausalLM]] = MappingProxyType({
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
})
#: ``config.model_type`` -> architecture name, for configs without ``architectures``.
MODEL_TYPES = MappingProxyType({"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
               "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"})


def get_model_class(config: Any) -> type[LlamaForCausalLM]:
    """The model class for an HF config; ``ValueError`` if we do not support it."""
    archs = list(getattr(config, "architectures", None) or [])
    model_type = getattr(config, "model_type", None)
    name = archs[0] if archs else MODEL_TYPES.get(model_type)
    if name not in MODEL_REGISTRY or MODEL_TYPES.get(model_type) != name:
        raise ValueError(
            f"unsupported architecture {name or archs!r} (model_type={model_type!r}); "
            f"supported: {sorted(MODEL_REGISTRY)}"
        )
    return MODEL_REGISTRY[name]
