"""Paged decode attention as *flash-decoding*: split the context, merge by log-sum-exp.

What you learn here: how to make a memory-bound attention kernel fill a GPU
when each query is a single row. During decoding every sequence contributes
one query token per head; all the work is streaming that sequence's cached K
and V through the chip once. One program per (sequence, head) would leave
most of the GPU idle at small batch sizes and make one program walk a whole
long context alone, so the context is *split* into partitions of
``PARTITION_SIZE`` tokens, each handled by its own program (split-K):

1. :func:`_paged_decode_kernel`, grid ``(num_seqs, num_kv_heads,
   num_partitions)``: each program runs an online softmax over its
   partition's tokens, reading the KV blocks *in place* through the block
   table (no gather), and writes the partial result ``(m, l, acc)``: the
   running max of the scores, the sum of ``exp(score - m)``, and the
   unnormalised weighted sum of values.
2. :func:`_merge_partitions_kernel`, grid ``(num_seqs, num_heads)``: combine
   the partials of one (sequence, head) by log-sum-exp:
   ``M = max_p m_p``, ``w_p = exp(m_p - M)``,
   ``out = sum_p w_p acc_p / sum_p w_p l_p``.

When every sequence fits in one partition the first kernel normalises and
writes the output itself, and the merge is skipped. The number of partitions
is a run-time argument, not a compile-time constant: during decoding the
longest context grows every step, and a constexpr would recompile the kernel
each time it crossed a partition boundary.

GQA: the program for KV head ``h`` serves all ``GROUP = num_heads /
num_kv_heads`` query heads that read it, so each K/V element is loaded once
per group, not once per query head. The group's queries form a ``[BLOCK_G,
BLOCK_D]`` tile (``BLOCK_G`` = the group padded to a power of two >= 16, the
smallest ``tl.dot`` operand); head dims that are not powers of two (80, 96,
40, 24) are padded to ``BLOCK_D`` and masked.

Memory traffic of the ref twin (:mod:`minivllm.ref.attention`, a textbook
loop over sequences) for a decode batch: for each sequence it gathers K and V
into a contiguous copy (read + write of the context), expands the copy to one
per query head (``GROUP`` times the bytes), upcasts 16-bit caches to float32
(twice that again), reads it in the matmuls, and writes and reads the
``(H, 1, seq_len)`` float32 scores several times: about 27x the K/V bytes for
bf16 with ``GROUP = 4`` (tutorial 04 counts it). This kernel reads each
sequence's own K/V once (``2 * sum(seq_lens) * H_kv * D`` elements), the
queries once, and writes the output once, plus the small float32 partials.

A quantized cache (``QUANT``: int8 / e4m3 codes, one float32 scale per token
and KV head, :mod:`minivllm.kv_quant`) is read as codes, 1 byte an element,
widened to the query's dtype (exactly) for the dot products, with each key's
scale applied once per score and each value's folded into its probability.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton wheels off Linux: the C++ CPU path still works
    from minivllm.fast._no_triton import tl, triton

from minivllm.backend import triton_interpreted

#: Tokens of one sequence's context handled by one program (a multiple of every tile size).
PARTITION_SIZE = 512

# How a kernel calls tl.dot (a constexpr): tensor cores on the native dtype; float32 at full
# IEEE precision (Triton would otherwise use tf32, ~3e-4 error); or, in Triton's
# interpreter, bf16 upcast to float32 first (the interpreter's bf16 dot is broken).
DOT_NATIVE, DOT_IEEE, DOT_UPCAST = 0, 1, 2


def dot_mode(dtype: torch.dtype) -> int:
    """The ``DOT_MODE`` constexpr for operands of ``dtype``."""
    if dtype == torch.float32:
        return DOT_IEEE
    if dtype == torch.bfloat16 and triton_interpreted():
        return DOT_UPCAST
    return DOT_NATIVE


try:  # raised when a config needs more shared memory or registers than the GPU has
    from triton.runtime.errors import OutOfResources
except ImportError:  # pragma: no cover - very old Triton
    OutOfResources = RuntimeError


def launch(kernel, grid, args: tuple, consts: dict, cfg: dict) -> None:
    """Launch ``kernel[grid](*args, **consts, **cfg)``; on a GPU that lacks the
    resources for ``cfg`` (a compile-time error), retry once with a single
    pipeline stage, which needs the least shared memory."""
    try:
        kernel[grid](*args, **consts, **cfg)
    except OutOfResources:
        if cfg.get("num_stages", 1) == 1:
            raise
        kernel[grid](*args, **consts, **{**cfg, "num_stages": 1})


@triton.jit
def _dot(a, b, DOT_MODE: tl.constexpr):
    """``a @ b`` accumulated in float32 (see :func:`dot_mode`)."""
    if DOT_MODE == 1:
        c = tl.dot(a, b, input_precision="ieee")
    elif DOT_MODE == 2:
        c = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        c = tl.dot(a, b)
    return c


@triton.jit
def _codes_for_dot(x, q, DOT_MODE: tl.constexpr):
    """int8 / e4m3 cache codes in the query's dtype, for ``_dot`` (exact: each is a
    bf16 and an fp16 value); in float32 where ``_dot`` upcasts anyway (Triton's
    interpreter casts int8 to bf16 wrongly)."""
    if DOT_MODE == 2:
        y = x.to(tl.float32)
    else:
        y = x.to(q.dtype)
    return y


@triton.jit
def _paged_decode_kernel(
    query_ptr,  # (num_tokens, H, D): one row per sequence
    k_cache_ptr,  # (num_blocks, block_size, H_kv, D)
    v_cache_ptr,  # (num_blocks, block_size, H_kv, D)
    block_tables_ptr,  # (num_seqs, max_blocks) int32
    seq_lens_ptr,  # (num_seqs,) int32
    query_start_loc_ptr,  # (num_seqs + 1,) int32: sequence s's query row
    out_ptr,  # (num_tokens, H, D): written only when SINGLE_PARTITION
    part_acc_ptr,  # (num_seqs, H, num_partitions, BLOCK_D) float32 partial sums
    part_max_ptr,  # (num_seqs, H, num_partitions) float32 running max (log2 units)
    part_sum_ptr,  # (num_seqs, H, num_partitions) float32 sum of exp2(score - max)
    k_scale_ptr,  # (num_blocks, block_size, H_kv) float32, contiguous (QUANT only)
    v_scale_ptr,  # (num_blocks, block_size, H_kv) float32 (QUANT only)
    qk_scale,  # softmax scale * log2(e): scores in log2 units, so exp2 replaces exp
    stride_qt, stride_qh,  # query strides (token, head)
    stride_ot, stride_oh,  # out strides (token, head)
    stride_cb, stride_cs, stride_ch,  # cache strides (block, slot, head)
    stride_bt,  # block table row stride
    block_size,  # tokens per cache block
    num_partitions,  # partitions of the longest sequence (= grid dim 2)
    HEAD_DIM: tl.constexpr,  # D
    BLOCK_D: tl.constexpr,  # D padded to a power of 2 (>= 16)
    GROUP: tl.constexpr,  # query heads per KV head
    BLOCK_G: tl.constexpr,  # GROUP padded to a power of 2 (>= 16)
    TILE_N: tl.constexpr,  # context tokens per inner-loop step
    PARTITION_SIZE: tl.constexpr,  # context tokens per program
    SINGLE_PARTITION: tl.constexpr,  # num_partitions == 1: write the output directly
    DOT_MODE: tl.constexpr,
    QUANT: tl.constexpr = False,  # an int8 / fp8 cache, with k_scale / v_scale
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    part = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    start = part * PARTITION_SIZE
    if start >= seq_len:  # this sequence is shorter than the longest one
        return
    end = tl.minimum(start + PARTITION_SIZE, seq_len)

    # The group's queries: a [BLOCK_G, BLOCK_D] tile, zero in the padding.
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + g
    g_mask = g < GROUP
    d_mask = d < HEAD_DIM
    token = tl.load(query_start_loc_ptr + seq).to(tl.int64)
    q_ptrs = query_ptr + token * stride_qt + heads[:, None] * stride_qh + d[None, :]
    q = tl.load(q_ptrs, mask=g_mask[:, None] & d_mask[None, :], other=0.0)

    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    table_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    # BEGIN SOLUTION
    for tile_start in range(start, end, TILE_N):
        pos = tile_start + tl.arange(0, TILE_N)  # absolute token positions
        valid = pos < end
        # Each token finds its physical block through the block table: no gather.
        block = tl.load(table_row + pos // block_size, mask=valid, other=0).to(tl.int64)
        slot = block * stride_cb + (pos % block_size) * stride_cs + kv_head * stride_ch
        kv_mask = valid[None, :] & d_mask[:, None]
        k = tl.load(k_cache_ptr + slot[None, :] + d[:, None], mask=kv_mask, other=0.0)
        if QUANT:  # codes: the key's scale comes out of the dot product, q . (s k) = s (q . k)
            s_idx = (block * block_size + pos % block_size) * tl.num_programs(1) + kv_head
            k_s = tl.load(k_scale_ptr + s_idx, mask=valid, other=0.0)  # [TILE_N]
            scores = _dot(q, _codes_for_dot(k, q, DOT_MODE), DOT_MODE) * (k_s * qk_scale)[None, :]
        else:
            scores = _dot(q, k, DOT_MODE) * qk_scale  # [BLOCK_G, TILE_N]
        scores = tl.where(valid[None, :], scores, float("-inf"))

        # Online softmax: rescale what we have so far to the new running max.
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v_mask = valid[:, None] & d_mask[None, :]
        v = tl.load(v_cache_ptr + slot[:, None] + d[None, :], mask=v_mask, other=0.0)
        if QUANT:  # sum_t p_t (s_t v_t) = sum_t (p_t s_t) v_t
            v_s = tl.load(v_scale_ptr + s_idx, mask=valid, other=0.0)  # [TILE_N]
            pv = _dot((p * v_s[None, :]).to(q.dtype), _codes_for_dot(v, q, DOT_MODE), DOT_MODE)
        else:
            pv = _dot(p.to(v.dtype), v, DOT_MODE)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    # END SOLUTION

    if SINGLE_PARTITION:  # the whole context was ours: finish here, no merge
        out = acc / l_i[:, None]
        o_ptrs = out_ptr + token * stride_ot + heads[:, None] * stride_oh + d[None, :]
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :])
    else:
        num_heads = tl.num_programs(1) * GROUP
        row = (seq * num_heads + heads).to(tl.int64) * num_partitions + part  # [BLOCK_G]
        tl.store(part_max_ptr + row, m_i, mask=g_mask)
        tl.store(part_sum_ptr + row, l_i, mask=g_mask)
        tl.store(part_acc_ptr + row[:, None] * BLOCK_D + d[None, :], acc, mask=g_mask[:, None])


@triton.jit
def _merge_partitions_kernel(
    out_ptr,  # (num_tokens, H, D)
    part_acc_ptr,  # (num_seqs, H, num_partitions, BLOCK_D) float32
    part_max_ptr,  # (num_seqs, H, num_partitions) float32
    part_sum_ptr,  # (num_seqs, H, num_partitions) float32
    seq_lens_ptr,  # (num_seqs,) int32
    query_start_loc_ptr,  # (num_seqs + 1,) int32
    stride_ot, stride_oh,  # out strides (token, head)
    num_partitions,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PARTITION_SIZE: tl.constexpr,
    BLOCK_P: tl.constexpr,  # num_partitions padded to a power of 2
    CHUNK_P: tl.constexpr,  # partitions merged per loop step (keeps the tile small)
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq)
    num_parts = tl.cdiv(seq_len, PARTITION_SIZE)  # partitions this sequence really used
    base = (seq * tl.num_programs(1) + head).to(tl.int64) * num_partitions
    # Pass 1: the global max, over all partitions at once (one float each).
    p = tl.arange(0, BLOCK_P)
    m_max = tl.max(tl.load(part_max_ptr + base + p, mask=p < num_parts, other=float("-inf")))
    # Pass 2: log-sum-exp merge, bringing every partial to the global max, a chunk at a time.
    d = tl.arange(0, BLOCK_D)
    acc = tl.zeros([CHUNK_P, BLOCK_D], dtype=tl.float32)
    l_sum = tl.zeros([CHUNK_P], dtype=tl.float32)
    for first in range(0, num_parts, CHUNK_P):
        pc = first + tl.arange(0, CHUNK_P)
        pc_mask = pc < num_parts
        m = tl.load(part_max_ptr + base + pc, mask=pc_mask, other=float("-inf"))
        w = tl.exp2(m - m_max)  # 0 for unused partitions
        l_sum += tl.load(part_sum_ptr + base + pc, mask=pc_mask, other=0.0) * w
        a = tl.load(part_acc_ptr + (base + pc)[:, None] * BLOCK_D + d[None, :],
                    mask=pc_mask[:, None], other=0.0)  # fmt: skip
        acc += a * w[:, None]
    out = tl.sum(acc, axis=0) / tl.sum(l_sum, axis=0)
    token = tl.load(query_start_loc_ptr + seq).to(tl.int64)
    tl.store(out_ptr + token * stride_ot + head * stride_oh + d,
             out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)  # fmt: skip


def decode_config(dtype: torch.dtype, block_d: int) -> dict[str, int]:
    """Tile size and launch options: keep one K plus one V tile at <= 16 KiB per stage."""
    tile_n = 64 if block_d * dtype.itemsize <= 256 else 32
    return {"TILE_N": tile_n, "num_warps": 4, "num_stages": 2}


def paged_decode_attention(
    query: torch.Tensor,  # (num_seqs, num_heads, head_dim), one row per sequence
    k_cache: torch.Tensor,  # (num_blocks, block_size, num_kv_heads, head_dim)
    v_cache: torch.Tensor,  # (num_blocks, block_size, num_kv_heads, head_dim)
    block_tables: torch.Tensor,  # (num_seqs, max_blocks) int32
    seq_lens: torch.Tensor,  # (num_seqs,) int32
    query_start_loc: torch.Tensor,  # (num_seqs + 1,) int32
    max_seq_len: int,
    scale: float,
    out: torch.Tensor,  # (num_seqs, num_heads, head_dim), written here
    partition_size: int = PARTITION_SIZE,
    *,
    k_scale: torch.Tensor | None = None,  # (num_blocks, block_size, num_kv_heads) float32
    v_scale: torch.Tensor | None = None,  # only with an int8 / fp8 cache
) -> torch.Tensor:
    """Flash-decoding over the paged cache for a batch of single-row queries."""
    num_seqs = seq_lens.shape[0]
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    num_heads = query.shape[1]
    group = num_heads // num_kv_heads
    block_d = max(triton.next_power_of_2(head_dim), 16)
    cfg = decode_config(query.dtype, block_d)
    if partition_size % cfg["TILE_N"]:
        raise ValueError(f"partition_size must be a multiple of {cfg['TILE_N']}")
    num_partitions = max(triton.cdiv(max_seq_len, partition_size), 1)
    if num_partitions > 1:
        part_acc = torch.empty(
            (num_seqs, num_heads, num_partitions, block_d), dtype=torch.float32, device=query.device
        )
        part_max = torch.empty(
            (num_seqs, num_heads, num_partitions), dtype=torch.float32, device=query.device
        )
        part_sum = torch.empty_like(part_max)
    else:  # never touched: the kernel writes the output directly
        part_acc = part_max = part_sum = out
    quant = k_scale is not None
    args = (
        query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, out,
        part_acc, part_max, part_sum,
        k_scale if quant else out, v_scale if quant else out,  # unused without QUANT
        scale * 1.4426950408889634,  # log2(e)
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0), block_size, num_partitions,
    )  # fmt: skip
    consts = dict(
        HEAD_DIM=head_dim, BLOCK_D=block_d, GROUP=group,
        BLOCK_G=max(triton.next_power_of_2(group), 16),
        PARTITION_SIZE=partition_size, SINGLE_PARTITION=num_partitions == 1,
        DOT_MODE=dot_mode(query.dtype), QUANT=quant,
    )  # fmt: skip
    launch(_paged_decode_kernel, (num_seqs, num_kv_heads, num_partitions), args, consts, cfg)
    if num_partitions > 1:
        _merge_partitions_kernel[(num_seqs, num_heads)](
            out, part_acc, part_max, part_sum, seq_lens, query_start_loc,
            out.stride(0), out.stride(1), num_partitions,
            HEAD_DIM=head_dim, BLOCK_D=block_d, PARTITION_SIZE=partition_size,
            BLOCK_P=triton.next_power_of_2(num_partitions),
            CHUNK_P=min(triton.next_power_of_2(num_partitions), 16),
            num_warps=4,
        )  # fmt: skip
    return out
