"""Quantized matmuls that dequantize in registers: C++ on a CPU.

Read :mod:`minivllm.ref.quantization` first (the formats and the formulas);
this twin reuses its quantizers and storage and changes only the matmul.

What it does differently, and why that is faster:

- **Few rows of x (decode).** The ref dequantizes the whole weight into a
  float32 ``(N, K)`` tensor, then multiplies: it reads the quantized bytes,
  writes 4 bytes a weight and reads them back. The C++ ops
  (``minivllm/fast/csrc/quant.cpp``: ``int8_linear``, ``int4_linear``; their
  AVX2 register tiles are in ``quant_tiles.h``) read each quantized row once,
  widen the integers to float in registers and accumulate ``x . q`` per group,
  applying the scale (and for int4 the minimum times the group's sum of
  ``x``) once per group. Memory traffic is
  the quantized bytes, 1 or 0.75 byte a weight, so at batch 1 the step is up
  to 2-2.7x faster than a bf16 weight read at the same bandwidth.
- **Many rows (prefill).** Arithmetic dominates, and a GEMM library does it
  best: dequantize the weight once into ``x``'s dtype (the C++
  ``dequantize_*`` ops, one threaded pass) and call ``F.linear``.

``GEMV_MAX_ROWS`` is the crossover.

**W8A8** (a weight with ``activations="int8"``): ``quantize_activations``
is one C++ pass per token (``quantize_activations_int8``), and
``w8a8_matmul`` / ``w4a8_matmul`` (``w8a8_linear`` / ``w4a8_linear`` in
``minivllm/fast/csrc/quant_w8a8.cpp``) multiply 32 int8 pairs per
instruction (AVX2 ``vpmaddubsw``, or VNNI ``vpdpbusd`` where the CPU has it,
chosen at run time) instead of widening every weight to float. They give the
ref's bits exactly (the same int32 sums, the same float32 rescale in the same
order), for every number of rows, prefill included: a W8A8 model is W8A8
throughout.

On CUDA (no Triton kernel for this yet) and where the C++ ops did not build,
the ref's matmul runs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from minivllm.fast import cpu_ops
from minivllm.fast.linear_kernel import QUANT_GEMV_MAX_ROWS, projection_kernel
from minivllm.ref import quantization as _ref
from minivllm.ref.quantization import (  # noqa: F401  (re-exported: the ref's names)
    ACT_GROUP_SIZE,
    ACTIVATIONS,
    INT4_GROUP_SIZE,
    METHODS,
    QuantizedActivations,
    QuantizedWeight,
    apply_linear,
    dequantize_int4,
    dequantize_int8,
    int8_gemv,
    pack_int4,
    quantize,
    quantize_int4,
    quantize_int8,
    unpack_int4,
)
from minivllm.ref.quantization import dequantize as ref_dequantize
from minivllm.ref.quantization import quantized_linear as ref_quantized_linear

__all__ = [
    "METHODS", "INT4_GROUP_SIZE", "QuantizedWeight", "quantize", "quantize_int8",
    "dequantize_int8", "int8_gemv", "quantize_int4", "pack_int4", "unpack_int4",
    "dequantize_int4", "dequantize", "quantized_linear", "apply_linear",
    "ACTIVATIONS", "ACT_GROUP_SIZE", "QuantizedActivations", "quantize_activations",
    "w8a8_matmul", "w4a8_matmul",
]

#: Rows of ``x`` up to which the in-register kernels run; above it, dequantize + GEMM
#: (the dispatch rule's number and its measurement: :mod:`minivllm.fast.linear_kernel`).
GEMV_MAX_ROWS = QUANT_GEMV_MAX_ROWS


def _dequantize_runs(weight: QuantizedWeight) -> bool:
    """True if the C++ dequantize ops run ``weight`` (2-D, on a CPU, float32 scales)."""
    return (weight.qweight.dim() == 2 and weight.qweight.device.type == "cpu"
            and cpu_ops.available() and weight.scales.dtype == torch.float32)


def dequantize(weight: QuantizedWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The ``(N, K)`` weight in ``dtype``, from one threaded C++ pass (2-D, on a CPU)."""
    if not _dequantize_runs(weight):
        return ref_dequantize(weight, dtype)
    out = torch.empty(tuple(weight.shape), dtype=dtype)
    if weight.method == "int8":
        cpu_ops.ops().dequantize_int8(out, weight.qweight, weight.scales)
    else:
        cpu_ops.ops().dequantize_int4(out, weight.qweight, weight.scales, weight.mins)
    return out


