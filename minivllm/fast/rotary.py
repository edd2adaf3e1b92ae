"""Rotary position embedding (RoPE) applied in place by one kernel: Triton or C++.

What you learn here: working on *pairs* of features with two sets of offsets
into the same row, and writing the result back in place. Feature pairs are
``(i, i + rotary_dim/2)`` in the NeoX style and ``(2i, 2i + 1)`` in the GPT-J
style; each pair is rotated by the angle ``position * inv_freq[i]``, whose
cosine and sine are read from ``cos_sin_cache[position]``
(``[cos | sin]``, ``rotary_dim`` floats). Features past ``rotary_dim`` are
left alone (partial rotary, e.g. GPT-NeoX / Phi).

The ref twin (:mod:`minivllm.ref.rotary`) gathers the cos/sin rows, splits,
upcasts, rotates and concatenates with torch ops: memory traffic of about
``6 * T * (H + H_kv) * D`` element moves over a dozen launches, plus two new
output tensors. The kernel reads each query/key element once and writes the
rotated features back once (``2 * T * (H + H_kv) * rotary_dim``), reads
``T * rotary_dim`` cos/sin floats, in one launch, and allocates nothing.

Launch grid: ``(num_tokens,)``. One program rotates all query heads and all
key heads of one token as ``[heads, rotary_dim/2]`` tiles, so the token's
cos/sin row is loaded once and shared by every head.

On a CPU the same in-place rotation is the C++ op
``torch.ops.minivllm.rotary_embedding`` (``minivllm/fast/csrc/rotary.cpp``), one
token per loop iteration, tokens spread over threads. :func:`apply_rotary_emb`
picks the realisation from the tensor's device.
"""

from __future__ import annotations

import torch

from minivllm.fast import cpu_ops
from minivllm.ref import rotary as ref_rotary

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton wheels off Linux: the C++ CPU path still works
    from minivllm.fast._no_triton import tl, triton

__all__ = ["apply_rotary_emb"]


