"""The LoRA delta in a model's forward: one :class:`ProjectionLoRA` beside each fused projection.

vLLM wraps each projection in a ``*WithLoRA`` layer (``BaseLayerWithLoRA``) that
holds the stacked adapter weights of every slot and, in its forward, adds the
step's adapters after the base matmul. Here each projection of
:class:`~minivllm.model.llama.LlamaAttention` and :class:`~minivllm.model.llama.LlamaMLP`
gets a :class:`ProjectionLoRA` beside it (``qkv_lora`` beside ``qkv_proj``, ...),
so the projection's module tree and its weights stay exactly as they are, and
the model's forward says where the delta goes::

    qkv = self.qkv_lora(self.qkv_proj, hidden, lora)   # qkv_proj(hidden) + each token's delta

That call is the base projection, then, in place::

    y[t] += scaling_s * (x[t] A_s^T) B_s^T      s = the slot of token t's adapter

through the swap layer's ``lora`` component (``add_lora``: a loop in the ref, a
segmented kernel in the fast twin). A fused projection stays fused: its output
slices (q, k, v; gate, up) each get their own adapter's delta.

**Two halves, like vLLM's.** The adapters' weights are the model's: the stacks of a
:class:`~minivllm.lora.manager.LoRAManager` (every slot's ``A``, ``B^T`` and
scaling), given to each projection once by :func:`enable_lora`; the manager fills
slots *in place*, so those tensors never change. What changes per step is only
which slot each token uses: the step's :class:`~minivllm.lora.mapping.LoRAMapping`
(vLLM's ``PunicaWrapper`` state), passed to the forward as an argument
(``ModelInput.lora``; None: no token has an adapter). Because the weights are
bound once, the fast model runner's C++ layer stack binds them once too and adds
the same deltas with the same op (:mod:`minivllm.fast.model_runner`).

**Tensor parallelism.** A column-parallel projection (qkv, gate_up) gives
this rank's output columns; the manager holds the matching rows of ``B``.
A row-parallel one (o, down) sums partial products over ranks: the delta must
join the partial sum *before* the all-reduce (each rank adds ``(x_r A_r^T)
B^T`` for its input shard ``x_r``, the all-reduce adds them up). The fast linear
twin splits its forward there (``_partial_sum``, then ``_reduce``). Where one
process computes the whole output (``ref.linear``, or ``tp_size=1``) the delta
is added after the forward.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any

import torch

from minivllm.lora.mapping import LoRAMapping

PROJECTIONS = MappingProxyType({"self_attn": ("qkv_proj", "o_proj"), "mlp": ("gate_up_proj", "down_proj")})
ROW_PARALLEL = frozenset({"o_proj", "down_proj"})


class ProjectionLoRA:
    """One fused projection's LoRA: its stacks (set by :func:`enable_lora`) and the delta.

    Args:
        projection: the fused projection's name (``"qkv_proj"``, ``"o_proj"``, ...).
        ops: the engine's ``lora`` component (its ``add_lora``).

    Attributes:
        stack: the :class:`~minivllm.lora.manager.LoRAStack` of this projection in
            this layer, or None: LoRA is off (the forward is the projection alone).
    """

    def __init__(self, projection: str, ops: Any) -> None:
        self.projection, self.ops = projection, ops
        self.row_parallel = projection in ROW_PARALLEL
        self.stack = None

    def __call__(self, proj: torch.nn.Module, x: torch.Tensor,
                 lora: LoRAMapping | None) -> torch.Tensor:  # (T, in) -> (T, out)
        """``proj(x)`` plus each token's adapter delta (``lora``: the step's token -> slot)."""
        if lora is None or not lora.slots:  # no token of this step has an adapter
            return proj(x)
        if self.stack is None:
            raise ValueError(f"{self.projection}: a LoRA mapping, but LoRA is not enabled "
                             "(enable_lora)")
        if self.row_parallel and getattr(proj, "tp_size", 1) > 1 \
                and hasattr(proj, "_partial_sum"):  # real ranks: join the partial sum
            y, x_rank = proj._partial_sum(x)  # (T, out): this rank's, before the all-reduce
            self.add(y, x_rank, lora)
            return proj._reduce(y)
        y = proj(x)
        self.add(y, x, lora)
        return y

    def add(self, y: torch.Tensor, x: torch.Tensor, lora: LoRAMapping) -> None:
        """``y += delta(x)`` in place, each token with its own slot's adapter."""
        s = self.stack
        self.ops.add_lora(y, x, s.lora_a, s.lora_b, s.scalings, lora, s.output_slices)


def projection_loras(model: torch.nn.Module) -> list[tuple[int, str, ProjectionLoRA]]:
    """``(layer index, projection name, its ProjectionLoRA)`` for every projection the
    decoder layers of ``model`` hold, in forward order."""
    inner = model.model
    out = []
    for index in range(inner.start_layer, inner.end_layer):
        layer = inner.layers[index]
        for part, names in PROJECTIONS.items():
            for name in names:
                out.append((index, name, getattr(getattr(layer, part), name[:-5] + "_lora")))
    return out


def enable_lora(model: torch.nn.Module, stacks: Any) -> None:
    """Give every projection of ``model`` its stacks (a manager's ``stacks``: per decoder
    layer, projection name -> :class:`~minivllm.lora.manager.LoRAStack`), once.

    The model then declares ``"lora"`` among its features: a fast path that has not
    learnt to add the deltas steps aside (:mod:`minivllm.fast.model_runner`).
    """
    for index, name, lora in projection_loras(model):
        lora.stack = stacks[index][name]
    model.features = model.features | {"lora"}


__all__ = ["LoRAMapping", "PROJECTIONS", "ProjectionLoRA", "enable_lora", "projection_loras"]
