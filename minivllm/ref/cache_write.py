"""Write new tokens' keys and values into the paged KV cache.

The cache of one layer is two tensors of shape
``(num_blocks, block_size, num_kv_heads, head_dim)``. Token ``t`` of the batch
goes to slot ``slot_mapping[t]``, i.e. block ``slot // block_size`` at offset
``slot % block_size``. A slot of ``-1`` marks a padding row that is skipped.

Memory traffic: reads ``2 * T * H * D`` elements of K/V and writes the same
amount into the cache (plus the slot ids); a single scatter.
"""

from __future__ import annotations

import torch


def reshape_and_cache(
    key: torch.Tensor,  # (num_tokens, num_kv_heads, head_dim)
    value: torch.Tensor,  # (num_tokens, num_kv_heads, head_dim)
    k_cache: torch.Tensor,  # (num_blocks, block_size, num_kv_heads, head_dim)
    v_cache: torch.Tensor,  # (num_blocks, block_size, num_kv_heads, head_dim)
    slot_mapping: torch.Tensor,  # (num_tokens,) int64, -1 = skip
) -> None:
    """Scatter ``key``/``value`` rows into ``k_cache``/``v_cache`` in place."""
    # BEGIN SOLUTION
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    # View the cache as one flat array of slots: (num_blocks * block_size, H, D).
    k_cache.view(-1, num_kv_heads, head_dim)[slots] = key[valid].to(k_cache.dtype)
    v_cache.view(-1, num_kv_heads, head_dim)[slots] = value[valid].to(v_cache.dtype)
    # END SOLUTION
