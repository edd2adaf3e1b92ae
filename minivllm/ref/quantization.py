"""Weight-only quantization: store each weight in 8 or 4 bits, multiply in float.

What you learn here: why a smaller weight is a faster weight. Decoding one
token reads every weight of the model once and does two flops with each, so a
batch-1 decode step is bound by memory bandwidth, and its time is simply
``weight bytes / read bandwidth``. Halve the bytes per weight and the step
time halves too (``tutorials/09_bytes_per_weight.py`` measures it).

Two formats, the two llama.cpp and vLLM use most (``N`` output features,
``K`` input features, weight ``W`` of shape ``(N, K)``):

**int8, symmetric, one scale per group** (``group_size = K``: one scale per
output channel, vLLM's W8A16; ``group_size = 32``: llama.cpp's ``Q8_0``)::

    s = max_k |W[n, k]| / 127              over the group
    q = clamp(round(W / s), -127, 127)      an int8
    W ~ s * q                               error at most s / 2

**int4, asymmetric, groups of 32** (llama.cpp's ``Q4_1``; ``Q4_0`` is the
special case ``m = -8 d``)::

    m = min W,  d = (max W - min W) / 15    over each group of 32
    q = clamp(round((W - m) / d), 0, 15)    a 4-bit unsigned integer
    W ~ d * q + m                           error at most d / 2

``round`` is ``torch.round``: halfway values go to the even level (llama.cpp
rounds them away from zero, so at an exact tie the two may pick neighbouring
levels; both are within half a step). A group of equal values has ``s = 0`` or
``d = 0``; then ``q = 0`` and the group dequantizes exactly (to 0, or to ``m``).

The matmul needs no new maths: ``y = x W^T`` with ``W`` replaced by its
dequantized value. The fast twin (:mod:`minivllm.fast.quantization`) computes
the same sum without ever writing the float ``W`` to memory: it dequantizes
each group in registers, which is where the bandwidth saving comes from.

Storage (:class:`QuantizedWeight`): ``qweight`` holds the integers (int8, or
two 4-bit values per byte), ``scales`` and ``mins`` one float32 per group. For
4 bits the packing is llama.cpp's: in each group of 32 weights, byte ``j``
holds weight ``j`` in its low nibble and weight ``j + 16`` in its high one, so
the 16 low nibbles of a group are 16 consecutive weights. Bytes per weight:
int8 per channel ~1, int4 ``0.5 + 8/32 = 0.75`` (llama.cpp keeps ``d`` and
``m`` in float16, 0.625; float32 keeps the range of tiny and huge weights).

**W8A8: the activations in int8 too.** Everything above is vLLM's W8A16 (and
W4A16): only the weights are quantized. In W8A8 (and W4A8) each token's
activations are quantized as well, on the fly, exactly like a ``Q8_0`` weight:
one scale per token and group of 32 input features (llama.cpp quantizes ``x``
this way before its ``Q8_0 x Q8_0`` and ``Q4_1 x Q8_1`` dot products)::

    s_x = max_k |x[m, k]| / 127            over the group
    q_x = clamp(round(x * (1 / s_x)), -127, 127)   ties to even; s_x = 0: q_x = 0

Then the matmul is integer dot products, one per group ``g`` of 32, rescaled::

    I[m, n, g] = sum_{k in g} q_x[m, k] * q_w[n, k]                 int32, exact
    y[m, n]    = sum_g (s_x[m, g] * s_w[n, g]) * I[m, n, g]          int8 weights
    y[m, n]    = sum_g ((s_x d)[m, n, g] * I + m[n, g] * sum_x[m, g])   4-bit weights

with ``sum_x = s_x * sum_{k in g} q_x`` (the minimum multiplies the sum of the
dequantized group of ``x``; llama.cpp's ``Q8_1`` blocks store it). The float
part is float32, group after group (``g = 0, 1, ...``), each product and sum
rounded on its own, as written: the fast twin's SIMD kernels follow that order
exactly, so the two are compared bit for bit. Why do it: a CPU multiplies 32
int8 pairs in one instruction (AVX2 ``vpmaddubsw``, VNNI ``vpdpbusd``), far
fewer instructions than widening each weight to float, which matters once
the matmul is compute-bound (a batch-64 decode step), not at batch 1, where
reading the weights is the cost. The price is the rounding of ``x``: up to
``s_x / 2`` on every activation (docs/quantization.md measures it).
"""

from __future__ import annotations

from types import ModuleType

import torch

from minivllm.quantized_weight import (
    ACT_GROUP_SIZE,
    ACTIVATIONS,
    INT4_GROUP_SIZE,
    METHODS,
    QuantizedActivations,
    QuantizedWeight,
)