@triton.jit
def _rotate_heads(
    x_ptr,  # this token's first head
    stride_h,  # head stride, in elements
    num_heads,
    cos,  # [1, BLOCK_R] float32
    sin,  # [1, BLOCK_R] float32
    half,  # rotary_dim // 2
    IS_NEOX: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    heads = tl.arange(0, BLOCK_H)[:, None]  # [BLOCK_H, 1]
    i = tl.arange(0, BLOCK_R)[None, :]  # [1, BLOCK_R]
    mask = (heads < num_heads) & (i < half)
    if IS_NEOX:
        off1 = i  # "rotate half": i pairs with i + half
        off2 = i + half
    else:
        off1 = 2 * i  # interleaved: 2i pairs with 2i + 1
        off2 = 2 * i + 1
    p1 = x_ptr + heads * stride_h + off1
    p2 = x_ptr + heads * stride_h + off2
    x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(p2, mask=mask, other=0.0).to(tl.float32)
    o1 = x1 * cos - x2 * sin
    o2 = x2 * cos + x1 * sin
    tl.store(p1, o1.to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(p2, o2.to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    positions_ptr,  # (num_tokens,) int64
    q_ptr,  # (num_tokens, H, D), rotated in place
    k_ptr,  # (num_tokens, H_kv, D), rotated in place
    cos_sin_ptr,  # (max_position, rotary_dim) float32: [cos | sin]
    stride_qt, stride_qh,  # query strides (token, head), in elements
    stride_kt, stride_kh,  # key strides (token, head)
    stride_cs,  # row stride of cos_sin_cache
    num_heads, num_kv_heads,
    half,  # rotary_dim // 2
    IS_NEOX: tl.constexpr,
    BLOCK_HQ: tl.constexpr,  # next_power_of_2(H)
    BLOCK_HK: tl.constexpr,  # next_power_of_2(H_kv)
    BLOCK_R: tl.constexpr,  # next_power_of_2(rotary_dim // 2)
):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    i = tl.arange(0, BLOCK_R)[None, :]
    cos = tl.load(cos_sin_ptr + pos * stride_cs + i, mask=i < half, other=0.0).to(tl.float32)
    sin = tl.load(cos_sin_ptr + pos * stride_cs + half + i, mask=i < half, other=0.0)
    sin = sin.to(tl.float32)
    _rotate_heads(q_ptr + token * stride_qt, stride_qh, num_heads, cos, sin, half,
                  IS_NEOX, BLOCK_HQ, BLOCK_R)  # fmt: skip
    _rotate_heads(k_ptr + token * stride_kt, stride_kh, num_kv_heads, cos, sin, half,
                  IS_NEOX, BLOCK_HK, BLOCK_R)  # fmt: skip


def apply_rotary_emb(
    positions: torch.Tensor,  # (num_tokens,) int64
    query: torch.Tensor,  # (num_tokens, num_heads, head_dim)
    key: torch.Tensor,  # (num_tokens, num_kv_heads, head_dim)
    cos_sin_cache: torch.Tensor,  # (max_position, rotary_dim) float32
    is_neox_style: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``query`` and ``key`` by their positions; return ``(query, key)``.

    Rotates in place (when the last dimension has unit stride; otherwise on a
    contiguous copy); callers use the returned tensors.
    """
    if query.device.type == "cpu":
        return apply_rotary_emb_cpu(positions, query, key, cos_sin_cache, is_neox_style)
    return apply_rotary_emb_triton(positions, query, key, cos_sin_cache, is_neox_style)


def _prepare(positions, query, key, cos_sin_cache):
    """Validate (the ref's checks); return query, key and the cache with unit stride on
    their last dimension."""
    ref_rotary._check(positions, query, key, cos_sin_cache)
    if query.stride(-1) != 1:
        query = query.contiguous()
    if key.stride(-1) != 1:
        key = key.contiguous()
    if cos_sin_cache.stride(-1) != 1:
        cos_sin_cache = cos_sin_cache.contiguous()
    return query, key, cos_sin_cache


def apply_rotary_emb_triton(
    positions: torch.Tensor,  # (num_tokens,) int64
    query: torch.Tensor,  # (num_tokens, num_heads, head_dim)
    key: torch.Tensor,  # (num_tokens, num_kv_heads, head_dim)
    cos_sin_cache: torch.Tensor,  # (max_position, rotary_dim) float32
    is_neox_style: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`apply_rotary_emb` by the Triton kernel (CUDA, or the interpreter on a CPU)."""
    query, key, cos_sin_cache = _prepare(positions, query, key, cos_sin_cache)
    num_tokens, num_heads, _ = query.shape
    num_kv_heads = key.shape[1]
    if num_tokens == 0:
        return query, key
    half = cos_sin_cache.shape[-1] // 2
    _rotary_kernel[(num_tokens,)](
        positions, query, key, cos_sin_cache,
        query.stride(0), query.stride(1), key.stride(0), key.stride(1),
        cos_sin_cache.stride(0),
        num_heads, num_kv_heads, half,
        IS_NEOX=bool(is_neox_style),
        BLOCK_HQ=triton.next_power_of_2(num_heads),
        BLOCK_HK=triton.next_power_of_2(num_kv_heads),
        BLOCK_R=triton.next_power_of_2(half),
        num_warps=4,
    )  # fmt: skip
    return query, key


def apply_rotary_emb_cpu(
    positions: torch.Tensor,  # (num_tokens,) int64
    query: torch.Tensor,  # (num_tokens, num_heads, head_dim)
    key: torch.Tensor,  # (num_tokens, num_kv_heads, head_dim)
    cos_sin_cache: torch.Tensor,  # (max_position, rotary_dim) float32
    is_neox_style: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`apply_rotary_emb` by the C++ op ``torch.ops.minivllm.rotary_embedding``.

    A query/key dtype mismatch takes the ref's path (the op reads one dtype).
    """
    query, key, cos_sin_cache = _prepare(positions, query, key, cos_sin_cache)
    if query.dtype != key.dtype:
        return ref_rotary.apply_rotary_emb(positions, query, key, cos_sin_cache, is_neox_style)
    if query.shape[0]:
        cpu_ops.ops().rotary_embedding(positions.to(torch.int64).contiguous(), query, key,
                                       cos_sin_cache.float(), bool(is_neox_style))  # fmt: skip
    return query, key
