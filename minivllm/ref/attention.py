"""Paged attention over a mixed batch of prefill chunks and decodes: the textbook version.

The batch is one flattened stream of query tokens (see
:class:`minivllm.metadata.AttentionMetadata`). Sequence ``i`` owns query rows
``query_start_loc[i] : query_start_loc[i + 1]``: the *last* ``query_len`` of
its ``seq_len`` tokens. The keys and values of all ``seq_len`` tokens are
already in the paged cache (the model wrote this step's K/V with
``reshape_and_cache`` before calling us). A decode is simply a sequence with
``query_len == 1``; nothing below treats it specially.

For each sequence, one after another:

1. **Gather** its K and V out of the paged cache. Token ``p`` lives in block
   ``block_table[p // block_size]`` at offset ``p % block_size``; only the
   ``seq_len`` valid rows are read (never padding, never other sequences' slots).
2. **Scores.** Query head ``h`` reads KV head ``h // group`` with
   ``group = num_heads // num_kv_heads`` (GQA; ``group == 1`` is plain
   multi-head attention). ``scores[h, j, p] = scale * q[j, h] . k[p, h // group]``.
3. **Causal mask, shifted by the cached context.** With
   ``context_len = seq_len - query_len``, query row ``j`` sits at absolute
   position ``context_len + j`` and may see keys ``p <= context_len + j``: the
   whole cached prefix (earlier chunks, prefix-cache hits) and itself.
4. **Softmax** over ``p``, in float32, so 16-bit inputs do not lose the
   small probabilities.
5. **Weighted sum** of the values: ``out[j, h] = sum_p probs[h, j, p] v[p, h // group]``.

**A quantized cache** (``kv_cache_dtype="int8"`` or ``"fp8"``, see
:mod:`minivllm.kv_quant`): the caches hold int8 / float8_e4m3fn codes and the
engine also passes ``k_scale``/``v_scale``, ``(num_blocks, block_size,
num_kv_heads)`` float32, one scale per cached (token, KV head) row. Step 1
then *dequantizes on read*: it gathers the sequence's scales like its rows
(a cache whose head_dim is 1) and computes ``k = q_k * s_k``, ``v = q_v *
s_v`` in float32; steps 2-5 do not change. Without a quantized cache the
engine never passes them.

This is what the tutorials teach and what the equivalence tests trust. Speed
is not its job: it copies every sequence's K/V once more (the gather), upcasts
it to float32, and writes and reads a ``(num_heads, query_len, seq_len)`` score
matrix. The Triton twin (:mod:`minivllm.fast.attention`) reads the blocks in
place with an online softmax and never stores scores.

It loops over sequences on the host using the metadata's host copies
(``query_start_loc_host``, ``seq_lens_host``), so it never reads a device
tensor back, and keeps no state between calls: the same metadata in gives
the same output, a different batch needs its own metadata.
"""

from __future__ import annotations

import torch

from minivllm import kv_quant
from minivllm.metadata import AttentionMetadata


def gather_kv(
    cache: torch.Tensor,  # (num_blocks, block_size, H_kv, D)
    block_tables: torch.Tensor,  # (num_seqs, max_blocks) int32
    max_len: int,
) -> torch.Tensor:  # (num_seqs, max_len, H_kv, D)
    """Copy the first ``max_len`` cached rows of each sequence, in order, out of the paged cache.

    Row ``p`` of sequence ``i`` is slot ``p % block_size`` of block
    ``block_tables[i, p // block_size]``. Only the blocks that hold those rows
    are read.
    """
    # BEGIN SOLUTION
    num_seqs = block_tables.shape[0]
    block_size, num_kv_heads, head_dim = cache.shape[1:]
    num_blocks = (max_len + block_size - 1) // block_size
    block_ids = block_tables[:, :num_blocks].reshape(-1).long()  # (S * num_blocks,)
    blocks = cache.index_select(0, block_ids)  # (S * num_blocks, block_size, H_kv, D)
    rows = blocks.view(num_seqs, num_blocks * block_size, num_kv_heads, head_dim)
    return rows[:, :max_len]
    # END SOLUTION


