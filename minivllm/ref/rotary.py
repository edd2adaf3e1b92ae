"""Rotary position embedding (RoPE), applied to queries and keys.

The features of each head are taken in pairs ``(a, b)``, and each pair is
rotated by the angle ``theta = position * inv_freq[i]``::

    a' = a * cos(theta) - b * sin(theta)
    b' = b * cos(theta) + a * sin(theta)

(the complex product ``(a + ib) * e^{i theta}``). The angles' cosines and
sines are precomputed once per model into ``cos_sin_cache`` of shape
``(max_position, rotary_dim)``: cosines in the first half of each row, sines
in the second (vLLM's layout). The rope_scaling variants (linear, dynamic
NTK, llama3, yarn) only change that cache; see ``minivllm/model/rope.py``.

Two pairings exist:

- NeoX style (Llama, Qwen in HF format): feature ``i`` pairs with
  ``i + rotary_dim/2`` ("rotate half").
- GPT-J style: feature ``2i`` pairs with ``2i + 1`` (interleaved).

If ``rotary_dim < head_dim`` only the first ``rotary_dim`` features rotate.
The rotation is computed in float32 and rounded once to the input dtype.
"""

from __future__ import annotations

import torch


def _check(positions, query, key, cos_sin_cache) -> None:
    if query.dim() != 3 or key.dim() != 3 or query.shape[0] != key.shape[0]:
        raise ValueError(
            f"query and key must be (num_tokens, heads, head_dim) with the same num_tokens, "
            f"got {tuple(query.shape)} and {tuple(key.shape)}"
        )
    if positions.shape != (query.shape[0],):
        raise ValueError(
            f"positions must have shape ({query.shape[0]},), got {tuple(positions.shape)}"
        )
    head_dim = min(query.shape[-1], key.shape[-1])
    rotary_dim = cos_sin_cache.shape[-1]
    if cos_sin_cache.dim() != 2 or rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
        raise ValueError(
            f"cos_sin_cache must be (max_position, rotary_dim) with rotary_dim even and in "
            f"[2, head_dim={head_dim}], got {tuple(cos_sin_cache.shape)}"
        )


def _rotate(
    x: torch.Tensor,  # (T, heads, head_dim)
    cos: torch.Tensor,  # (T, 1, rotary_dim // 2) float32
    sin: torch.Tensor,  # (T, 1, rotary_dim // 2) float32
    is_neox: bool,
) -> torch.Tensor:  # (T, heads, head_dim)
    """Rotate every pair ``(a, b)`` of ``x``'s first ``rotary_dim`` features."""
    # BEGIN SOLUTION
    half = cos.shape[-1]
    rotary_dim = 2 * half
    if is_neox:  # pairs (i, i + half)
        a_idx, b_idx = slice(0, half), slice(half, rotary_dim)
    else:  # pairs (2i, 2i + 1)
        a_idx, b_idx = slice(0, rotary_dim, 2), slice(1, rotary_dim, 2)
    a = x[..., a_idx].float()  # (T, heads, half)
    b = x[..., b_idx].float()  # (T, heads, half)
    out = x.clone()  # features past rotary_dim stay as they are
    out[..., a_idx] = a * cos - b * sin
    out[..., b_idx] = b * cos + a * sin
    return out
    # END SOLUTION


def apply_rotary_emb(
    positions: torch.Tensor,  # (num_tokens,) int64
    query: torch.Tensor,  # (num_tokens, num_heads, head_dim)
    key: torch.Tensor,  # (num_tokens, num_kv_heads, head_dim)
    cos_sin_cache: torch.Tensor,  # (max_position, rotary_dim) float32
    is_neox_style: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``query`` and ``key`` by their positions; return ``(query, key)``.

    Pair ``(a, b)`` becomes ``(a cos - b sin, b cos + a sin)`` with the angle
    of the token's position. Implementations may rotate in place; callers use
    the returned tensors.
    """
    _check(positions, query, key, cos_sin_cache)
    # BEGIN SOLUTION
    half = cos_sin_cache.shape[-1] // 2
    cos_sin = cos_sin_cache[positions].float()  # (T, rotary_dim): [cos | sin]
    cos = cos_sin[:, None, :half]  # (T, 1, half): broadcast over heads
    sin = cos_sin[:, None, half:]  # (T, 1, half)
    return _rotate(query, cos, sin, is_neox_style), _rotate(key, cos, sin, is_neox_style)
    # END SOLUTION
