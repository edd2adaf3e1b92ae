"""A decode step's whole layer stack in one C++ call (``torch.ops.minivllm.decode_layers``).

What you learn here: the last step of taking the Python out of a small model's
decode step. :class:`~minivllm.engine.cpu_fast_path.CPUFastPath` already runs
the layers as one flat loop over the C++ ops; this runs that same loop in C++
(``minivllm/fast/csrc/layer_stack.cpp``), so a step pays one Python call and one
dispatch instead of about ten per layer.

It applies where every projection would take a C++ op anyway: few rows (at
most :data:`minivllm.fast.linear.GEMV_MAX_ROWS` for float weights and
:data:`minivllm.fast.quantization.GEMV_MAX_ROWS` for quantized ones), one
rank, no bias, and weights the fast twins serve with their C++ kernels (float32
or bf16 matrices, or int8 / int4 :class:`~minivllm.ref.quantization.QuantizedWeight`
made by the fast quantization component). :meth:`LayerStack.build` checks that
once and returns None otherwise; a prefill (many rows) keeps the Python loop.
The C++ loop calls the same functions on the same inputs in the same order, so
the hidden states are bit for bit the Python loop's
(``tests/test_cpu_fast_path.py``).
"""

from __future__ import annotations

import torch

from minivllm.ref.quantization import QuantizedWeight

#: ``kinds`` values, as ``layer_stack.cpp`` reads them.
FLOAT_WEIGHT, INT8_WEIGHT, INT4_WEIGHT = 0, 1, 2
_PROJECTIONS = (("self_attn", "qkv_proj"), ("self_attn", "o_proj"),
                ("mlp", "gate_up_proj"), ("mlp", "down_proj"))  # fmt: skip


def _projection(layer: torch.nn.Module) -> tuple[int, list[torch.Tensor]] | str:
    """``(kind, [weight, scales, mins])`` for one projection, or why the C++ loop can't run it."""
    from minivllm.fast import linear as fast_linear
    from minivllm.fast import quantization as fast_quantization

    if not isinstance(layer, (fast_linear.ColumnParallelLinear, fast_linear.RowParallelLinear)):
        return f"{type(layer).__name__} is not the fast linear twin"
    if layer.tp_size != 1 or getattr(layer, "gather_output", False):
        return "tensor parallel"
    if layer.bias is not None:
        return "a projection has a bias"
    w = layer.weight
    if isinstance(w, QuantizedWeight):
        if w.ops is not fast_quantization or w.qweight.dim() != 2 or w.method not in ("int8", "int4"):
            return "a quantized weight not served by the fast quantization twin"
        if w.method == "int8":
            return INT8_WEIGHT, [w.qweight, w.scales, w.scales]
        return INT4_WEIGHT, [w.qweight, w.scales, w.mins]
    if (w.device.type != "cpu" or w.dim() != 2 or not w.is_contiguous()
            or w.dtype not in (torch.float32, torch.bfloat16)):
        return f"a {w.dtype} {tuple(w.shape)} weight"
    return FLOAT_WEIGHT, [w, w, w]  # scales, mins: unused placeholders


class LayerStack:
    """The arguments of ``decode_layers`` that do not change between steps, bound once."""

    def __init__(self, kinds: list[int], weights: list[torch.Tensor], norms: list[torch.Tensor],
                 eps: list[float], kv_caches) -> None:
        from minivllm.fast import cpu_ops
        from minivllm.fast import linear as fast_linear
        from minivllm.fast import quantization as fast_quantization

        self.kinds, self.weights, self.norms, self.eps = kinds, weights, norms, eps
        self.k_caches = [k for k, _ in kv_caches]
        self.v_caches = [v for _, v in kv_caches]
        limits = {FLOAT_WEIGHT: fast_linear.GEMV_MAX_ROWS,
                  INT8_WEIGHT: fast_quantization.GEMV_MAX_ROWS,
                  INT4_WEIGHT: fast_quantization.GEMV_MAX_ROWS}
        #: Most rows (tokens in a step) for which every projection is a GEMV.
        self.max_rows = min(limits[k] for k in kinds)
        self._op = cpu_ops.ops().decode_layers.default

    @classmethod
    def why_not(cls, layers, kv_caches) -> str | None:
        """None if :meth:`build` succeeds for these layers; otherwise the reason."""
        built = cls._collect(layers, kv_caches)
        return built if isinstance(built, str) else None

    @classmethod
    def build(cls, layers, kv_caches) -> LayerStack | None:
        """The stack for ``layers`` (decoder layers) over ``kv_caches``, or None."""
        built = cls._collect(layers, kv_caches)
        return None if isinstance(built, str) else cls(*built, kv_caches)

    @staticmethod
    def _collect(layers, kv_caches):
        kinds: list[int] = []
        weights: list[torch.Tensor] = []
        norms: list[torch.Tensor] = []
        eps: list[float] = []
        for layer in layers:
            for module, name in _PROJECTIONS:
                got = _projection(getattr(getattr(layer, module), name))
                if isinstance(got, str):
                    return got
                kinds.append(got[0])
                weights += got[1]
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                norms.append(norm.weight)
                eps.append(float(norm.eps))
        if len(layers) != len(kv_caches):
            return "one KV cache a layer"
        return kinds, weights, norms, eps

    def run(self, hidden, residual, positions, slot_mapping, block_tables, seq_lens,
            query_start_loc, cos_sin_cache, is_neox, num_heads, num_kv_heads, head_dim,
            scale) -> None:
        """Every layer of one step: updates ``hidden``/``residual`` and the KV caches in place."""
        self._op(hidden, residual, positions, slot_mapping, block_tables, seq_lens,
                 query_start_loc, cos_sin_cache, is_neox, self.norms, self.eps, self.weights,
                 self.kinds, self.k_caches, self.v_caches, num_heads, num_kv_heads, head_dim,
                 scale)
