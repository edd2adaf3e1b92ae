"""SiLU-and-mul, the gated activation of Llama's MLP.

The fused gate/up projection produces ``(num_tokens, 2 * intermediate)``:
the gate in the first half, the up projection in the second.
``silu_and_mul(x) = silu(gate) * up``.

Memory traffic: reads ``2 * T * I`` elements, writes ``T * I``. In eager
torch ``F.silu(gate) * up`` writes and re-reads an extra ``T * I``
intermediate; the Triton twin does not.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:  # (T, 2I) -> (T, I)
    """``silu(x[..., :I]) * x[..., I:]``."""
    # BEGIN SOLUTION
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
    # END SOLUTION
