"""Write new tokens' keys and values into the paged KV cache: Triton or C++.

What you learn here: the simplest useful Triton kernel of an inference engine,
a *scatter* through an index table. Token ``t`` of the batch writes its
``(num_kv_heads, head_dim)`` key and value rows to slot ``slot_mapping[t]`` of
the cache (block ``slot // block_size``, offset ``slot % block_size``); a slot
of ``-1`` marks a padding row and is skipped.

The ref twin (:mod:`minivllm.ref.cache_write`) does the same with boolean
masking plus advanced-index assignment. Its memory traffic: it reads the
slot ids, builds a compacted copy of the valid slots and of the valid K/V rows
(``key[valid]`` materialises ``T * H * D`` elements once more, likewise for
values), then scatters them: about ``4 * T * H * D`` element reads/writes
instead of the minimum ``2 * T * H * D`` reads plus ``2 * T * H * D`` writes,
and several launches. The kernel here reads each K/V element once and writes
it once, in one launch, and never touches padding rows.

Launch grid: ``(num_tokens, cdiv(num_kv_heads * head_dim, BLOCK))``. One
program copies one block of ``BLOCK`` consecutive elements of one token's
flattened ``(num_kv_heads * head_dim)`` row, for both K and V.

On a CPU the same scatter is the C++ op ``torch.ops.minivllm.reshape_and_cache``
(``minivllm/fast/csrc/cache_write.cpp``): one ``memcpy`` per token and head,
tokens spread over threads. :func:`reshape_and_cache` picks the realisation
from the tensor's device.
"""

from __future__ import annotations

import torch

from minivllm.fast import cpu_ops
from minivllm.ref import cache_write as ref_cache_write

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton wheels off Linux: the C++ CPU path still works
    from minivllm.fast._no_triton import tl, triton

__all__ = ["reshape_and_cache"]


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr,  # (num_tokens, H_kv, D), any strides with unit stride on D
    value_ptr,  # (num_tokens, H_kv, D)
    k_cache_ptr,  # (num_blocks, block_size, H_kv, D)
    v_cache_ptr,  # (num_blocks, block_size, H_kv, D)
    slot_mapping_ptr,  # (num_tokens,) int64, -1 = skip
    stride_kt, stride_kh,  # key strides (token, head), in elements
    stride_vt, stride_vh,  # value strides (token, head)
    stride_cb, stride_cs, stride_ch,  # cache strides (block, slot-in-block, head)
    block_size,  # tokens per cache block
    HEAD_DIM: tl.constexpr,  # D
    ROW: tl.constexpr,  # H_kv * D: elements per token
    BLOCK: tl.constexpr,  # elements copied by one program (a power of 2)
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:  # padding row: nothing to write
        return
    block_id = slot // block_size
    block_off = slot % block_size

    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # flattened (head, dim) index
    mask = offs < ROW
    head = offs // HEAD_DIM
    dim = offs % HEAD_DIM
    token64 = token.to(tl.int64)  # big caches overflow int32 offsets
    k = tl.load(key_ptr + token64 * stride_kt + head * stride_kh + dim, mask=mask)
    v = tl.load(value_ptr + token64 * stride_vt + head * stride_vh + dim, mask=mask)
    dst = block_id * stride_cb + block_off * stride_cs + head * stride_ch + dim
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def reshape_and_cache(
    key: torch.Tensor,  # (num_tokens, num_kv_heads, head_dim)
    value: torch.Tensor,  # (num_tokens, num_kv_heads, head_dim)
    k_cache: torch.Tensor,  # (num_blocks, block_size, num_kv_heads, head_dim)
    v_cache: torch.Tensor,  # (num_blocks, block_size, num_kv_heads, head_dim)
    slot_mapping: torch.Tensor,  # (num_tokens,) int64, -1 = skip
) -> None:
    """Scatter ``key``/``value`` rows into ``k_cache``/``v_cache`` in place."""
    if key.device.type == "cpu":
        reshape_and_cache_cpu(key, value, k_cache, v_cache, slot_mapping)
    else:
        reshape_and_cache_triton(key, value, k_cache, v_cache, slot_mapping)


def _prepare(key, value, k_cache, v_cache, slot_mapping):
    """Validate (the ref's checks, plus the layout the kernels assume); return key and
    value with unit stride on head_dim."""
    ref_cache_write._check(key, value, k_cache, v_cache, slot_mapping)
    if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:
        raise ValueError("k_cache and v_cache must share strides, with unit stride on head_dim")
    if key.stride(-1) != 1:
        key = key.contiguous()
    if value.stride(-1) != 1:
        value = value.contiguous()

    return key, value


def reshape_and_cache_triton(
    key: torch.Tensor,  # (num_tokens, num_kv_heads, head_dim)
    value: torch.Tensor,  # (num_tokens, num_kv_heads, head_dim)
    k_cache: torch.Tensor,  # (num_blocks, block_size, num_kv_heads, head_dim)
    v_cache: torch.Tensor,  # (num_blocks, block_size, num_kv_heads, head_dim)
    slot_mapping: torch.Tensor,  # (num_tokens,) int64, -1 = skip
) -> None:
    """:func:`reshape_and_cache` by the Triton kernel (CUDA, or the interpreter on a CPU)."""
    key, value = _prepare(key, value, k_cache, v_cache, slot_mapping)
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    row = num_kv_heads * head_dim
    block = min(triton.next_power_of_2(row), 2048)
    grid = (num_tokens, triton.cdiv(row, block))
    _reshape_and_cache_kernel[grid](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1),
        value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        k_cache.shape[1],
        HEAD_DIM=head_dim, ROW=row, BLOCK=block,
    )  # fmt: skip


def reshape_and_cache_cpu(
    key: torch.Tensor,  # (num_tokens, num_kv_heads, head_dim)
    value: torch.Tensor,  # (num_tokens, num_kv_heads, head_dim)
    k_cache: torch.Tensor,  # (num_blocks, block_size, num_kv_heads, head_dim)
    v_cache: torch.Tensor,  # (num_blocks, block_size, num_kv_heads, head_dim)
    slot_mapping: torch.Tensor,  # (num_tokens,) int64, -1 = skip
) -> None:
    """:func:`reshape_and_cache` by the C++ op ``torch.ops.minivllm.reshape_and_cache``.

    K/V of another dtype than the cache are cast first (the op copies bytes).
    """
    key, value = _prepare(key, value, k_cache, v_cache, slot_mapping)
    if key.shape[0] == 0:
        return
    key, value = key.to(k_cache.dtype), value.to(v_cache.dtype)
    cpu_ops.ops().reshape_and_cache(key, value, k_cache, v_cache,
                                    slot_mapping.to(torch.int64).contiguous())  # fmt: skip
