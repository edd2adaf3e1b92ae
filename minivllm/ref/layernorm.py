"""RMSNorm, and RMSNorm fused with the residual add that precedes it.

``rms_norm(x) = x / sqrt(mean(x^2) + eps) * weight``, computed in float32 and
cast back to the input dtype (as transformers' ``LlamaRMSNorm`` does).

Memory traffic of the unfused pair ``residual = x + residual; y = norm(residual)``:
the add reads 2 and writes 1 tensor, the norm reads 1 and writes 1: five
passes over ``num_tokens * hidden`` elements. The fused kernel in
``minivllm/fast/layernorm.py`` does it in three (read x, read residual, write
both outputs... with the residual written in place).
"""

from __future__ import annotations

import torch


def rms_norm(
    x: torch.Tensor,  # (num_tokens, hidden)
    weight: torch.Tensor,  # (hidden,)
    eps: float,
) -> torch.Tensor:
    """RMS-normalise each row of ``x`` and scale by ``weight``."""
    # BEGIN SOLUTION
    dtype = x.dtype
    x32 = x.float()
    variance = x32.pow(2).mean(dim=-1, keepdim=True)
    x32 = x32 * torch.rsqrt(variance + eps)
    return weight * x32.to(dtype)
    # END SOLUTION


def fused_add_rms_norm(
    x: torch.Tensor,  # (num_tokens, hidden)
    residual: torch.Tensor,  # (num_tokens, hidden)
    weight: torch.Tensor,  # (hidden,)
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``(rms_norm(x + residual), x + residual)``.

    The second output is the new residual stream. Implementations may write
    into ``x`` and ``residual``; callers must not reuse them afterwards.
    """
    # BEGIN SOLUTION
    residual = x + residual
    return rms_norm(residual, weight, eps), residual
    # END SOLUTION
