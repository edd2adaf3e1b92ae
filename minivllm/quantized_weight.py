"""``QuantizedWeight``: how a quantized weight is stored, shared by every layer that uses one
(and ``QuantizedActivations``, what a W8A8 matmul multiplies it by).

A neutral module: the ``quantization`` component's twins make these
(:mod:`minivllm.ref.quantization` explains the formats and the formulas), the
linear layers of either ``linear`` twin multiply with them, the model's
loader builds them from a GGUF file, and the fast model runner hands their
tensors to the C++ layer stack. None of those should import another's
twin to learn the type, so it lives here, below all of them.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from types import ModuleType

import torch

#: The ``quantization=`` values that quantize float weights at load.
METHODS = ("int8", "int4")
#: Weights per group of the 4-bit format (llama.cpp's ``QK4_1``).
INT4_GROUP_SIZE = 32
#: What the activations a quantized weight multiplies are: ``"float"`` (vLLM's W8A16 /
#: W4A16: only the weights are quantized) or ``"int8"`` (W8A8 / W4A8: the activations
#: are quantized too, per token and group of :data:`ACT_GROUP_SIZE`, and the matmul is
#: integer dot products; see :mod:`minivllm.ref.quantization`).
ACTIVATIONS = ("float", "int8")
#: Input features per activation scale with ``activations="int8"`` (llama.cpp's ``QK8_0``).
ACT_GROUP_SIZE = 32


@dataclass(frozen=True)
class QuantizedWeight:
    """A quantized ``(..., N, K)`` weight; it takes the place of a linear layer's ``weight``.

    Args:
        method: ``"int8"`` or ``"int4"``.
        qweight: int8 ``(..., N, K)``, or uint8 ``(..., N, K // 2)`` (two 4-bit
            values per byte, llama.cpp's order; see :mod:`minivllm.ref.quantization`).
        scales: float32 ``(..., N, K // group_size)``: ``s`` or ``d``; float16 where
            a GGUF's blocks hold them so and ``activations="int8"`` (the integer
            kernels widen them exactly).
        mins: ``(..., N, K // group_size)``, the dtype of ``scales``: ``m`` (int4), else None.
        group_size: weights per scale along ``K``.
        ops: the ``quantization`` component whose ``quantized_linear`` runs
            the matmul (resolved once, when the model is quantized).
        activations: ``"float"`` (W8A16 / W4A16, the default) or ``"int8"``
            (W8A8 / W4A8: ``quantized_linear`` quantizes ``x`` per token and group
            of 32 and multiplies integers; needs ``K`` and the groups multiples of 32).

    Leading dimensions are the simulated ranks of :mod:`minivllm.ref.linear`;
    ``weight[rank]`` is one rank's weight, as for a float weight.
    """

    method: str
    qweight: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None
    group_size: int
    ops: ModuleType | None = None
    activations: str = "float"

    def __post_init__(self) -> None:
        if self.activations not in ACTIVATIONS:
            raise ValueError(f"activations must be one of {ACTIVATIONS}, "
                             f"got {self.activations!r}")
        if self.activations == "int8" and self.group_size % ACT_GROUP_SIZE:
            raise ValueError(f"activations='int8' needs the weight's groups (and K) to be "
                             f"multiples of {ACT_GROUP_SIZE}, got group_size={self.group_size} "
                             f"(K = {self.shape[-1]})")

    @property
    def scheme(self) -> str:
        """vLLM's name for what is quantized: ``"W8A16"``, ``"W4A16"``, ``"W8A8"`` or ``"W4A8"``."""
        bits = 8 if self.method == "int8" else 4
        return f"W{bits}A{8 if self.activations == 'int8' else 16}"

    @property
    def shape(self) -> torch.Size:
        """``(..., N, K)``: the shape of the float weight it stands for."""
        *lead, n, kq = self.qweight.shape
        return torch.Size((*lead, n, kq * 2 if self.method == "int4" else kq))

    @property
    def nbytes(self) -> int:
        """Bytes it occupies (integers, scales and mins)."""
        return sum(t.numel() * t.element_size()
                   for t in (self.qweight, self.scales, self.mins) if t is not None)

    def __getitem__(self, index: int) -> QuantizedWeight:
        mins = None if self.mins is None else self.mins[index]
        return replace(self, qweight=self.qweight[index], scales=self.scales[index], mins=mins)


@dataclass(frozen=True)
class QuantizedActivations:
    """Activations quantized per token and group of 32 input features (llama.cpp's ``Q8_1``).

    ``x (M, K) ~ scales * q`` group by group. Made by ``quantize_activations``
    of either ``quantization`` twin (:mod:`minivllm.ref.quantization` has the formula).

    Args:
        q: int8 ``(M, K)``, in [-127, 127].
        scales: float32 ``(M, K // 32)``: ``s_x = max |x| / 127`` of each group.
        sums: float32 ``(M, K // 32)``: ``s_x * sum(q)`` of each group, the term a
            4-bit weight's minimum multiplies (llama.cpp's ``Q8_1`` keeps it too).
    """

    q: torch.Tensor
    scales: torch.Tensor
    sums: torch.Tensor
