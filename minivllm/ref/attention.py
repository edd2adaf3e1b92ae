"""Paged attention over a mixed batch of prefill chunks and decodes.

The batch is one flattened stream of query tokens (see
:class:`minivllm.metadata.AttentionMetadata`). Sequence ``i`` contributes
``query_len`` rows, the *last* ``query_len`` of its ``seq_len`` tokens, and its
keys/values for all ``seq_len`` tokens are already in the paged cache (the
model wrote this step's K/V with ``reshape_and_cache`` before calling us).

Query row ``j`` of sequence ``i`` sits at absolute position
``context_len + j`` (``context_len = seq_len - query_len``) and may attend to
cached positions ``0 .. context_len + j``: causal, with the prefix
(prefix-cache hits, earlier chunks) fully visible.

GQA: query head ``h`` reads KV head ``h // (num_heads // num_kv_heads)``.

The reference splits the batch into two parts, both vectorised:

- decode rows (``query_len == 1``), all at once: gather every sequence's
  blocks into a padded ``(num_decodes, max_len, H_kv, D)`` tensor and mask
  the padding;
- prefill chunks, one sequence at a time (a step holds few of them), each a
  single masked ``softmax(q k^T) v`` over its gathered context.

Memory traffic: gathering copies each sequence's whole K and V context once
more (the Triton twin reads the blocks in place instead), and the padded
decode batch costs ``num_decodes * max_seq_len`` even when most sequences are
short.
"""

from __future__ import annotations

import torch

from minivllm.metadata import AttentionMetadata


def gather_kv(
    cache: torch.Tensor,  # (num_blocks, block_size, H_kv, D)
    block_tables: torch.Tensor,  # (num_seqs, max_blocks) int32
    max_len: int,
) -> torch.Tensor:  # (num_seqs, max_len, H_kv, D)
    """Copy each sequence's cached rows, in order, out of the paged cache."""
    _, block_size, num_kv_heads, head_dim = cache.shape
    num_blocks_needed = (max_len + block_size - 1) // block_size
    blocks = cache[block_tables[:, :num_blocks_needed].long()]  # (S, nb, bs, H_kv, D)
    return blocks.reshape(block_tables.shape[0], -1, num_kv_heads, head_dim)[:, :max_len]


def _attend(
    q: torch.Tensor,  # (S, Q, H, D)
    k: torch.Tensor,  # (S, L, H_kv, D)
    v: torch.Tensor,  # (S, L, H_kv, D)
    allowed: torch.Tensor,  # (S, Q, L) bool: may query row attend to key column
    scale: float,
) -> torch.Tensor:  # (S, Q, H, D)
    S, Q, H, D = q.shape
    H_kv = k.shape[2]
    group = H // H_kv
    qg = q.float().reshape(S, Q, H_kv, group, D)
    scores = torch.einsum("sqkgd,slkd->skgql", qg, k.float()) * scale  # (S, H_kv, g, Q, L)
    scores = scores.masked_fill(~allowed[:, None, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("skgql,slkd->sqkgd", probs, v.float())
    return out.reshape(S, Q, H, D).to(q.dtype)


def paged_attention(
    query: torch.Tensor,  # (num_tokens, num_heads, head_dim)
    k_cache: torch.Tensor,  # (num_blocks, block_size, num_kv_heads, head_dim)
    v_cache: torch.Tensor,  # (num_blocks, block_size, num_kv_heads, head_dim)
    metadata: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # (num_tokens, num_heads, head_dim)
    """Causal attention of every query row over its sequence's cached K/V."""
    out = torch.empty_like(query)
    qsl = metadata.query_start_loc.tolist()
    seq_lens = metadata.seq_lens.tolist()
    query_lens = [qsl[i + 1] - qsl[i] for i in range(len(seq_lens))]

    # Decodes: one query row each, batched together.
    dec = [i for i, n in enumerate(query_lens) if n == 1]
    if dec:
        rows = torch.tensor([qsl[i] for i in dec], device=query.device)
        lens = torch.tensor([seq_lens[i] for i in dec], device=query.device)
        max_len = int(lens.max())
        tables = metadata.block_tables[dec]
        k = gather_kv(k_cache, tables, max_len)  # (S, L, H_kv, D)
        v = gather_kv(v_cache, tables, max_len)
        positions = torch.arange(max_len, device=query.device)
        allowed = (positions[None, :] < lens[:, None])[:, None, :]  # (S, 1, L)
        out[rows] = _attend(query[rows][:, None], k, v, allowed, scale)[:, 0]

    # Prefill chunks: one sequence at a time.
    for i, n in enumerate(query_lens):
        if n <= 1:
            continue
        seq_len, start = seq_lens[i], qsl[i]
        context_len = seq_len - n
        k = gather_kv(k_cache, metadata.block_tables[i : i + 1], seq_len)
        v = gather_kv(v_cache, metadata.block_tables[i : i + 1], seq_len)
        q_pos = context_len + torch.arange(n, device=query.device)
        k_pos = torch.arange(seq_len, device=query.device)
        allowed = (k_pos[None, :] <= q_pos[:, None])[None]  # (1, n, L)
        out[start : start + n] = _attend(query[None, start : start + n], k, v, allowed, scale)[0]
    return out
