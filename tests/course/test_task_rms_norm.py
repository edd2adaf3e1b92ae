"""Course task: RMSNorm, called directly, on rows where epsilon matters.

``rms_norm(x) = x / sqrt(mean(x^2) + eps) * weight``. On rows of ordinary size
``eps`` is invisible, so an epsilon added outside the square root passes; here
some rows are tiny (mean square around ``eps``) and the oracle is that formula
in float64.
"""

from __future__ import annotations

import pytest
import torch
from kernel_utils import DEVICE, assert_close

from minivllm import backend


def _oracle(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    x64 = x.double()
    return x64 / torch.sqrt(x64.pow(2).mean(-1, keepdim=True) + eps) * w.double()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("hidden", [8, 40, 130])
def test_rms_norm_small_rows(hidden, dtype):
    g = torch.Generator().manual_seed(hidden)
    eps = 1e-5
    scales = torch.tensor([1e-4, 1e-3, 3e-3, 1e-2, 1.0, 5.0])[:, None]  # one row each
    x = (torch.randn(6, hidden, generator=g) * scales).to(dtype)
    w = (1 + 0.2 * torch.randn(hidden, generator=g)).to(dtype)
    out = backend.get("layernorm").rms_norm(x.to(DEVICE), w.to(DEVICE), eps).cpu()
    assert out.shape == x.shape and out.dtype == dtype
    want = _oracle(x, w, eps)
    for row in range(6):
        assert_close(out[row], want[row], dtype, scale=2)


def test_rms_norm_eps_is_inside_the_square_root():
    x = torch.full((1, 4), 1e-3)  # mean square 1e-6
    eps = 3e-6
    out = backend.get("layernorm").rms_norm(x.to(DEVICE), torch.ones(4, device=DEVICE), eps)
    expected = 1e-3 / (1e-6 + eps) ** 0.5  # 0.5, not 1e-3 / (1e-3 + 3e-6) ~ 0.997
    assert float(out[0, 0]) == pytest.approx(expected, rel=1e-4), (
        f"rms_norm of a row of 1e-3 with eps={eps} gave {float(out[0, 0]):.4f}, expected "
        f"{expected:.4f}: is eps added inside the square root?")
