"""Unified paged attention for prefill chunks, prefix hits and decodes, in one kernel.

What you learn here: FlashAttention's tiling applied to a *ragged, paged*
batch, in the style of vLLM's ``triton_unified_attention``. The batch is the
flattened stream of :class:`~minivllm.metadata.AttentionMetadata`: sequence
``i`` owns query rows ``query_start_loc[i]:query_start_loc[i+1]``, the last
``query_len`` of its ``seq_len`` tokens, and all ``seq_len`` keys/values are
already in the paged cache (earlier chunks, prefix-cache hits, this step's
tokens). Query row ``j`` sits at absolute position ``context_len + j`` and
sees keys ``0 .. context_len + j``.

Grid: ``(num_q_blocks, num_kv_heads)``. Each sequence's query rows are cut
into blocks of ``BLOCK_Q`` tokens; one program takes one block of one
sequence and one KV head, with all ``GROUP`` query heads of that KV head:
its tile has ``BLOCK_M = BLOCK_Q * GROUP`` rows (row ``r`` is token
``r // GROUP``, head ``r % GROUP``), so every K/V tile loaded serves the whole
group. The program walks the sequence's keys in tiles of ``TILE_N`` tokens,
finding each token's physical block through the block table (reading the
cache in place), with an online softmax, and stops at the last key its rows
may see (causal).

Which sequence does program ``b`` serve? Giving sequence ``i`` the program
ids from ``query_start_loc[i] // BLOCK_Q + i`` on leaves room for its
``cdiv(query_len, BLOCK_Q)`` blocks (proof: ``a // B + ceil(n / B) <=
(a + n) // B + 1``), so a program finds its sequence by a binary search over
``query_start_loc`` in the kernel, and the grid size ``num_tokens // BLOCK_Q +
num_seqs`` is known on the host without reading any device tensor. Programs
past the end of their sequence's rows exit at once.

Memory traffic of the ref twin (:mod:`minivllm.ref.attention`, a textbook
loop over sequences), per sequence: gather K and V into a contiguous copy
(read + write ``2 * seq_len * H_kv * D``), expand it to one copy per query
head (GQA) and upcast it to float32, then build the full ``(H, query_len,
seq_len)`` score and probability matrices in memory (written and read by the
scale, the mask, the softmax and the weighted sum), one sequence after
another. This kernel reads Q once, each needed K/V tile once per query block,
writes O once, and never stores scores.

A quantized cache (``QUANT``) is read as codes, as in
:mod:`minivllm.fast.attention_decode`: widened exactly to the query's dtype,
the key's scale on its scores, the value's folded into its probabilities.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton wheels off Linux: the C++ CPU path still works
    from minivllm.fast._no_triton import tl, triton

from minivllm.fast.attention_decode import _codes_for_dot, _dot, dot_mode, launch


@triton.jit
def _find_seq_idx(query_start_loc_ptr, q_block, num_seqs, BLOCK_Q: tl.constexpr):
    """The last sequence ``i`` with ``query_start_loc[i] // BLOCK_Q + i <= q_block``."""
    # Loop-carried values must keep one type: make both int32 tensors from the start
    # (a literal 0, or num_seqs when Triton specialises it to the constant 1, would not be).
    left = q_block * 0
    right = q_block * 0 + num_seqs
    while left < right:
        mid = (left + right) // 2
        first_block = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_block <= q_block:
            left = mid + 1
        else:
            right = mid
    return left - 1


