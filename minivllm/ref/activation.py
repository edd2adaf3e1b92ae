"""SiLU-and-mul, the gated activation of Llama's MLP.

The fused gate/up projection produces ``(num_tokens, 2 * I)``: the gate in
the first half of each row, the up projection in the second. Then::

    silu_and_mul(x) = silu(gate) * up,   silu(g) = g * sigmoid(g) = g / (1 + exp(-g))

Memory traffic: the minimum is ``2 * T * I`` element reads and ``T * I``
writes. This eager version also writes and re-reads the ``T * I`` silu
intermediate (``5 * T * I`` in all, two launches); the Triton twin
(:mod:`minivllm.fast.activation`) does not.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:  # (T, 2I) -> (T, I)
    """``silu(x[..., :I]) * x[..., I:]`` with ``silu(g) = g * sigmoid(g)``."""
    if x.dim() < 1 or x.shape[-1] % 2 != 0:
        raise ValueError(f"x's last dimension must be even (gate | up), got {tuple(x.shape)}")
    # BEGIN SOLUTION
    inter = x.shape[-1] // 2
    gate = x[..., :inter]  # (T, I)
    up = x[..., inter:]  # (T, I)
    # F.silu computes g * sigmoid(g) in float32 and rounds once, as transformers does.
    return F.silu(gate) * up
    # END SOLUTION
