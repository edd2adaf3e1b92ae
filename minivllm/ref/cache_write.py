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

The second op here, :func:`copy_blocks`, copies whole blocks (every layer's
K and V) from one block id to another: the copies of copy-on-write, when
requests that share blocks (parallel sampling, beam search) write into a
shared one. vLLM keeps it beside ``reshape_and_cache`` too.
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


def _check_copy(kv_caches, block_mapping) -> None:
    """``ValueError`` unless ``kv_caches`` are like layers' caches and ``block_mapping`` is a
    step's copies: ``(num_pairs, 2)`` integers, distinct destinations, none also a source."""
    if not kv_caches:
        raise ValueError("kv_caches must hold at least one layer's (k_cache, v_cache)")
    k0 = kv_caches[0][0]
    for layer, (k_cache, v_cache) in enumerate(kv_caches):
        for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
            if t.dim() != 4 or t.shape != k0.shape or t.dtype != k0.dtype or t.device != k0.device:
                raise ValueError(
                    f"kv_caches[{layer}] {name} must be (num_blocks, block_size, num_kv_heads, "
                    f"head_dim) like layer 0's {tuple(k0.shape)} {k0.dtype} on {k0.device}, got "
                    f"{tuple(t.shape)} {t.dtype} on {t.device}")
    if block_mapping.dim() != 2 or block_mapping.shape[1] != 2 or block_mapping.is_floating_point():
        raise ValueError(f"block_mapping must be (num_pairs, 2) integer (src, dst) pairs, got "
                         f"{tuple(block_mapping.shape)} {block_mapping.dtype}")
    pairs = block_mapping.tolist()
    num_blocks = k0.shape[0]
    for src, dst in pairs:
        if not (0 <= src < num_blocks and 0 <= dst < num_blocks):
            raise ValueError(f"block_mapping pair ({src}, {dst}): block ids must be in "
                             f"[0, {num_blocks})")
    dsts = [dst for _, dst in pairs]
    if len(set(dsts)) != len(dsts) or set(dsts) & {src for src, _ in pairs}:
        raise ValueError(f"block_mapping {pairs}: destinations must be distinct and none may "
                         f"also be a source (the copies of one step are independent)")


def copy_blocks(
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]],  # per layer: 2 x (num_blocks, bs, H_kv, D)
    block_mapping: torch.Tensor,  # (num_pairs, 2) int64: (src, dst) block ids
) -> None:
    """Copy whole KV blocks in place: for each pair, every layer's K and V block ``src`` -> ``dst``.

    The copies of copy-on-write (``KVCacheManager.take_blocks_to_copy()`` of
    the KV cache manager): a
    request about to write into a block that another request shares gets a
    fresh block, which must first hold the shared block's K/V. The worker
    calls this before the step's forward writes the cache. The pairs are
    independent (distinct destinations, none also a source), so their order
    does not matter; a source may repeat.

    The engine calls it only in a step that has copies (a request forked:
    parallel sampling, beam search), so a package whose ``cache_write`` lacks
    it still serves every ``n=1`` request.

    Memory traffic: ``num_pairs * num_layers * 2`` blocks read and written,
    ``block_size * num_kv_heads * head_dim`` elements each. This version copies
    one block of one tensor per torch call (``2 * num_layers * num_pairs``
    calls); the fast twin does all of them in one op.
    """
    _check_copy(kv_caches, block_mapping)
    for src, dst in block_mapping.tolist():
        for k_cache, v_cache in kv_caches:
            k_cache[dst].copy_(k_cache[src])  # (block_size, H_kv, D)
            v_cache[dst].copy_(v_cache[src])