def quantized_linear(x: torch.Tensor, weight: QuantizedWeight,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x W^T + b`` for a quantized 2-D ``W``: ``x (..., K) -> (..., N)`` in ``x``'s dtype.

    The kernel is :func:`minivllm.fast.linear_kernel.projection_kernel`'s, the
    rule the C++ layer stack follows too; where it names none, the ref's.
    """
    kernel = projection_kernel(weight)
    if isinstance(kernel, str):
        return ref_quantized_linear(x, weight, bias)
    n, k = weight.shape
    if x.shape[-1] != k:
        raise ValueError(f"x must have K = {k} features, got shape {tuple(x.shape)}")
    rows = x.reshape(-1, k)  # (M, K)
    qweight, scales, second, _ = kernel.tensors  # second: int4's mins (int8: scales again)
    if kernel.kind in ("w8a8", "w4a8"):  # integer dot products, any M
        acts = quantize_activations(rows)
        y = (w8a8_matmul(acts, qweight, scales) if kernel.kind == "w8a8"
             else w4a8_matmul(acts, qweight, scales, second))
        if bias is not None:
            y += bias.float()
        return y.to(x.dtype).reshape(*x.shape[:-1], n)
    if rows.shape[0] > kernel.max_rows:  # prefill: the GEMM wins
        return F.linear(x, dequantize(weight, x.dtype), None if bias is None else bias.to(x.dtype))
    out = torch.empty(rows.shape[0], n, dtype=torch.float32)  # (M, N)
    if kernel.kind == "w8a16":
        cpu_ops.ops().int8_linear(out, rows, qweight, scales)
    else:  # w4a16
        cpu_ops.ops().int4_linear(out, rows, qweight, scales, second)
    if bias is not None:
        out += bias.float()
    return out.to(x.dtype).reshape(*x.shape[:-1], n)


# ----------------------------------------------------------------------------- W8A8


def _on_cpu(*tensors: torch.Tensor) -> bool:
    return all(t.device.type == "cpu" for t in tensors) and cpu_ops.available()


def quantize_activations(x: torch.Tensor,
                         group_size: int = ACT_GROUP_SIZE) -> QuantizedActivations:
    """The ref's int8 activations (same bits), in one C++ pass per token on a CPU."""
    if not _on_cpu(x) or x.dim() != 2 or group_size != ACT_GROUP_SIZE \
            or x.shape[-1] % group_size:
        return _ref.quantize_activations(x, group_size)
    m, k = x.shape
    q = torch.empty(m, k, dtype=torch.int8)
    scales = torch.empty(m, k // group_size, dtype=torch.float32)
    sums = torch.empty_like(scales)
    cpu_ops.ops().quantize_activations_int8(q, scales, sums, x)
    return QuantizedActivations(q, scales, sums)


def _native_w8a8(acts: QuantizedActivations, qweight: torch.Tensor, k: int) -> bool:
    return (_on_cpu(acts.q, qweight) and qweight.dim() == 2 and acts.q.dim() == 2
            and acts.q.shape[-1] == k and k % ACT_GROUP_SIZE == 0)


def w8a8_matmul(acts: QuantizedActivations, qweight: torch.Tensor,
                scales: torch.Tensor) -> torch.Tensor:
    """The ref's ``(M, N)`` float32 result, bit for bit, from the C++ integer tiles."""
    if not _native_w8a8(acts, qweight, qweight.shape[-1]):
        return _ref.w8a8_matmul(acts, qweight, scales)
    out = torch.empty(acts.q.shape[0], qweight.shape[0], dtype=torch.float32)
    cpu_ops.ops().w8a8_linear(out, acts.q, acts.scales, qweight, scales.contiguous())
    return out


def w4a8_matmul(acts: QuantizedActivations, qweight: torch.Tensor, scales: torch.Tensor,
                mins: torch.Tensor) -> torch.Tensor:
    """The ref's ``(M, N)`` float32 result, bit for bit, from the C++ integer tiles."""
    if not _native_w8a8(acts, qweight, 2 * qweight.shape[-1]):
        return _ref.w4a8_matmul(acts, qweight, scales, mins)
    out = torch.empty(acts.q.shape[0], qweight.shape[0], dtype=torch.float32)
    cpu_ops.ops().w4a8_linear(out, acts.q, acts.scales, acts.sums, qweight,
                              scales.contiguous(), mins.contiguous())
    return out
