"""Paged attention over a mixed batch, with kernels that read the cache in place.

What you learn here: how a serving engine picks an attention kernel per batch.
The contract is the ref twin's (:mod:`minivllm.ref.attention`): a flattened,
unpadded batch of prefill chunks and decodes, whose keys and values are all
in the paged cache already; causal, with the cached prefix fully visible;
GQA by ``head // (num_heads // num_kv_heads)``.

Two kernels do the work:

- all-decode batches (every sequence has one query row, the common case in
  steady-state serving) go to *flash-decoding*
  (:mod:`minivllm.fast.attention_decode`): each sequence's context is split
  across programs and the pieces are merged by log-sum-exp, so even a small
  batch of long sequences fills the GPU;
- any other batch (prefills, chunked prefills, prefix-cache hits, with or
  without decodes mixed in) goes to the *unified* kernel
  (:mod:`minivllm.fast.attention_prefill`): FlashAttention-style tiles of
  query rows, one launch for the whole ragged batch.

Neither kernel gathers K/V into a contiguous copy (the ref does), neither
builds a score matrix in memory, and the choice between them uses only
host-side integers (``max_query_len``, the token count), so dispatch never
waits for the GPU.

On a CPU the work goes to the C++ op ``torch.ops.minivllm.paged_attention``
(``minivllm/fast/csrc/attention.cpp``): one op for every kind of batch, each
(sequence, tile of query rows) a work item over threads that reads the cache
as whole token rows (every KV head per tile of keys, the next tile
prefetched), the GQA group's query heads sharing every K/V row it reads, and
an online softmax over tiles of keys. Sequences with 8 or more query rows
(prefill chunks) run in GEMM shape instead (``csrc/attention_tile.h``): packed
64-key K/V tiles, ``S^T = K Q^T`` and ``O^T += V^T P^T`` by a register-blocked
micro-kernel, the softmax down each query's column; 1.5-2.4x the row loop on
one 512-4096-token prompt. Prefill sequences stay on this op: a per-sequence
gather + SDPA was measured no faster at SmolLM2's shapes with short chunks. :func:`paged_attention` picks the realisation from the
tensor's device; ``paged_attention_triton`` / ``paged_attention_cpu`` name
them directly (``minivllm.fast.triton`` / ``minivllm.fast.cpu``).

**A quantized cache** (``kv_cache_dtype="int8"`` / ``"fp8"``,
:mod:`minivllm.kv_quant`: int8 / e4m3 codes, a float32 scale per token and KV
head in ``k_scale``/``v_scale``) is read as it is, a byte an element: no
dequantized copy. The Triton kernels widen the codes to the query's dtype
(exact: every int8 and e4m3 value is a bf16 / fp16 value) and take each key's
scale out of the dot products, ``q . (s k) = s (q . k)`` on the scores and
``sum_t p_t s_t v_t`` by scaling the probabilities: one multiply per key, not
per element. The C++ op does the same in its decode loop, each row's codes
widened into an L1 buffer as it reads them (``csrc/kv_cache.h``); its prefill
tiles dequantize the rows as they pack them. The ref dequantizes each
sequence's gathered rows.

``gather_kv`` is the ref's helper, re-exported so that both twins have the
same public names; the kernels here do not use it.
"""

from __future__ import annotations

import torch

from minivllm import kv_quant
from minivllm.fast import cpu_ops
from minivllm.fast.attention_decode import paged_decode_attention
from minivllm.fast.attention_prefill import unified_attention
from minivllm.metadata import AttentionMetadata
from minivllm.ref.attention import _check_shapes, gather_kv

__all__ = ["gather_kv", "paged_attention"]


def _check(query, k_cache, v_cache, metadata: AttentionMetadata,
           k_scale=None, v_scale=None) -> None:
    """The ref's shape checks, plus the layout both kernels assume (no per-sequence loop)."""
    _check_shapes(query, k_cache, v_cache, metadata)
    kv_quant.check_scales(k_cache, v_cache, k_scale, v_scale)
    if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:
        raise ValueError("k_cache and v_cache must share strides, with unit stride on head_dim")
    if k_scale is not None and not (k_scale.is_contiguous() and v_scale.is_contiguous()):
        raise ValueError("k_scale and v_scale must be contiguous")
    if k_scale is None and (k_cache.dtype != query.dtype or v_cache.dtype != query.dtype):
        raise ValueError(
            f"query, k_cache and v_cache must share a dtype (or the cache be int8 / fp8), "
            f"got {query.dtype}, {k_cache.dtype}, {v_cache.dtype}"
        )
    num_seqs = metadata.num_seqs
    if metadata.query_start_loc.shape != (num_seqs + 1,):
        raise ValueError(
            f"query_start_loc must have shape ({num_seqs + 1},), "
            f"got {tuple(metadata.query_start_loc.shape)}"
        )
    if metadata.block_tables.dim() != 2 or metadata.block_tables.shape[0] != num_seqs:
        raise ValueError(
            f"block_tables must be (num_seqs={num_seqs}, max_blocks), "
            f"got {tuple(metadata.block_tables.shape)}"
        )


