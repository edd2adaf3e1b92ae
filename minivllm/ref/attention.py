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

The reference gathers each sequence's blocks out of the cache into a
contiguous tensor and hands the rest to torch's
``scaled_dot_product_attention`` (``softmax(q k^T * scale) v`` with a mask):

- decode rows (``query_len == 1``) are batched: sorted by context length and
  taken in groups of :data:`DECODE_GROUP`, each gathered into a padded
  ``(group, longest, H_kv, D)`` tensor with the padding masked out (sorting
  keeps the padding small);
- prefill chunks run one sequence at a time (a step holds few of them), each
  with a causal mask shifted by its cached context.

How the batch splits into these pieces, and their masks, is the same for every
layer of a step, so it is planned once (on the first layer) and reused.

Memory traffic: the gather copies every sequence's K and V context once more
before attention reads it (the Triton twin reads the blocks in place), and the
decode groups still pay for some padding.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from minivllm.metadata import AttentionMetadata


def gather_kv(
    cache: torch.Tensor,  # (num_blocks, block_size, H_kv, D)
    block_tables: torch.Tensor,  # (num_seqs, max_blocks) int32
    max_len: int,
) -> torch.Tensor:  # (num_seqs, max_len, H_kv, D)
    """Copy each sequence's cached rows, in order, out of the paged cache."""
    # BEGIN SOLUTION
    num_seqs = block_tables.shape[0]
    _, block_size, num_kv_heads, head_dim = cache.shape
    num_blocks_needed = (max_len + block_size - 1) // block_size
    block_ids = block_tables[:, :num_blocks_needed].reshape(-1).long()  # (S * nb,)
    # One row per block: index_select copies whole rows, much faster than
    # advanced indexing (cache[block_tables]) on a CPU.
    blocks = cache.flatten(1).index_select(0, block_ids)  # (S * nb, bs * H_kv * D)
    return blocks.view(num_seqs, -1, num_kv_heads, head_dim)[:, :max_len]
    # END SOLUTION


#: Decode sequences attended to together (after sorting by context length).
DECODE_GROUP = 16


def _sdpa(
    q: torch.Tensor,  # (S, Q, H, D)
    k: torch.Tensor,  # (S, L, H_kv, D)
    v: torch.Tensor,  # (S, L, H_kv, D)
    allowed: torch.Tensor,  # (S, Q, L) bool: may query row attend to key column
    scale: float,
) -> torch.Tensor:  # (S, Q, H, D)
    # SDPA wants heads before tokens: (S, H, Q, D); GQA repeats each KV head.
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
        attn_mask=allowed[:, None], scale=scale, enable_gqa=True,
    )
    return out.transpose(1, 2)


@dataclass
class _Work:
    """One SDPA call's worth of sequences: the same for every layer of a step."""

    rows: torch.Tensor | slice  # query rows: a list of decode rows, or one prefill chunk
    tables: torch.Tensor  # (S, max_blocks) block tables of these sequences
    max_len: int  # longest context among them
    allowed: torch.Tensor  # (S, Q, L) bool attention mask


#: The most recent step's plan, keyed by its metadata object (a weak reference,
#: so a new step's metadata never matches an old one).
_last_plan: tuple[weakref.ref, list[_Work]] | None = None


def _plan(metadata: AttentionMetadata) -> list[_Work]:
    """Split the batch into decode groups and prefill chunks, with their masks.

    Every layer of a step attends over the same sequences with the same masks,
    so this runs on the first layer and is remembered (for that metadata object
    only) for the rest.
    """
    # BEGIN SOLUTION
    global _last_plan
    if _last_plan is not None and _last_plan[0]() is metadata:
        return _last_plan[1]
    dev = metadata.seq_lens.device
    qsl = metadata.query_start_loc_host
    seq_lens = metadata.seq_lens_host
    query_lens = [qsl[i + 1] - qsl[i] for i in range(len(seq_lens))]
    plan = []

    # Decodes: one query row each, in groups of similar context length.
    decodes = sorted((i for i, n in enumerate(query_lens) if n == 1), key=lambda i: seq_lens[i])
    for g in range(0, len(decodes), DECODE_GROUP):
        group = decodes[g : g + DECODE_GROUP]
        lens = torch.tensor([seq_lens[i] for i in group], device=dev)
        max_len = seq_lens[group[-1]]  # sorted: the last is the longest
        positions = torch.arange(max_len, device=dev)
        allowed = (positions[None, :] < lens[:, None])[:, None, :]  # (G, 1, L)
        rows = torch.tensor([qsl[i] for i in group], device=dev)
        plan.append(_Work(rows, metadata.block_tables[group], max_len, allowed))

    # Prefill chunks: one sequence at a time, causal, shifted by the cached context.
    for i, n in enumerate(query_lens):
        if n <= 1:
            continue
        seq_len, start = seq_lens[i], qsl[i]
        q_pos = seq_len - n + torch.arange(n, device=dev)
        k_pos = torch.arange(seq_len, device=dev)
        allowed = (k_pos[None, :] <= q_pos[:, None])[None]  # (1, n, L)
        plan.append(_Work(slice(start, start + n), metadata.block_tables[i : i + 1], seq_len,
                          allowed))
    _last_plan = (weakref.ref(metadata), plan)
    return plan
    # END SOLUTION


def paged_attention(
    query: torch.Tensor,  # (num_tokens, num_heads, head_dim)
    k_cache: torch.Tensor,  # (num_blocks, block_size, num_kv_heads, head_dim)
    v_cache: torch.Tensor,  # (num_blocks, block_size, num_kv_heads, head_dim)
    metadata: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # (num_tokens, num_heads, head_dim)
    """Causal attention of every query row over its sequence's cached K/V."""
    # BEGIN SOLUTION
    out = torch.empty_like(query)
    for work in _plan(metadata):
        k = gather_kv(k_cache, work.tables, work.max_len)  # (S, L, H_kv, D)
        v = gather_kv(v_cache, work.tables, work.max_len)
        if isinstance(work.rows, slice):  # a prefill chunk: (1, n, H, D)
            q = query[work.rows][None]
            out[work.rows] = _sdpa(q, k, v, work.allowed, scale)[0]
        else:  # a group of decodes: (G, 1, H, D)
            q = query[work.rows][:, None]
            out[work.rows] = _sdpa(q, k, v, work.allowed, scale)[:, 0]
    return out
    # END SOLUTION