__all__ = [
    "METHODS", "INT4_GROUP_SIZE", "QuantizedWeight", "quantize", "quantize_int8",
    "dequantize_int8", "int8_gemv", "quantize_int4", "pack_int4", "unpack_int4",
    "dequantize_int4", "dequantize", "quantized_linear", "apply_linear",
    "ACTIVATIONS", "ACT_GROUP_SIZE", "QuantizedActivations", "quantize_activations",
    "w8a8_matmul", "w4a8_matmul",
]

def _this_module() -> ModuleType:
    import sys

    return sys.modules[__name__]


def _check_weight(w: torch.Tensor, group_size: int, what: str) -> None:
    if w.dim() < 2 or not w.is_floating_point():
        raise ValueError(f"{what}: weight must be a float (..., N, K) tensor, "
                         f"got {w.dtype} {tuple(w.shape)}")  # fmt: skip
    k = w.shape[-1]
    if group_size < 1 or k % group_size:
        raise ValueError(
            f"{what}: group_size must divide K = {k} (the input features), got {group_size}"
            + (f"; a 4-bit weight needs K a multiple of {INT4_GROUP_SIZE}"
               if what == "int4" else "")  # fmt: skip
        )


# --------------------------------------------------------------------------
# int8: symmetric, one scale per group (per output channel by default)
# --------------------------------------------------------------------------


