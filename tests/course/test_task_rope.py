"""Course task: RoPE, one pair at a time, against the rotation written out by hand."""

from __future__ import annotations

import math

import pytest
import torch

from minivllm import backend


@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "gptj"])
def test_each_pair_rotates_by_position_times_frequency(is_neox):
    head_dim, rotary_dim, max_pos = 8, 8, 16
    inv_freq = [1.0 / 100 ** (2 * i / rotary_dim) for i in range(rotary_dim // 2)]
    cache = torch.tensor([[math.cos(p * f) for f in inv_freq] + [math.sin(p * f) for f in inv_freq]
                          for p in range(max_pos)])
    positions = torch.tensor([0, 3, 11])
    q = torch.randn(3, 4, head_dim, generator=torch.Generator().manual_seed(0))
    k = torch.randn(3, 2, head_dim, generator=torch.Generator().manual_seed(1))
    q_out, k_out = backend.get("rotary").apply_rotary_emb(positions, q.clone(), k.clone(), cache,
                                                          is_neox_style=is_neox)
    for x, out in ((q, q_out), (k, k_out)):
        for t, p in enumerate(positions.tolist()):
            for i, f in enumerate(inv_freq):
                a, b = (i, i + rotary_dim // 2) if is_neox else (2 * i, 2 * i + 1)
                c, s = math.cos(p * f), math.sin(p * f)
                want = (x[t, :, a] * c - x[t, :, b] * s, x[t, :, b] * c + x[t, :, a] * s)
                got = (out[t, :, a], out[t, :, b])
                for g, w in zip(got, want):
                    torch.testing.assert_close(
                        g, w, rtol=1e-5, atol=1e-5,
                        msg=f"position {p}: features ({a}, {b}) are a pair rotated by {p}*{f:.3g}")
