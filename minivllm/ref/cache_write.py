"""Write new tokens' keys and values into the paged KV cache.

The cache of one layer is two tensors of shape
``(num_blocks, block_size, num_kv_heads, head_dim)``. Token ``t`` of the batch
goes to slot ``s = slot_mapping[t]``, i.e. block ``s // block_size`` at offset
``s % block_size``::

    k_cache[s // block_size, s % block_size] = key[t]
    v_cache[s // block_size, s % block_size] = value[t]

A slot of ``-1`` marks a padding row: it is skipped and writes nothing.

Memory traffic: the minimum is ``2 * T * H * D`` element reads of K/V and as
many writes into the cache. This version first copies the valid rows out
(``key[valid]``), then scatters them: about twice that. The Triton twin
(:mod:`minivllm.fast.cache_write`) reads and writes each element once.
"""

from __future__ import annotations

import torch


def _check(key, value, k_cache, v_cache, slot_mapping) -> None:
    if key.dim() != 3 or value.shape != key.shape:
        raise ValueError(
            f"key and value must both be (num_tokens, num_kv_heads, head_dim), "
            f"got {tuple(key.shape)} and {tuple(value.shape)}"
        )
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(
            f"k_cache and v_cache must both be (num_blocks, block_size, num_kv_heads, "
            f"head_dim), got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    if tuple(k_cache.shape[2:]) != tuple(key.shape[1:]):
        raise ValueError(
            f"k_cache heads/head_dim {tuple(k_cache.shape[2:])} must match key's "
            f"{tuple(key.shape[1:])}"
        )
    if slot_mapping.shape != (key.shape[0],):
        raise ValueError(
            f"slot_mapping must have shape ({key.shape[0]},), got {tuple(slot_mapping.shape)}"
        )


def reshape_and_cache(
    key: torch.Tensor,  # (num_tokens, num_kv_heads, head_dim)
    value: torch.Tensor,  # (num_tokens, num_kv_heads, head_dim)
    k_cache: torch.Tensor,  # (num_blocks, block_size, num_kv_heads, head_dim)
    v_cache: torch.Tensor,  # (num_blocks, block_size, num_kv_heads, head_dim)
    slot_mapping: torch.Tensor,  # (num_tokens,) int64, -1 = skip
) -> None:
    """Write ``key[t]``/``value[t]`` to cache slot ``slot_mapping[t]`` in place; skip ``-1``."""
    _check(key, value, k_cache, v_cache, slot_mapping)
    # BEGIN SOLUTION
    block_size = k_cache.shape[1]
    valid = slot_mapping >= 0  # (num_tokens,) bool: padding rows are False
    slots = slot_mapping[valid]  # (num_valid,)
    block, offset = slots // block_size, slots % block_size  # (num_valid,) each
    k_cache[block, offset] = key[valid].to(k_cache.dtype)  # (num_valid, H_kv, D) rows
    v_cache[block, offset] = value[valid].to(v_cache.dtype)
    # END SOLUTION