def _check_shapes(
    query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, md: AttentionMetadata
) -> None:
    """Raise ``ValueError`` naming the field when the shapes do not fit together
    (shared with the fast twin, which adds its own layout checks)."""
    if query.dim() != 3:
        raise ValueError(
            f"query must be (num_tokens, num_heads, head_dim), got {tuple(query.shape)}"
        )
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(
            f"k_cache and v_cache must both be (num_blocks, block_size, num_kv_heads, "
            f"head_dim), got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    num_heads, head_dim = query.shape[1:]
    num_kv_heads = k_cache.shape[2]
    if k_cache.shape[3] != head_dim:
        raise ValueError(f"cache head_dim {k_cache.shape[3]} must equal query head_dim {head_dim}")
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        raise ValueError(
            f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
        )
    qsl = md.query_start_loc_host
    if len(qsl) != md.num_seqs + 1:
        raise ValueError(
            f"query_start_loc_host must have num_seqs + 1 = {md.num_seqs + 1} entries, "
            f"got {len(qsl)}"
        )
    if qsl[-1] != query.shape[0]:
        # Metadata built for another batch (e.g. the previous step's) must not be reused.
        raise ValueError(
            f"query has {query.shape[0]} rows but the metadata describes "
            f"query_start_loc_host[-1] = {qsl[-1]} query tokens (metadata from another step?)"
        )


def _check(
    query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, md: AttentionMetadata,
    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
) -> None:
    """Raise ``ValueError`` naming the field when the inputs do not fit together."""
    _check_shapes(query, k_cache, v_cache, md)
    kv_quant.check_scales(k_cache, v_cache, k_scale, v_scale)
    capacity = md.block_tables.shape[1] * k_cache.shape[1]
    for i, (query_len, seq_len) in enumerate(zip(md.query_lens_host, md.seq_lens_host)):
        if not 0 <= query_len <= seq_len <= capacity:
            raise ValueError(
                f"sequence {i}: need 0 <= query_len ({query_len}) <= seq_lens_host "
                f"({seq_len}) <= block_tables width * block_size ({capacity})"
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
    """``softmax(q k^T * scale + causal mask) v`` for every query row, over its sequence's cache.

    Sequence by sequence, as the module docstring describes: gather (and
    dequantize, with a quantized cache), scores with the GQA head mapping,
    causal mask shifted by the cached context, float32 softmax, weighted sum
    of values.
    """
    _check(query, k_cache, v_cache, metadata, k_scale, v_scale)
    # BEGIN SOLUTION
    num_heads = query.shape[1]
    group = num_heads // k_cache.shape[2]
    # GQA: query head h reads KV head h // group.
    kv_head = torch.arange(num_heads, device=query.device) // group  # (H,)
    out = torch.empty_like(query)
    qsl = metadata.query_start_loc_host
    for i, seq_len in enumerate(metadata.seq_lens_host):
        start, end = qsl[i], qsl[i + 1]
        query_len = end - start
        if query_len == 0:
            continue
        context_len = seq_len - query_len  # tokens cached before this step's chunk

        # 1. Gather this sequence's keys and values: (seq_len, H_kv, D).
        table = metadata.block_tables[i : i + 1]  # (1, max_blocks)
        k = gather_kv(k_cache, table, seq_len)[0]
        v = gather_kv(v_cache, table, seq_len)[0]
        if k_scale is not None:  # a quantized cache: dequantize on read, x = q * s
            k = kv_quant.dequantize(k, gather_kv(k_scale.unsqueeze(-1), table, seq_len)[0, ..., 0])
            v = kv_quant.dequantize(v, gather_kv(v_scale.unsqueeze(-1), table, seq_len)[0, ..., 0])

        # 2. Scores, one KV head per query head: (H, query_len, seq_len).
        q = query[start:end].float()  # (query_len, H, D)
        k = k.index_select(1, kv_head).float()  # (seq_len, H, D)
        v = v.index_select(1, kv_head).float()  # (seq_len, H, D)
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale

        # 3. Causal mask shifted by the cached context: row j sees keys 0 .. context_len + j.
        q_pos = context_len + torch.arange(query_len, device=query.device)  # (query_len,)
        k_pos = torch.arange(seq_len, device=query.device)  # (seq_len,)
        visible = k_pos[None, :] <= q_pos[:, None]  # (query_len, seq_len)
        scores = scores.masked_fill(~visible, float("-inf"))

        # 4. Softmax over the keys, in float32.
        probs = torch.softmax(scores, dim=-1)  # (H, query_len, seq_len)

        # 5. Weighted sum of the values: (query_len, H, D).
        out[start:end] = torch.einsum("hqk,khd->qhd", probs, v).to(query.dtype)
    return out
    # END SOLUTION
