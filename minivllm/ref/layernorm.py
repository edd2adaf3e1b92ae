"""RMSNorm, and RMSNorm fused with the residual add that precedes it.

For each row ``x`` of ``hidden`` features::

    rms_norm(x) = x / sqrt(mean(x**2) + eps) * weight

``eps`` sits *inside* the square root (as in transformers' ``LlamaRMSNorm``
and vLLM), so a row of tiny values is scaled by about ``1 / sqrt(eps)``, not
blown up to unit size. The statistics are taken in float32; the normalised
row is rounded back to the input dtype and only then multiplied by
``weight``, exactly as ``LlamaRMSNorm`` rounds.

Memory traffic of the decoder layer's ``residual = x + residual; y =
rms_norm(residual)``, counted in ``N = num_tokens * hidden`` elements: done as
two operations it needs at least 5N (the add reads 2N and writes N, the norm
reads N and writes N). The fused Triton twin (:mod:`minivllm.fast.layernorm`)
needs 4N (read ``x`` and ``residual``, write the new residual and the output)
in one launch. This eager version, in bf16, moves about 21 times the bytes of
one ``(num_tokens, hidden)`` tensor against the fused kernel's 4
(``tutorials/05_kernel_fusion.py`` counts them op by op): every step below
(upcast, square, mean, scale, downcast, weight) is its own pass over the rows,
and the float32 intermediates are twice the size.
"""

from __future__ import annotations

import torch


def _check(x: torch.Tensor, weight: torch.Tensor) -> None:
    if x.dim() < 1 or weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(
            f"weight must be (hidden,) with hidden = x.shape[-1]; got x {tuple(x.shape)}, "
            f"weight {tuple(weight.shape)}"
        )


def rms_norm(
    x: torch.Tensor,  # (num_tokens, hidden)
    weight: torch.Tensor,  # (hidden,)
    eps: float,
) -> torch.Tensor:  # (num_tokens, hidden)
    """``x / sqrt(mean(x**2, over hidden) + eps) * weight``, row by row."""
    _check(x, weight)
    # BEGIN SOLUTION
    x32 = x.float()  # (num_tokens, hidden)
    mean_square = x32.pow(2).mean(dim=-1, keepdim=True)  # (num_tokens, 1)
    normed = x32 * torch.rsqrt(mean_square + eps)  # rsqrt as transformers does: same bits
    return weight * normed.to(x.dtype)
    # END SOLUTION


def fused_add_rms_norm(
    x: torch.Tensor,  # (num_tokens, hidden)
    residual: torch.Tensor,  # (num_tokens, hidden)
    weight: torch.Tensor,  # (hidden,)
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``(rms_norm(x + residual), x + residual)``.

    The second output is the new residual stream (the sum, rounded to the
    inputs' dtype). Implementations may write into ``x`` and ``residual``;
    callers must not reuse them afterwards.
    """
    _check(x, weight)
    if residual.shape != x.shape:
        raise ValueError(
            f"residual shape {tuple(residual.shape)} must equal x shape {tuple(x.shape)}"
        )
    # BEGIN SOLUTION
    new_residual = x + residual  # (num_tokens, hidden)
    return rms_norm(new_residual, weight, eps), new_residual
    # END SOLUTION
