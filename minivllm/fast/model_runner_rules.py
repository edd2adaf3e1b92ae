"""What the fast model runner's C++ layer stack runs: the rules it checks once, at build.

:class:`~minivllm.fast.model_runner.LayerStack` runs a model's forward as one C++ call
only where every piece is one the loop implements exactly: the model declares only
features in :data:`SUPPORTED_FEATURES`, every kernel component is the C++ op (not the
ref, not a student's package: :func:`components_why_not`), and every projection is a
weight the loop multiplies, by the kernel the linear forward would take
(:func:`projection_kernel_of`; :func:`~minivllm.fast.linear_kernel.projection_kernel` is
the one dispatch rule). The LM head (:func:`lm_head_kernel`) and the embedding table
(:func:`embedding_table`) run inside the same call where they qualify, and in the model's
own ``compute_logits`` / lookup where they do not.
"""

from __future__ import annotations

from types import MappingProxyType

import torch

from minivllm.fast.linear_kernel import ProjectionKernel, kind_numbers, projection_kernel
from minivllm.lora.layers import projection_loras
from minivllm.quantized_weight import QuantizedWeight

__all__ = ["SUPPORTED_FEATURES", "components_why_not", "embedding_table", "lm_head_kernel",
           "projection_kernel_of"]

#: The model features (``LlamaForCausalLM.features``) the C++ loop implements.
SUPPORTED_FEATURES = frozenset({
    "embedding", "rms_norm", "qkv_proj", "gqa", "rope", "paged_attention", "o_proj",
    "silu_gated_mlp", "final_norm", "tied_embeddings", "lora",
})

#: (module attribute holding the component, function name) -> the C++ op it must be.
_REQUIRED_OPS = MappingProxyType({
    ("layernorm", "fused_add_rms_norm"): "fused_add_rms_norm",
    ("layernorm", "rms_norm"): "rms_norm",
    ("rotary", "apply_rotary_emb"): "rotary_embedding",
    ("cache_write", "reshape_and_cache"): "reshape_and_cache",
    ("attention", "paged_attention"): "paged_attention",
    ("activation", "silu_and_mul"): "silu_and_mul",
    ("lora", "add_lora"): "add_lora",
})


def _cpp_functions() -> dict[tuple[str, str], set]:
    """The Python functions that are thin wrappers over the C++ ops, per component."""
    from minivllm.fast import activation, attention, cache_write, layernorm, lora, rotary

    mods = dict(layernorm=layernorm, rotary=rotary, cache_write=cache_write,
                attention=attention, activation=activation, lora=lora)
    # ``fast.X.f`` dispatches on the device to ``f_cpu``; ``fast.cpu`` serves ``f_cpu``.
    return {key: {getattr(mods[key[0]], key[1]), getattr(mods[key[0]], key[1] + "_cpu")}
            for key in _REQUIRED_OPS}


def components_why_not(model: torch.nn.Module) -> str | None:
    """None if every kernel the model calls is the C++ op; else which one is not."""
    inner = model.model
    layers = inner.layers
    found = {
        ("layernorm", "fused_add_rms_norm"): [l.input_layernorm.ops.fused_add_rms_norm
                                              for l in layers],
        ("layernorm", "rms_norm"): [inner.norm.ops.rms_norm],
        ("rotary", "apply_rotary_emb"): [inner.rotary_emb.ops.apply_rotary_emb],
        ("cache_write", "reshape_and_cache"): [l.self_attn.ops_cache.reshape_and_cache
                                               for l in layers],
        ("attention", "paged_attention"): [l.self_attn.ops_attn.paged_attention for l in layers],
        ("activation", "silu_and_mul"): [l.mlp.ops_act.silu_and_mul for l in layers],
        # A student's (or the ref's) add_lora must run, not the C++ op in its place.
        ("lora", "add_lora"): [p.ops.add_lora for _, _, p in projection_loras(model)]
        if "lora" in model.features else [],
    }
    cpp = _cpp_functions()
    for key, fns in found.items():
        if any(f not in cpp[key] for f in fns):
            return f"{key[0]} is not the C++ op"
    return None


def _weight_kernel(layer: torch.nn.Module, what: str) -> ProjectionKernel | str:
    """The C++ kernel that multiplies ``layer``'s weight (:func:`projection_kernel`, the
    linear forward's own rule), or why the C++ loop can't (``what`` names the layer)."""
    from minivllm.fast import quantization as fast_quantization

    if layer.bias is not None:
        return f"{what} has a bias"
    w = layer.weight
    # The model's forward multiplies a quantized weight through the component it carries.
    if isinstance(w, QuantizedWeight) and w.ops is not fast_quantization:
        return f"{what}: a quantized weight not served by the fast quantization twin"
    got = projection_kernel(w, getattr(layer, "packed_weight", None))
    if not isinstance(got, str) and got.kind not in kind_numbers():
        return f"the C++ layer stack has no {got.kind!r} projection"
    return got


def projection_kernel_of(layer: torch.nn.Module) -> ProjectionKernel | str:
    """The C++ kernel of one projection, or why the C++ loop can't run it."""
    from minivllm.fast import linear as fast_linear

    if not isinstance(layer, (fast_linear.ColumnParallelLinear, fast_linear.RowParallelLinear)):
        return f"{type(layer).__name__} is not the fast linear twin"
    return _weight_kernel(layer, "a projection")


def lm_head_kernel(model: torch.nn.Module) -> ProjectionKernel | str:
    """The C++ kernel of the model's LM head, or why the stack leaves it to the model's
    ``compute_logits`` (another rank's columns, a bias, a weight the loop cannot multiply)."""
    from minivllm.fast import linear as fast_linear

    head = getattr(model, "lm_head", None)
    if not isinstance(head, fast_linear.ParallelLMHead) or head.tp_size != 1:
        return "not the fast twin's one-rank LM head"
    return _weight_kernel(head, "the LM head")


def embedding_table(model: torch.nn.Module, dtype: torch.dtype) -> torch.Tensor | None:
    """The model's embedding table where the C++ call can do the lookup (a row copy, as
    ``F.embedding``): the fast twin's one-rank table, one plain contiguous tensor in the
    activations' ``dtype``; else None (the model's embedding runs first)."""
    from minivllm.fast import linear as fast_linear

    embed = model.model.embed_tokens
    table = embed.weight
    if (isinstance(embed, fast_linear.VocabParallelEmbedding) and embed.tp_size == 1
            and type(table) in (torch.Tensor, torch.nn.Parameter) and table.dtype == dtype
            and table.is_contiguous()):
        return table
    return None
