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

A quantized cache (``kv_cache_dtype="int8"`` / ``"fp8"``, :mod:`minivllm.kv_quant`)
takes its own kernel, :func:`_reshape_and_cache_quant_kernel`, grid
``(num_tokens, num_kv_heads)``: one program quantizes one (token, KV head) row,
the unit that shares a scale (``s = max|x| / QMAX``, a reduction over the row,
then ``q = round(x / s)``), and writes its codes and its scale. Every division
is ``div_rn`` (Triton's ``/`` on a GPU is an approximate division), and e4m3
codes are built from the float's bits (:func:`_e4m3_bits`): the same codes as
the ref's, bit for bit, on any device. The ref quantizes in a few torch ops and
scatters codes and scales separately, each through a compacted copy.

On a CPU the same scatter is the C++ op ``torch.ops.minivllm.reshape_and_cache``
(``minivllm/fast/csrc/cache_write.cpp``): one ``memcpy`` per token and head,
tokens spread over threads; into a quantized cache, each row quantized in the
same pass. :func:`reshape_and_cache` picks the realisation from the tensor's
device.

:func:`copy_blocks` (the copies of copy-on-write: whole blocks ``src -> dst``
for every layer's K and V) is ONE op call for all layers and pairs, where the
ref makes ``2 * num_layers * num_pairs`` torch calls: a Triton kernel on CUDA
(grid ``(num_pairs, 2 * num_layers, chunks of a block)``; the layers' caches
are separate tensors, so the kernel gets each one's element offset from layer
0's K cache, as vLLM's CUDA kernel gets an array of pointers) and the C++ op
``torch.ops.minivllm.copy_blocks`` on a CPU (one ``memcpy`` per block and
tensor, ``minivllm/fast/csrc/copy_blocks.cpp``).
"""

from __future__ import annotations

import torch

from minivllm import kv_quant
from minivllm.fast import cpu_ops
from minivllm.ref import cache_write as ref_cache_write

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton wheels off Linux: the C++ CPU path still works
    from minivllm.fast._no_triton import tl, triton

__all__ = ["copy_blocks", "reshape_and_cache"]


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


@triton.jit
def _e4m3_bits(y):
    """The float8 e4m3fn code nearest to float32 ``y`` (``|y| <= 448``), ties to even, as
    ``torch``'s ``.to(float8_e4m3fn)`` rounds; uint8 bits.

    Built from the float's bits rather than ``y.to(tl.float8e4nv)``: Triton's
    interpreter rounds that cast's ties away from zero and drops a mantissa carry
    into an odd exponent (124.3 became 64), and this way every device gives the
    same codes.
    """
    bits = y.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    a = bits & 0x7FFFFFFF  # |y|'s bits
    # |y| >= 2^-6 (e4m3's normal range): round the 23-bit mantissa to 3 bits, ties to
    # even (a carry moves into the exponent, as it should), then rebias 127 -> 7.
    normal = ((a + 0x7FFFF + ((a >> 20) & 1)) >> 20) - (120 << 3)
    # Below 2^-6: multiples of 2^-9, m = round(|y| * 512) by the 1.5 * 2^23 trick
    # (ties to even); m = 8 is 2^-6, which is also the first normal code.
    m = ((a.to(tl.float32, bitcast=True) * 512.0 + 12582912.0) - 12582912.0).to(tl.int32)
    code = tl.minimum(tl.where(a >= 0x3C800000, normal, m), 0x7E)  # 0x3C800000: 2^-6
    return (code | sign).to(tl.uint8)


@triton.jit
def _quantize_row(x, QMAX: tl.constexpr, FP8: tl.constexpr):
    """``(codes, scale)`` of one row (:mod:`minivllm.kv_quant`'s formula, in float32)."""
    x = x.to(tl.float32)
    scale = tl.math.div_rn(tl.max(tl.abs(x), axis=0), QMAX)
    y = tl.math.div_rn(x, tl.where(scale > 0, scale, 1.0))
    if FP8:
        q = _e4m3_bits(y)
    else:  # round half to even by the 1.5 * 2^23 trick (|y| <= 127), then clamp
        r = (y + 12582912.0) - 12582912.0
        q = tl.minimum(tl.maximum(r, -127.0), 127.0).to(tl.int8)
    return q, scale


@triton.jit
def _reshape_and_cache_quant_kernel(
    key_ptr,  # (num_tokens, H_kv, D), unit stride on D
    value_ptr,  # (num_tokens, H_kv, D)
    k_cache_ptr,  # (num_blocks, block_size, H_kv, D) int8, or e4m3 seen as uint8
    v_cache_ptr,  # (num_blocks, block_size, H_kv, D)
    k_scale_ptr,  # (num_blocks, block_size, H_kv) float32, contiguous
    v_scale_ptr,  # (num_blocks, block_size, H_kv) float32
    slot_mapping_ptr,  # (num_tokens,) int64, -1 = skip
    stride_kt, stride_kh,  # key strides (token, head), in elements
    stride_vt, stride_vh,  # value strides (token, head)
    stride_cb, stride_cs, stride_ch,  # cache strides (block, slot-in-block, head)
    block_size,  # tokens per cache block
    HEAD_DIM: tl.constexpr,  # D
    BLOCK_D: tl.constexpr,  # D padded to a power of 2
    QMAX: tl.constexpr,  # the largest code: 127.0 or 448.0
    FP8: tl.constexpr,  # e4m3 codes (else int8)
):
    token = tl.program_id(0)
    head = tl.program_id(1)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:  # padding row: nothing to write
        return
    d = tl.arange(0, BLOCK_D)
    mask = d < HEAD_DIM  # padding lanes load 0: they do not change max |x|
    token64 = token.to(tl.int64)
    k = tl.load(key_ptr + token64 * stride_kt + head * stride_kh + d, mask=mask, other=0.0)
    v = tl.load(value_ptr + token64 * stride_vt + head * stride_vh + d, mask=mask, other=0.0)
    k_q, k_s = _quantize_row(k, QMAX, FP8)
    v_q, v_s = _quantize_row(v, QMAX, FP8)
    dst = (slot // block_size) * stride_cb + (slot % block_size) * stride_cs + head * stride_ch
    tl.store(k_cache_ptr + dst + d, k_q, mask=mask)
    tl.store(v_cache_ptr + dst + d, v_q, mask=mask)
    num_kv_heads = tl.num_programs(1)
    tl.store(k_scale_ptr + slot * num_kv_heads + head, k_s)
    tl.store(v_scale_ptr + slot * num_kv_heads + head, v_s)


def reshape_and_cache(
    key: torch.Tensor,  # (num_tokens, num_kv_heads, head_dim)
    value: torch.Tensor,  # (num_tokens, num_kv_heads, head_dim)
    k_cache: torch.Tensor,  # (num_blocks, block_size, num_kv_heads, head_dim)
    v_cache: torch.Tensor,  # (num_blocks, block_size, num_kv_heads, head_dim)
    slot_mapping: torch.Tensor,  # (num_tokens,) int64, -1 = skip
    *,
    k_scale: torch.Tensor | None = None,  # (num_blocks, block_size, num_kv_heads) float32
    v_scale: torch.Tensor | None = None,  # only with an int8 / fp8 cache
) -> None:
    """Scatter ``key``/``value`` rows into ``k_cache``/``v_cache`` in place (quantized,
    with their scales, into an int8 / fp8 cache)."""
    if key.device.type == "cpu":
        reshape_and_cache_cpu(key, value, k_cache, v_cache, slot_mapping,
                              k_scale=k_scale, v_scale=v_scale)
    else:
        reshape_and_cache_triton(key, value, k_cache, v_cache, slot_mapping,
                                 k_scale=k_scale, v_scale=v_scale)


def _prepare(key, value, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None):
    """Validate (the ref's checks, plus the layout the kernels assume); return key and
    value with unit stride on head_dim."""
    ref_cache_write._check(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:
        raise ValueError("k_cache and v_cache must share strides, with unit stride on head_dim")
    if k_scale is not None and not (k_scale.is_contiguous() and v_scale.is_contiguous()):
        raise ValueError("k_scale and v_scale must be contiguous")
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
    *,
    k_scale: torch.Tensor | None = None,  # (num_blocks, block_size, num_kv_heads) float32
    v_scale: torch.Tensor | None = None,
) -> None:
    """:func:`reshape_and_cache` by the Triton kernel (CUDA, or the interpreter on a CPU)."""
    key, value = _prepare(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    if k_scale is not None:  # a quantized cache: one program per (token, KV head) row
        fp8 = k_cache.dtype == torch.float8_e4m3fn
        if fp8:  # the kernel writes e4m3 codes as bytes (see _e4m3_bits)
            k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
        _reshape_and_cache_quant_kernel[(num_tokens, num_kv_heads)](
            key, value, k_cache, v_cache, k_scale, v_scale, slot_mapping,
            key.stride(0), key.stride(1),
            value.stride(0), value.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            k_cache.shape[1],
            HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim),
            QMAX=kv_quant.QMAX[torch.float8_e4m3fn if fp8 else torch.int8], FP8=fp8,
        )  # fmt: skip
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
    *,
    k_scale: torch.Tensor | None = None,  # (num_blocks, block_size, num_kv_heads) float32
    v_scale: torch.Tensor | None = None,
) -> None:
    """:func:`reshape_and_cache` by the C++ op ``torch.ops.minivllm.reshape_and_cache``.

    K/V of another dtype than a float cache are cast first (the op copies bytes);
    into a quantized cache the op quantizes K/V of any float dtype as they are.
    """
    key, value = _prepare(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    if key.shape[0] == 0:
        return
    slots = slot_mapping.to(torch.int64).contiguous()
    if k_scale is not None:
        value = value.to(key.dtype)
        cpu_ops.ops().reshape_and_cache(key, value, k_cache, v_cache, slots, k_scale, v_scale)
        return
    key, value = key.to(k_cache.dtype), value.to(v_cache.dtype)
    cpu_ops.ops().reshape_and_cache(key, value, k_cache, v_cache, slots)


# -- copy_blocks: the copies of copy-on-write ------------------------------------------------


@triton.jit
def _copy_blocks_kernel(
    cache_ptr,  # layer 0's K cache: every other cache is addressed from it
    cache_offsets_ptr,  # (2 * num_layers,) int64: element offset of each K, V cache from it
    block_mapping_ptr,  # (num_pairs, 2) int64: (src, dst) block ids
    stride_block,  # elements from one block to the next (the same in every cache)
    BLOCK_NUMEL: tl.constexpr,  # block_size * H_kv * D: one block's contiguous elements
    BLOCK: tl.constexpr,  # elements copied by one program (a power of 2)
):
    pair = tl.program_id(0)
    cache = cache_ptr + tl.load(cache_offsets_ptr + tl.program_id(1))  # this K or V cache
    src = tl.load(block_mapping_ptr + 2 * pair).to(tl.int64)
    dst = tl.load(block_mapping_ptr + 2 * pair + 1).to(tl.int64)
    offs = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < BLOCK_NUMEL
    x = tl.load(cache + src * stride_block + offs, mask=mask)
    tl.store(cache + dst * stride_block + offs, x, mask=mask)


def _flat_caches(kv_caches, block_mapping) -> list[torch.Tensor]:
    """Validate (the ref's checks, plus one layout for all); every layer's K then V."""
    ref_cache_write._check_copy(kv_caches, block_mapping)
    caches = [t for kv in kv_caches for t in kv]
    first = caches[0]
    bs, heads, dim = first.shape[1:]
    for t in caches:
        if t.stride() != first.stride() or t.stride()[1:] != (heads * dim, dim, 1):
            raise ValueError("kv_caches must share strides, each block contiguous "
                             "(strides (any, num_kv_heads * head_dim, head_dim, 1))")
    return caches


def copy_blocks(
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]],  # per layer: 2 x (num_blocks, bs, H_kv, D)
    block_mapping: torch.Tensor,  # (num_pairs, 2) int64: (src, dst) block ids
) -> None:
    """Copy every layer's K and V block ``src`` -> ``dst`` for each pair, in one op call.

    The engine calls it only in a step that has copies (a request forked), so
    a package whose ``cache_write`` lacks it still serves every ``n=1`` request.
    """
    if kv_caches and kv_caches[0][0].device.type == "cpu":
        copy_blocks_cpu(kv_caches, block_mapping)
    else:
        copy_blocks_triton(kv_caches, block_mapping)


def copy_blocks_triton(
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]],  # per layer: 2 x (num_blocks, bs, H_kv, D)
    block_mapping: torch.Tensor,  # (num_pairs, 2) int64: (src, dst) block ids
) -> None:
    """:func:`copy_blocks` by one Triton launch (CUDA, or the interpreter on a CPU)."""
    caches = _flat_caches(kv_caches, block_mapping)
    num_pairs = block_mapping.shape[0]
    if num_pairs == 0:
        return
    first = caches[0]
    dev, elem = first.device, first.element_size()
    byte_offsets = [t.data_ptr() - first.data_ptr() for t in caches]
    if any(off % elem for off in byte_offsets):
        raise ValueError("kv_caches must be aligned to their element size")
    offsets = torch.tensor([off // elem for off in byte_offsets], dtype=torch.int64, device=dev)
    mapping = block_mapping.to(device=dev, dtype=torch.int64).contiguous()
    block_numel = first[0].numel()
    block = min(triton.next_power_of_2(block_numel), 4096)
    grid = (num_pairs, len(caches), triton.cdiv(block_numel, block))
    _copy_blocks_kernel[grid](first, offsets, mapping, first.stride(0),
                              BLOCK_NUMEL=block_numel, BLOCK=block)


def copy_blocks_cpu(
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]],  # per layer: 2 x (num_blocks, bs, H_kv, D)
    block_mapping: torch.Tensor,  # (num_pairs, 2) int64: (src, dst) block ids
) -> None:
    """:func:`copy_blocks` by the C++ op ``torch.ops.minivllm.copy_blocks``."""
    _flat_caches(kv_caches, block_mapping)
    if block_mapping.shape[0] == 0:
        return
    cpu_ops.ops().copy_blocks([k for k, _ in kv_caches], [v for _, v in kv_caches],
                              block_mapping.to(torch.int64).contiguous())
