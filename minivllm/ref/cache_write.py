"""Write new tokens' keys and values into the paged KV cache.

The cache of one layer is two tensors of shape
``(num_blocks, block_size, num_kv_heads, head_dim)``. Token ``t`` of the batch
goes to slot ``s = slot_mapping[t]``, i.e. block ``s // block_size`` at offset
``s % block_size``::

    k_cache[s // block_size, s % block_size] = key[t]
    v_cache[s // block_size, s % block_size] = value[t]

A slot of ``-1`` marks a padding row: it is skipped and writes nothing.

**A quantized cache** (``kv_cache_dtype="int8"`` or ``"fp8"``, see
:mod:`minivllm.kv_quant`): the caches are int8 / float8_e4m3fn and the engine
also passes ``k_scale``/``v_scale``, float32 tensors of shape ``(num_blocks,
block_size, num_kv_heads)``. Each (token, KV head) row is quantized on write,
``s = max|x| / QMAX``, ``q = round(x / s)``, and ``q`` goes to the cache while
``s`` goes to the same slot of the scale tensor: a scale tensor is a cache
whose head_dim is 1, written by the same scatter. Without a quantized cache
the engine never passes them (a package written from an older handout keeps
working).

Memory traffic: the minimum is ``2 * T * H * D`` element reads of K/V and as
many writes into the cache. This version first copies the valid rows out
(``key[valid]``), then scatters them: about twice that. The Triton twin
(:mod:`minivllm.fast.cache_write`) reads and writes each element once.
"""

from __future__ import annotations

import torch

from minivllm import kv_quant


def _check(key, value, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None) -> None:
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
    kv_quant.check_scales(k_cache, v_cache, k_scale, v_scale)


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
    """Write ``key[t]``/``value[t]`` to cache slot ``slot_mapping[t]`` in place; skip ``-1``.

    With a quantized cache, each row is quantized first and its scale written
    to the same slot of ``k_scale``/``v_scale`` (see the module docstring).
    """
    _check(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    if k_scale is not None:  # a quantized cache: codes to the cache, scales beside them
        key, key_scale = kv_quant.quantize(key, k_cache.dtype)  # (T, H_kv, D), (T, H_kv)
        value, value_scale = kv_quant.quantize(value, v_cache.dtype)
        # The scales are a cache with head_dim 1: the same scatter writes them.
        reshape_and_cache(key_scale.unsqueeze(-1), value_scale.unsqueeze(-1),
                          k_scale.unsqueeze(-1), v_scale.unsqueeze(-1), slot_mapping)
    # BEGIN SOLUTION
    block_size = k_cache.shape[1]
    valid = slot_mapping >= 0  # (num_tokens,) bool: padding rows are False
    slots = slot_mapping[valid]  # (num_valid,)
    block, offset = slots // block_size, slots % block_size  # (num_valid,) each
    k_cache[block, offset] = key[valid].to(k_cache.dtype)  # (num_valid, H_kv, D) rows
    v_cache[block, offset] = value[valid].to(v_cache.dtype)
    # END SOLUTION