def quantize_int8(w: torch.Tensor, group_size: int | None = None) -> QuantizedWeight:
    """``W (..., N, K) -> (q, s)`` with ``W ~ s * q``; ``group_size=None`` means ``K``."""
    group_size = w.shape[-1] if group_size is None else group_size
    _check_weight(w, group_size, "int8")
    *lead, n, k = w.shape
    # BEGIN SOLUTION
    groups = w.float().reshape(*lead, n, k // group_size, group_size)  # (..., N, G, gs)
    scales = groups.abs().amax(dim=-1) / 127  # (..., N, G)
    inverse = torch.where(scales > 0, 1 / scales, 0.0)  # an all-zero group: q = 0
    q = torch.round(groups * inverse.unsqueeze(-1)).clamp(-127, 127)  # (..., N, G, gs)
    qweight = q.to(torch.int8).reshape(*lead, n, k)
    # END SOLUTION
    return QuantizedWeight("int8", qweight, scales, None, group_size)


def dequantize_int8(qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``s * q`` in float32: ``qweight (..., N, K)`` int8, ``scales (..., N, G)``."""
    # BEGIN SOLUTION
    *lead, n, k = qweight.shape
    g = scales.shape[-1]
    q = qweight.float().reshape(*lead, n, g, k // g)  # (..., N, G, gs)
    return (q * scales.unsqueeze(-1)).reshape(*lead, n, k)
    # END SOLUTION


def int8_gemv(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``y = x W^T`` with ``W = s * q``, in float32, never building ``W``.

    ``x (M, K)``, ``qweight (N, K)`` int8, ``scales (N, G)`` -> ``(M, N)``.
    The scale is constant over a group, so it factors out of the group's sum::

        y[m, n] = sum_g s[n, g] * sum_{k in g} x[m, k] * q[n, k]
    """
    n, k = qweight.shape
    g = scales.shape[-1]
    # BEGIN SOLUTION
    xg = x.float().reshape(x.shape[0], g, k // g)  # (M, G, gs)
    qg = qweight.float().reshape(n, g, k // g)  # (N, G, gs)
    partial = torch.einsum("mgk,ngk->mng", xg, qg)  # (M, N, G): one sum per group
    return (partial * scales).sum(dim=-1)  # (M, N)
    # END SOLUTION


# --------------------------------------------------------------------------
# int4: asymmetric, groups of 32, two values per byte
# --------------------------------------------------------------------------


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """``(..., K)`` values in [0, 15] -> ``(..., K // 2)`` uint8, llama.cpp's order.

    In each group of 32, byte ``j`` = ``q[j] | q[j + 16] << 4``.
    """
    *lead, k = q.shape
    g = q.reshape(*lead, k // INT4_GROUP_SIZE, 2, INT4_GROUP_SIZE // 2).to(torch.uint8)
    return (g[..., 0, :] | (g[..., 1, :] << 4)).reshape(*lead, k // 2)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """Undo :func:`pack_int4`: ``(..., K // 2)`` uint8 -> ``(..., K)`` uint8 in [0, 15]."""
    *lead, kh = packed.shape
    b = packed.reshape(*lead, kh // (INT4_GROUP_SIZE // 2), 1, INT4_GROUP_SIZE // 2)
    return torch.cat([b & 0xF, b >> 4], dim=-2).reshape(*lead, kh * 2)


def quantize_int4(w: torch.Tensor, group_size: int = INT4_GROUP_SIZE) -> QuantizedWeight:
    """``W (..., N, K) -> (q, d, m)`` with ``W ~ d * q + m`` per group of 32."""
    if group_size != INT4_GROUP_SIZE:
        raise ValueError(f"int4: group_size must be {INT4_GROUP_SIZE}, got {group_size}")
    _check_weight(w, group_size, "int4")
    *lead, n, k = w.shape
    groups = w.float().reshape(*lead, n, k // group_size, group_size)  # (..., N, G, 32)
    mins = groups.amin(dim=-1)  # (..., N, G)
    scales = (groups.amax(dim=-1) - mins) / 15  # (..., N, G)
    inverse = torch.where(scales > 0, 1 / scales, 0.0)  # a constant group: q = 0, W = m
    q = torch.round((groups - mins.unsqueeze(-1)) * inverse.unsqueeze(-1)).clamp(0, 15)
    qweight = pack_int4(q.reshape(*lead, n, k))  # (..., N, K // 2)
    return QuantizedWeight("int4", qweight, scales, mins, group_size)


def dequantize_int4(qweight: torch.Tensor, scales: torch.Tensor,
                    mins: torch.Tensor) -> torch.Tensor:
    """``d * q + m`` in float32: ``qweight (..., N, K // 2)`` uint8, ``scales/mins (..., N, G)``."""
    q = unpack_int4(qweight).float()  # (..., N, K)
    *lead, n, k = q.shape
    g = scales.shape[-1]
    w = q.reshape(*lead, n, g, k // g) * scales.unsqueeze(-1) + mins.unsqueeze(-1)
    return w.reshape(*lead, n, k)


# --------------------------------------------------------------------------
# W8A8: int8 activations, integer dot products
# --------------------------------------------------------------------------


def quantize_activations(x: torch.Tensor,
                         group_size: int = ACT_GROUP_SIZE) -> QuantizedActivations:
    """``x (M, K) -> (q, s, sum)``, int8 per token and group of 32: ``x ~ s * q``.

    The same formula as a ``Q8_0`` weight (:func:`quantize_int8` with
    ``group_size=32``): ``s = max |x| / 127``, ``q = round(x * (1 / s))``, the
    product rounded to float32 first, then to the nearest integer, ties to
    even (llama.cpp's AVX2 path rounds the same way; its plain C loop rounds
    ties away from zero). ``sum = s * sum(q)`` per group, for 4-bit weights.
    """
    if x.dim() != 2 or group_size != ACT_GROUP_SIZE or x.shape[-1] % group_size:
        raise ValueError(f"x must be (M, K) with K a multiple of {ACT_GROUP_SIZE} and "
                         f"group_size {ACT_GROUP_SIZE}, got shape {tuple(x.shape)} and "
                         f"group_size {group_size}")
    q = quantize_int8(x.float(), group_size)  # qweight (M, K) int8, scales (M, G)
    m, k = x.shape
    group_q = q.qweight.float().reshape(m, k // group_size, group_size)  # (M, G, 32)
    sums = q.scales * group_q.sum(dim=-1)  # exact integer sums (|sum| <= 32 * 127)
    return QuantizedActivations(q.qweight, q.scales, sums)


def _group_dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a (M, 32) . b (N, 32)^T`` for small integers: an exact int32 ``(M, N)``."""
    if a.device.type == "cpu":
        return a.to(torch.int32) @ b.to(torch.int32).T
    # torch has no int32 matmul on CUDA; float64 holds each of these sums exactly
    return (a.double() @ b.double().T).to(torch.int32)


def _check_acts(acts: QuantizedActivations, k: int) -> tuple[int, int]:
    m, kx = acts.q.shape
    if kx != k or k % ACT_GROUP_SIZE:
        raise ValueError(f"activations must have K = {k} features, a multiple of "
                         f"{ACT_GROUP_SIZE}; got shape {tuple(acts.q.shape)}")
    return m, k // ACT_GROUP_SIZE


def w8a8_matmul(acts: QuantizedActivations, qweight: torch.Tensor,
                scales: torch.Tensor) -> torch.Tensor:
    """``y = x W^T`` from int8 ``x`` and int8 ``W``: integer dot products, then a rescale.

    ``acts`` (``(M, K)``, from :func:`quantize_activations`), ``qweight (N, K)``
    int8 in [-127, 127], ``scales (N, G_w)``, ``K / G_w`` a multiple of 32 ->
    ``(M, N)`` float32::

        I[m, n, g] = sum_{k in g} q_x[m, k] q_w[n, k]       int32 (|I| <= 32 * 127^2)
        y[m, n]    = sum_g (s_x[m, g] * s_w[n, g]) * I[m, n, g]

    summed in float32 group after group, each product and sum rounded as written.
    """
    n, k = qweight.shape
    m, groups = _check_acts(acts, k)
    # one weight scale per activation group (a per-channel scale, repeated)
    s_w = scales.float().repeat_interleave(groups // scales.shape[-1], dim=-1)  # (N, G)
    y = torch.zeros(m, n, dtype=torch.float32, device=qweight.device)
    for g in range(groups):
        cols = slice(g * ACT_GROUP_SIZE, (g + 1) * ACT_GROUP_SIZE)
        dots = _group_dot(acts.q[:, cols], qweight[:, cols])  # (M, N) int32
        y = y + (acts.scales[:, g, None] * s_w[None, :, g]) * dots.float()  # exact: < 2^24
    return y


def w4a8_matmul(acts: QuantizedActivations, qweight: torch.Tensor, scales: torch.Tensor,
                mins: torch.Tensor) -> torch.Tensor:
    """``y = x W^T`` from int8 ``x`` and 4-bit ``W = d q + m``: llama.cpp's ``Q4_1 x Q8_1``.

    ``qweight (N, K // 2)`` packed, ``scales``/``mins (N, K // 32)`` -> ``(M, N)`` float32::

        y[m, n] = sum_g ((s_x[m, g] * d[n, g]) * I[m, n, g] + m[n, g] * sum_x[m, g])

    ``I`` the int32 dot product of ``q_x`` and ``q`` (0..15) over group ``g``;
    float32, group after group, each product and sum rounded as written.
    """
    q = unpack_int4(qweight)  # (N, K) in 0..15
    n, k = q.shape
    m, groups = _check_acts(acts, k)
    scales, mins = scales.float(), mins.float()  # float16 ones (a GGUF's) widen exactly
    y = torch.zeros(m, n, dtype=torch.float32, device=qweight.device)
    for g in range(groups):
        cols = slice(g * ACT_GROUP_SIZE, (g + 1) * ACT_GROUP_SIZE)
        dots = _group_dot(acts.q[:, cols], q[:, cols])  # (M, N) int32
        term = (acts.scales[:, g, None] * scales[None, :, g]) * dots.float()
        y = y + (term + mins[None, :, g] * acts.sums[:, g, None])
    return y


# --------------------------------------------------------------------------
# Either format
# --------------------------------------------------------------------------


def quantize(w: torch.Tensor, method: str) -> QuantizedWeight:
    """Quantize a float ``(..., N, K)`` weight with ``method`` (``"int8"`` or ``"int4"``)."""
    if method == "int8":
        return quantize_int8(w)
    if method == "int4":
        return quantize_int4(w)
    raise ValueError(f"quantization method must be one of {METHODS}, got {method!r}")


def dequantize(weight: QuantizedWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The ``(..., N, K)`` weight that ``weight`` stands for, computed in float32, in ``dtype``."""
    if weight.method == "int8":
        return dequantize_int8(weight.qweight, weight.scales).to(dtype)
    return dequantize_int4(weight.qweight, weight.scales, weight.mins).to(dtype)


def quantized_linear(x: torch.Tensor, weight: QuantizedWeight,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x W^T + b`` for a quantized 2-D ``W``: ``x (..., K) -> (..., N)`` in ``x``'s dtype.

    The textbook way: with float activations (W8A16 / W4A16), int8 through
    :func:`int8_gemv` and int4 dequantized, then an ordinary float32 matmul;
    with ``weight.activations == "int8"`` (W8A8 / W4A8), ``x`` quantized by
    :func:`quantize_activations`, then :func:`w8a8_matmul` / :func:`w4a8_matmul`.
    """
    n, k = weight.shape
    if x.shape[-1] != k:
        raise ValueError(f"x must have K = {k} features, got shape {tuple(x.shape)}")
    if weight.activations == "int8":  # W8A8 / W4A8
        acts = quantize_activations(x.reshape(-1, k))
        y = (w8a8_matmul(acts, weight.qweight, weight.scales) if weight.method == "int8"
             else w4a8_matmul(acts, weight.qweight, weight.scales, weight.mins))
        y = y.reshape(*x.shape[:-1], n)
    elif weight.method == "int8":
        y = int8_gemv(x.reshape(-1, k), weight.qweight, weight.scales).reshape(*x.shape[:-1], n)
    else:
        y = x.float() @ dequantize(weight).T  # (..., N)
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def apply_linear(x: torch.Tensor, weight: torch.Tensor | QuantizedWeight,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x W^T + b`` for a float weight (``F.linear``) or a :class:`QuantizedWeight`.

    The one place a linear layer learns that its weight may be quantized: a
    quantized weight carries the component that multiplies with it (one made
    without, by this module's quantizers, multiplies here).
    """
    if isinstance(weight, QuantizedWeight):
        ops = weight.ops if weight.ops is not None else _this_module()
        return ops.quantized_linear(x, weight, bias)
    return torch.nn.functional.linear(x, weight, bias)
