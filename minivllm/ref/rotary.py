"""Rotary position embedding (RoPE), applied to queries and keys.

Each pair of features is rotated by an angle ``position * inv_freq[i]``. The
angles' cosines and sines are precomputed once per model into
``cos_sin_cache`` of shape ``(max_position, rotary_dim)``: cosines in the
first half of each row, sines in the second (vLLM's layout). The rope_scaling
variants (linear, dynamic NTK, llama3, yarn) only change that cache; see
``minivllm/model/rope.py``.

Two pairings exist:

- NeoX style (Llama, Qwen in HF format): feature ``i`` pairs with
  ``i + rotary_dim/2`` ("rotate half").
- GPT-J style: feature ``2i`` pairs with ``2i + 1`` (interleaved).

If ``rotary_dim < head_dim`` only the first ``rotary_dim`` features rotate.
"""

from __future__ import annotations

import torch


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, is_neox: bool) -> torch.Tensor:
    # x: (T, H, rotary_dim); cos/sin: (T, 1, rotary_dim // 2)
    # BEGIN SOLUTION
    if is_neox:
        x1, x2 = x.chunk(2, dim=-1)
    else:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    o1 = x1 * cos - x2 * sin
    o2 = x2 * cos + x1 * sin
    if is_neox:
        return torch.cat((o1, o2), dim=-1)
    return torch.stack((o1, o2), dim=-1).flatten(-2)
    # END SOLUTION


def apply_rotary_emb(
    positions: torch.Tensor,  # (num_tokens,) int64
    query: torch.Tensor,  # (num_tokens, num_heads, head_dim)
    key: torch.Tensor,  # (num_tokens, num_kv_heads, head_dim)
    cos_sin_cache: torch.Tensor,  # (max_position, rotary_dim) float32
    is_neox_style: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``query`` and ``key`` by their positions; return ``(query, key)``.

    Implementations may rotate in place; callers use the returned tensors.
    """
    # BEGIN SOLUTION
    rotary_dim = cos_sin_cache.shape[-1]
    cos, sin = cos_sin_cache[positions].chunk(2, dim=-1)  # (T, rotary_dim // 2) each
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    out = []
    for x in (query, key):
        rot = _rotate(x[..., :rotary_dim].float(), cos, sin, is_neox_style).to(x.dtype)
        out.append(torch.cat((rot, x[..., rotary_dim:]), dim=-1))
    return out[0], out[1]
    # END SOLUTION
