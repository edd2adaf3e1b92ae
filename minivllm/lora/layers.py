"""The LoRA delta in a model's forward: a hook on each of its fused projections.

vLLM wraps each projection in a ``*WithLoRA`` layer whose forward adds the
step's adapters after the base matmul; here the same happens through PyTorch
forward hooks, so the model's module tree, its weights and the C++ layer
stack's view of them stay exactly as they are. :func:`add_lora_hooks` puts one
hook on every ``qkv_proj``, ``o_proj``, ``gate_up_proj`` and ``down_proj`` of
the layers a worker holds; each reads the step's
:class:`~minivllm.lora.manager.LoRABatch` from a :class:`LoRAContext` that the
worker sets before every forward (None: no adapter in this step, the hooks
do nothing) and adds, in place::

    y[t] += scaling_s * (x[t] A_s^T) B_s^T      s = the slot of token t's adapter

through the swap layer's ``lora`` component (``add_lora``: a loop in the
ref, a segmented kernel in the fast twin). A fused projection stays fused:
its output slices (q, k, v; gate, up) each get their own adapter's delta.

**Tensor parallelism.** A column-parallel projection (qkv, gate_up) gives
this rank's output columns; the manager holds the matching rows of ``B``.
A row-parallel one (o, down) sums partial products over ranks: the delta must
join the partial sum *before* the all-reduce (each rank adds ``(x_r A_r^T)
B^T`` for its input shard ``x_r``, the all-reduce adds them up), which the
fast linear twin's ``add_to_partial`` hook point is for. Where one process
computes the whole output (``ref.linear``, or ``tp_size=1``) the hook adds
after the forward.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any

import torch

PROJECTIONS = MappingProxyType({"self_attn": ("qkv_proj", "o_proj"), "mlp": ("gate_up_proj", "down_proj")})
ROW_PARALLEL = frozenset({"o_proj", "down_proj"})


class LoRAContext:
    """The step's adapters, as the hooks read them: set by the worker before each forward."""

    def __init__(self) -> None:
        self.batch = None  # a LoRABatch, or None: no adapter in this step


def add_lora_hooks(model: torch.nn.Module, context: LoRAContext, ops: Any) -> list[Any]:
    """Hook every fused projection of the decoder layers ``model`` holds; return the handles.

    ``ops`` is the engine's ``lora`` component (its ``add_lora``).
    """
    inner = model.model
    handles = []
    for index in range(inner.start_layer, inner.end_layer):
        layer = inner.layers[index]
        for part, names in PROJECTIONS.items():
            for name in names:
                module = getattr(getattr(layer, part), name)
                delta = _Delta(context, ops, index, name)
                if name in ROW_PARALLEL and getattr(module, "tp_size", 1) > 1 \
                        and hasattr(module, "add_to_partial"):
                    module.add_to_partial = delta  # before the all-reduce
                    handles.append(_Unset(module))
                else:
                    handles.append(module.register_forward_hook(delta.hook))
    return handles


class _Delta:
    """One projection's LoRA delta for the current step."""

    def __init__(self, context: LoRAContext, ops: Any, layer: int, projection: str) -> None:
        self.context, self.ops, self.layer, self.projection = context, ops, layer, projection

    def __call__(self, y: torch.Tensor, x: torch.Tensor) -> None:  # y (T, out) += delta(x)
        batch = self.context.batch
        if batch is None or not batch.mapping.slots:
            return
        s = batch.stack(self.layer, self.projection)
        self.ops.add_lora(y, x, s.lora_a, s.lora_b, s.scalings, batch.mapping, s.output_slices)

    def hook(self, module: torch.nn.Module, inputs: tuple, output: torch.Tensor) -> torch.Tensor:
        """A forward hook: the projection's whole output gets its delta."""
        self(output, inputs[0])
        return output


class _Unset:
    """A handle that removes an ``add_to_partial`` hook (as a hook handle's ``remove``)."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module

    def remove(self) -> None:
        self.module.add_to_partial = None


__all__ = ["LoRAContext", "PROJECTIONS", "add_lora_hooks"]
