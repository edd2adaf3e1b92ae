"""What a loaded LoRA adapter is: per layer and module, ``A (r, in)``, ``B (out, r)`` and a scale.

A LoRA fine-tune leaves the base weight ``W (out, in)`` of a projection frozen and
learns a low-rank correction beside it::

    y = x W^T + scaling * (x A^T) B^T,      A: (r, in),  B: (out, r),  r << in, out

with ``scaling = lora_alpha / r`` (or ``lora_alpha / sqrt(r)`` with rsLoRA). Only
``A`` and ``B`` are stored: for SmolLM2's ``q_proj`` (576 -> 576) at ``r = 16`` that
is ``16 * (576 + 576)`` numbers instead of ``576 * 576``, 18x fewer.

The names follow vLLM's ``vllm/lora/lora_weights.py`` and ``lora_model.py``:
:class:`LoRALayerWeights` (one module of one layer) and :class:`LoRAModel` (a
whole adapter). This module also says which projections an adapter may target
in minivllm's Llama-family model and what shape each has
(:func:`module_shapes`), and how the model's *fused* projections split into them
(:data:`PACKED_MODULES_MAPPING`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch

from minivllm.hf_config import attention_config

#: The projections an adapter may target, with the sub-module of a decoder layer holding each.
SUPPORTED_MODULES: Mapping[str, str] = MappingProxyType({
    "q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
    "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp",
})

#: The model's fused projection -> the checkpoint modules stacked on its output, in
#: order (vLLM's ``packed_modules_mapping``). Each is one *output slice* of the
#: fused output, and gets its own A and B.
PACKED_MODULES_MAPPING: Mapping[str, tuple[str, ...]] = MappingProxyType({
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "o_proj": ("o_proj",),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "down_proj": ("down_proj",),
})

#: Column-parallel modules (output rows split across tensor-parallel ranks); the
#: others (``o_proj``, ``down_proj``) are row-parallel (input columns split).
COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")


def module_name(layer: int, module: str) -> str:
    """The HF module path of ``module`` in decoder layer ``layer``, e.g.
    ``model.layers.3.self_attn.q_proj`` (what PEFT's keys and patterns match)."""
    return f"model.layers.{layer}.{SUPPORTED_MODULES[module]}.{module}"


def module_shapes(hf_config: Any) -> dict[str, tuple[int, int]]:
    """``module -> (in_features, out_features)`` of each targetable projection of the model."""
    hidden, inter = hf_config.hidden_size, hf_config.intermediate_size
    dims = attention_config(hf_config)
    d, heads, kv_heads = dims.head_dim, dims.num_heads, dims.num_kv_heads
    return {
        "q_proj": (hidden, heads * d), "k_proj": (hidden, kv_heads * d),
        "v_proj": (hidden, kv_heads * d), "o_proj": (heads * d, hidden),
        "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden),
    }


@dataclass(frozen=True)
class LoRALayerWeights:
    """One adapted module of one layer: ``delta y = scaling * (x A^T) B^T``.

    Attributes:
        layer: the decoder layer index.
        module: ``q_proj`` ... ``down_proj``.
        rank: ``r`` (rows of A, columns of B); may differ per module (``rank_pattern``).
        lora_alpha: the alpha that went into ``scaling``.
        scaling: ``lora_alpha / r``, or ``lora_alpha / sqrt(r)`` with rsLoRA.
        lora_a: ``(r, in_features)``.
        lora_b: ``(out_features, r)``.
    """

    layer: int
    module: str
    rank: int
    lora_alpha: float
    scaling: float
    lora_a: torch.Tensor
    lora_b: torch.Tensor

    @property
    def module_name(self) -> str:
        """The HF path, e.g. ``model.layers.3.self_attn.q_proj``."""
        return module_name(self.layer, self.module)


@dataclass(frozen=True)
class LoRAModel:
    """A loaded adapter (vLLM's ``LoRAModel``): its identity and its adapted modules.

    Attributes:
        lora_int_id, lora_name, lora_path: from its :class:`~minivllm.lora.request.LoRARequest`.
        rank: the largest rank over its modules (what a slot must hold).
        loras: ``(layer, module) -> LoRALayerWeights`` for every adapted module; a
            module absent here runs the base projection alone.
    """

    lora_int_id: int
    lora_name: str
    lora_path: str
    rank: int
    loras: Mapping[tuple[int, str], LoRALayerWeights]

    def get(self, layer: int, module: str) -> LoRALayerWeights | None:
        """The weights of ``module`` in ``layer``, or None if the adapter leaves it alone."""
        return self.loras.get((layer, module))

    @property
    def target_modules(self) -> tuple[str, ...]:
        """The module kinds it adapts (in :data:`SUPPORTED_MODULES` order)."""
        kinds = {m for _, m in self.loras}
        return tuple(m for m in SUPPORTED_MODULES if m in kinds)

    @property
    def nbytes(self) -> int:
        """Bytes of its A and B matrices (what the CPU cache holds)."""
        return sum(w.lora_a.nbytes + w.lora_b.nbytes for w in self.loras.values())
