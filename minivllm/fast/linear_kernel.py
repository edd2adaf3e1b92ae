"""Which C++ kernel multiplies a projection's weight on a CPU: the one dispatch rule.

A projection's weight is float32 / bf16, or an int8 / int4
:class:`~minivllm.quantized_weight.QuantizedWeight` with float or int8
activations. Two places need to know which C++ op multiplies it: the linear
forward (:func:`minivllm.fast.linear.linear` and
:func:`minivllm.fast.quantization.quantized_linear`, one projection at a
time) and the C++ layer stack (:class:`minivllm.fast.model_runner.LayerStack`,
which packs every projection of the model once and calls the same ops from
C++). Both ask :func:`projection_kernel`, so they cannot drift apart: a
weight the linear forward would send to the ref, the layer stack refuses.

The kinds are named, never numbered here: ``layer_stack.cpp`` holds the one
numbering and exports it (``torch.ops.minivllm.decode_layers_kinds()``, the
names in index order); :func:`kind_numbers` reads it.

A helper of the ``linear`` component's fast twin, with no ref twin: the ref
has no kernels to choose between.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minivllm.fast.linear_prepack import PANEL_MAX_ROWS, PanelWeight
from minivllm.quantized_weight import QuantizedWeight

__all__ = ["KINDS", "ProjectionKernel", "projection_kernel", "kind_numbers"]

#: Every kind :func:`projection_kernel` returns: float32 / bf16 weights (the small-M
#: GEMV), W8A16, W4A16 (dequantize in registers), W8A8, W4A8 (integer dot products).
#: ``tests/test_linear_kernel.py`` checks that the C++ layer stack knows the same names.
KINDS = ("float", "w8a16", "w4a16", "w8a8", "w4a8")

#: Token rows up to which a float linear on a CPU runs the C++ GEMV (above: oneDNN/MKL).
FLOAT_GEMV_MAX_ROWS = 16

#: Rows of ``x`` up to which the W8A16 / W4A16 in-register kernels run; above it,
#: dequantize + GEMM. Measured on a 2-core AVX2 EPYC (2 threads): at 64 rows the kernels
#: took 3.3 ms against 6.7 ms for dequantize + GEMM on a 3072 x 576 int8 weight (51
#: against 191 ms on the 49152 x 576 LM head, whose dequantized copy alone is 113 MB);
#: about 128 rows is where the two meet, and by 256-512 the GEMM wins. A batch-64 decode
#: step therefore stays on the kernels; a prefill chunk takes the GEMM.
QUANT_GEMV_MAX_ROWS = 128


@dataclass(frozen=True)
class ProjectionKernel:
    """The C++ kernel for one weight, and the tensors it reads.

    Attributes:
        kind: one of :data:`KINDS`.
        tensors: ``(weight, weight, weight, weight)`` for a float weight
            (``(weight, panels, weight, weight)`` with panels), ``(qweight, scales,
            scales, packed)`` for int8 and ``(qweight, scales, mins, packed)`` for
            int4 (``packed``: with int8 activations, the weight prepacked for one row
            of ``x`` by :func:`~minivllm.fast.linear_prepack.prepack_w8a8` /
            :func:`~minivllm.fast.linear_prepack.prepack_w4a8`, where the layer has it;
            else ``qweight`` again): four a projection, as the layer stack packs them
            (the repeats are placeholders its kernels do not read).
        max_rows: rows of ``x`` up to which this kernel beats the GEMM path
            (dequantize, or the float weight as it is, then ``F.linear``); None
            where the kernel serves any number of rows (W8A8 / W4A8: the integer
            matmul is W8A8 throughout).
    """

    kind: str
    tensors: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
    max_rows: int | None


def projection_kernel(weight: torch.Tensor | QuantizedWeight,
                      packed: PanelWeight | torch.Tensor | None = None) -> ProjectionKernel | str:
    """The :class:`ProjectionKernel` that multiplies ``weight``, or why none does (a string).

    ``packed``: the layer's prepacked copy (:func:`~minivllm.fast.linear_prepack.prepack_weight`;
    for a W4A8 weight, the copy one row of ``x`` reads in the layer stack).
    A float32 weight with :class:`~minivllm.fast.linear_prepack.PanelWeight` panels runs
    the GEMV up to :data:`FLOAT_GEMV_MAX_ROWS` rows and the panel GEMM above, to
    :data:`~minivllm.fast.linear_prepack.PANEL_MAX_ROWS` (the layer stack's rule, and the
    linear forward's: :func:`minivllm.fast.linear.linear`); without ``packed`` the
    kernel is the GEMV alone.

    Where none does, the linear forward takes the ref's (or ``F.linear``'s)
    path and the layer stack does not run. (Whether the fast twin multiplies a
    quantized weight at all, its ``ops``, is the caller's business: the layer
    stack checks it, ``quantized_linear`` is the fast twin.)
    """
    from minivllm.fast import cpu_ops

    if isinstance(weight, QuantizedWeight):
        q = weight.qweight
        if q.dim() != 2 or weight.method not in ("int8", "int4"):
            return f"a {weight.method} quantized weight of {q.dim()} dimensions"
        if q.device.type != "cpu" or not cpu_ops.available():
            return "a quantized weight off the CPU or without the C++ ops"
        second = weight.scales if weight.method == "int8" else weight.mins
        prepacked = packed if isinstance(packed, torch.Tensor) else q
        tensors = (q, weight.scales, second, prepacked)
        if weight.activations == "int8":  # integer dot products, any number of rows
            return ProjectionKernel("w8a8" if weight.method == "int8" else "w4a8", tensors, None)
        if weight.scales.dtype != torch.float32:  # the W8A16 / W4A16 kernels read float32
            return "a float-activation quantized weight with float16 scales"
        return ProjectionKernel("w8a16" if weight.method == "int8" else "w4a16", tensors,
                                QUANT_GEMV_MAX_ROWS)
    if weight.device.type != "cpu":  # every CUDA linear asks: no string formatting
        return "a weight off the CPU"
    if (weight.dim() != 2 or not weight.is_contiguous()
            or weight.dtype not in (torch.float32, torch.bfloat16)):
        return f"a {weight.dtype} {tuple(weight.shape)} weight"
    if not cpu_ops.available():
        return "the C++ ops did not build"
    if isinstance(packed, PanelWeight):  # the GEMV, then the panel GEMM above its rows
        return ProjectionKernel("float", (weight, packed.panels, weight, weight), PANEL_MAX_ROWS)
    return ProjectionKernel("float", (weight, weight, weight, weight), FLOAT_GEMV_MAX_ROWS)


def kind_numbers() -> dict[str, int]:
    """``kind -> the number decode_layers reads``, from the C++ layer stack's own table."""
    from minivllm.fast import cpu_ops

    return {name: i for i, name in enumerate(cpu_ops.ops().decode_layers_kinds())}