def paged_attention(
    query: torch.Tensor,  # (num_tokens, num_heads, head_dim)
    k_cache: torch.Tensor,  # (num_blocks, block_size, num_kv_heads, head_dim)
    v_cache: torch.Tensor,  # (num_blocks, block_size, num_kv_heads, head_dim)
    metadata: AttentionMetadata,
    scale: float,
    *,
    k_scale: torch.Tensor | None = None,  # (num_blocks, block_size, num_kv_heads) float32
    v_scale: torch.Tensor | None = None,  # only with an int8 / fp8 cache
) -> torch.Tensor:  # (num_tokens, num_heads, head_dim)
    """Causal attention of every query row over its sequence's cached K/V (read as
    codes and scales from an int8 / fp8 cache)."""
    if query.device.type == "cpu":
        return paged_attention_cpu(query, k_cache, v_cache, metadata, scale,
                                   k_scale=k_scale, v_scale=v_scale)
    return paged_attention_triton(query, k_cache, v_cache, metadata, scale,
                                  k_scale=k_scale, v_scale=v_scale)


def paged_attention_triton(
    query: torch.Tensor,  # (num_tokens, num_heads, head_dim)
    k_cache: torch.Tensor,  # (num_blocks, block_size, num_kv_heads, head_dim)
    v_cache: torch.Tensor,  # (num_blocks, block_size, num_kv_heads, head_dim)
    metadata: AttentionMetadata,
    scale: float,
    *,
    k_scale: torch.Tensor | None = None,  # (num_blocks, block_size, num_kv_heads) float32
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:  # (num_tokens, num_heads, head_dim)
    """:func:`paged_attention` by the Triton kernels (CUDA, or the interpreter on a CPU)."""
    _check(query, k_cache, v_cache, metadata, k_scale, v_scale)
    if query.stride(-1) != 1:
        query = query.contiguous()
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    num_tokens = query.shape[0]
    num_seqs = metadata.seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out
    # Both facts are host-side ints: one row per sequence means every query_len is 1.
    all_decode = metadata.max_query_len == 1 and num_tokens == num_seqs
    if all_decode:
        return paged_decode_attention(
            query, k_cache, v_cache, metadata.block_tables, metadata.seq_lens,
            metadata.query_start_loc, metadata.max_seq_len, scale, out,
            k_scale=k_scale, v_scale=v_scale,
        )  # fmt: skip
    return unified_attention(
        query, k_cache, v_cache, metadata.block_tables, metadata.seq_lens,
        metadata.query_start_loc, metadata.max_query_len, scale, out,
        k_scale=k_scale, v_scale=v_scale,
    )  # fmt: skip


def paged_attention_cpu(
    query: torch.Tensor,  # (num_tokens, num_heads, head_dim)
    k_cache: torch.Tensor,  # (num_blocks, block_size, num_kv_heads, head_dim)
    v_cache: torch.Tensor,  # (num_blocks, block_size, num_kv_heads, head_dim)
    metadata: AttentionMetadata,
    scale: float,
    *,
    gemm_prefill: bool = True,
    k_scale: torch.Tensor | None = None,  # (num_blocks, block_size, num_kv_heads) float32
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:  # (num_tokens, num_heads, head_dim)
    """:func:`paged_attention` by the C++ op ``torch.ops.minivllm.paged_attention``.

    Sequences with at least 8 query rows (prefill chunks) run in GEMM shape
    (``csrc/attention_tile.h``); ``gemm_prefill=False`` sends them through the
    per-query-vector row loop instead, the kernel before it (for benchmarks and
    tests that compare the two).
    """
    _check(query, k_cache, v_cache, metadata, k_scale, v_scale)
    if query.stride(-1) != 1:
        query = query.contiguous()
    out = torch.empty(query.shape, dtype=query.dtype)
    if query.shape[0] == 0 or metadata.seq_lens.shape[0] == 0:
        return out
    cpu_ops.ops().paged_attention(
        out, query, k_cache, v_cache, metadata.block_tables.to(torch.int32),
        metadata.seq_lens.to(torch.int32), metadata.query_start_loc.to(torch.int32), scale,
        gemm_prefill, k_scale, v_scale,
    )  # fmt: skip
    return out
