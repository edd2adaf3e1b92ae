"""What the attention of a Llama-family model reads from its Hugging Face config, parsed once.

HF configs leave some fields out and expect the reader to fill them in:
``num_key_value_heads`` missing means multi-head attention (as many KV heads
as query heads), ``head_dim`` missing means ``hidden_size //
num_attention_heads`` (Qwen3 sets it, and it may differ), and the biases
depend on the model type as well as on ``attention_bias``. Every module that
needs one of these (the model, the tensor-parallel size check, LoRA's shard
shapes) calls :func:`attention_config` (or, needing only the head counts,
:func:`num_kv_heads`), so a model whose config spells a
field differently is fixed in one place.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class AttentionConfig:
    """The attention shape and switches of one model (all layers are alike).

    Attributes:
        num_heads: query heads (``num_attention_heads``), over all tensor-parallel ranks.
        num_kv_heads: key/value heads; fewer than ``num_heads`` is GQA.
        head_dim: the size of one head.
        qkv_bias: q/k/v carry a bias (``attention_bias``, or always on Qwen2).
        o_bias: o_proj carries a bias (``attention_bias``, never on Qwen2).
        qk_norm: an RMSNorm over each query and key head before RoPE (Qwen3).
    """

    num_heads: int
    num_kv_heads: int
    head_dim: int
    qkv_bias: bool
    o_bias: bool
    qk_norm: bool


def num_kv_heads(hf_config: Any) -> int:
    """``num_key_value_heads``, or ``num_attention_heads`` where the config leaves it out."""
    return getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads


def attention_config(hf_config: Any) -> AttentionConfig:
    """The :class:`AttentionConfig` of ``hf_config`` (a ``PretrainedConfig`` or any object
    with its attributes), with the defaults HF applies to the fields it leaves out."""
    heads = hf_config.num_attention_heads
    attention_bias = bool(getattr(hf_config, "attention_bias", False))
    model_type = getattr(hf_config, "model_type", None)
    return AttentionConfig(
        num_heads=heads,
        num_kv_heads=num_kv_heads(hf_config),
        head_dim=getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads,
        qkv_bias=attention_bias or model_type == "qwen2",
        o_bias=attention_bias and model_type != "qwen2",
        qk_norm=model_type == "qwen3",
    )
