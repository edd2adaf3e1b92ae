"""``QuantizedWeight``: how a quantized weight is stored, shared by every layer that uses one.

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


@dataclass(frozen=True)
class QuantizedWeight:
    """A quantized ``(..., N, K)`` weight; it takes the place of a linear layer's ``weight``.

    Args:
        method: ``"int8"`` or ``"int4"``.
        qweight: int8 ``(..., N, K)``, or uint8 ``(..., N, K // 2)`` (two 4-bit
            values per byte, llama.cpp's order; see :mod:`minivllm.ref.quantization`).
        scales: float32 ``(..., N, K // group_size)``: ``s`` or ``d``.
        mins: float32 ``(..., N, K // group_size)``: ``m`` (int4), else None.
        group_size: weights per scale along ``K``.
        ops: the ``quantization`` component whose ``quantized_linear`` runs
            the matmul (resolved once, when the model is quantized).

    Leading dimensions are the simulated ranks of :mod:`minivllm.ref.linear`;
    ``weight[rank]`` is one rank's weight, as for a float weight.
    """

    method: str
    qweight: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None
    group_size: int
    ops: ModuleType | None = None

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