@triton.jit
def _unified_attention_kernel(
    query_ptr,  # (num_tokens, H, D)
    k_cache_ptr,  # (num_blocks, block_size, H_kv, D)
    v_cache_ptr,  # (num_blocks, block_size, H_kv, D)
    block_tables_ptr,  # (num_seqs, max_blocks) int32
    seq_lens_ptr,  # (num_seqs,) int32
    query_start_loc_ptr,  # (num_seqs + 1,) int32
    out_ptr,  # (num_tokens, H, D)
    k_scale_ptr,  # (num_blocks, block_size, H_kv) float32, contiguous (QUANT only)
    v_scale_ptr,  # (num_blocks, block_size, H_kv) float32 (QUANT only)
    qk_scale,  # softmax scale * log2(e)
    stride_qt, stride_qh,  # query strides (token, head)
    stride_ot, stride_oh,  # out strides (token, head)
    stride_cb, stride_cs, stride_ch,  # cache strides (block, slot, head)
    stride_bt,  # block table row stride
    num_seqs,
    block_size,  # tokens per cache block
    HEAD_DIM: tl.constexpr,  # D
    BLOCK_D: tl.constexpr,  # D padded to a power of 2 (>= 16)
    GROUP: tl.constexpr,  # query heads per KV head
    BLOCK_Q: tl.constexpr,  # query tokens per program
    BLOCK_M: tl.constexpr,  # tile rows, >= BLOCK_Q * GROUP, a power of 2 (>= 16)
    TILE_N: tl.constexpr,  # keys per inner-loop step
    DOT_MODE: tl.constexpr,
    QUANT: tl.constexpr = False,  # an int8 / fp8 cache, with k_scale / v_scale
):
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = _find_seq_idx(query_start_loc_ptr, q_block, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    q_block_local = q_block - (q_start // BLOCK_Q + seq)
    if q_block_local * BLOCK_Q >= q_len:  # spare program id: nothing to do
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len

    # Tile rows: (query token, head of the group) pairs.
    r = tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    q_idx = q_block_local * BLOCK_Q + r // GROUP  # row within this sequence's queries
    heads = kv_head * GROUP + r % GROUP
    row_mask = (r < BLOCK_Q * GROUP) & (q_idx < q_len)
    d_mask = d < HEAD_DIM
    tokens = (q_start + q_idx).to(tl.int64)
    q_ptrs = query_ptr + tokens[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :]
    q = tl.load(q_ptrs, mask=row_mask[:, None] & d_mask[None, :], other=0.0)
    q_pos = context_len + q_idx  # absolute positions of the rows

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    # Causal: the block's last row sees keys up to context_len + its index.
    kv_end = tl.minimum(seq_len, context_len + (q_block_local + 1) * BLOCK_Q)
    table_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for tile_start in range(0, kv_end, TILE_N):
        pos = tile_start + tl.arange(0, TILE_N)
        valid = pos < kv_end
        block = tl.load(table_row + pos // block_size, mask=valid, other=0).to(tl.int64)
        slot = block * stride_cb + (pos % block_size) * stride_cs + kv_head * stride_ch
        k = tl.load(k_cache_ptr + slot[None, :] + d[:, None],
                    mask=valid[None, :] & d_mask[:, None], other=0.0)  # fmt: skip
        if QUANT:  # codes: the key's scale comes out of the dot product
            s_idx = (block * block_size + pos % block_size) * tl.num_programs(1) + kv_head
            k_s = tl.load(k_scale_ptr + s_idx, mask=valid, other=0.0)  # [TILE_N]
            scores = _dot(q, _codes_for_dot(k, q, DOT_MODE), DOT_MODE) * (k_s * qk_scale)[None, :]
        else:
            scores = _dot(q, k, DOT_MODE) * qk_scale  # [BLOCK_M, TILE_N]
        # Key 0 is visible to every row, so no row is ever all -inf (no NaN).
        visible = valid[None, :] & (pos[None, :] <= q_pos[:, None])
        scores = tl.where(visible, scores, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_cache_ptr + slot[:, None] + d[None, :],
                    mask=valid[:, None] & d_mask[None, :], other=0.0)  # fmt: skip
        if QUANT:  # the value's scale folded into its probability
            v_s = tl.load(v_scale_ptr + s_idx, mask=valid, other=0.0)  # [TILE_N]
            pv = _dot((p * v_s[None, :]).to(q.dtype), _codes_for_dot(v, q, DOT_MODE), DOT_MODE)
        else:
            pv = _dot(p.to(v.dtype), v, DOT_MODE)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    out = acc / l_i[:, None]
    o_ptrs = out_ptr + tokens[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :]
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & d_mask[None, :])


def unified_config(dtype: torch.dtype, block_d: int, group: int, max_query_len: int) -> dict:
    """Tile sizes and launch options.

    Big query tiles (128 rows, 8 warps) for long prefills in 16-bit dtypes, as
    FlashAttention-2 uses on Hopper; 64 rows otherwise, fewer for float32 so
    one stage of K and V tiles stays small in shared memory.
    """
    if dtype == torch.float32:
        block_m, tile_n, warps, stages = 32, 32, 4, 1
    elif max_query_len >= 128 and block_d <= 128:
        block_m, tile_n, warps, stages = 128, 64, 8, 3
    else:
        block_m, tile_n, warps, stages = 64, 64 if block_d <= 128 else 32, 4, 2
    block_m = max(block_m, triton.next_power_of_2(group), 16)
    return {
        "BLOCK_M": block_m,
        "BLOCK_Q": block_m // group,
        "TILE_N": tile_n,
        "num_warps": warps,
        "num_stages": stages,
    }


def unified_attention(
    query: torch.Tensor,  # (num_tokens, num_heads, head_dim)
    k_cache: torch.Tensor,  # (num_blocks, block_size, num_kv_heads, head_dim)
    v_cache: torch.Tensor,  # (num_blocks, block_size, num_kv_heads, head_dim)
    block_tables: torch.Tensor,  # (num_seqs, max_blocks) int32
    seq_lens: torch.Tensor,  # (num_seqs,) int32
    query_start_loc: torch.Tensor,  # (num_seqs + 1,) int32
    max_query_len: int,
    scale: float,
    out: torch.Tensor,  # (num_tokens, num_heads, head_dim), written here
    *,
    k_scale: torch.Tensor | None = None,  # (num_blocks, block_size, num_kv_heads) float32
    v_scale: torch.Tensor | None = None,  # only with an int8 / fp8 cache
) -> torch.Tensor:
    """Causal attention of a mixed batch over the paged cache, one launch."""
    num_tokens, num_heads, head_dim = query.shape
    num_seqs = seq_lens.shape[0]
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    block_d = max(triton.next_power_of_2(head_dim), 16)
    cfg = unified_config(query.dtype, block_d, group, max_query_len)
    grid = (num_tokens // cfg["BLOCK_Q"] + num_seqs, num_kv_heads)
    quant = k_scale is not None
    args = (
        query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, out,
        k_scale if quant else out, v_scale if quant else out,  # unused without QUANT
        scale * 1.4426950408889634,  # log2(e)
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0), num_seqs, block_size,
    )  # fmt: skip
    consts = dict(HEAD_DIM=head_dim, BLOCK_D=block_d, GROUP=group, DOT_MODE=dot_mode(query.dtype),
                  QUANT=quant)
    launch(_unified_attention_kernel, grid, args, consts, cfg)
    return out
