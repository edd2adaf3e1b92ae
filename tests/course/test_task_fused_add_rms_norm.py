"""Course task: the residual add fused with RMSNorm, called directly, small rows included."""

from __future__ import annotations

import pytest
import torch
from kernel_utils import DEVICE, assert_close

from minivllm import backend


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_fused_add_rms_norm_small_rows(dtype):
    g = torch.Generator().manual_seed(3)
    eps = 1e-5
    scales = torch.tensor([1e-3, 2e-3, 1.0, 4.0])[:, None]
    x = (torch.randn(4, 24, generator=g) * scales).to(dtype)
    residual = (torch.randn(4, 24, generator=g) * scales).to(dtype)
    w = (1 + 0.2 * torch.randn(24, generator=g)).to(dtype)
    out, new_residual = backend.get("layernorm").fused_add_rms_norm(
        x.clone().to(DEVICE), residual.clone().to(DEVICE), w.to(DEVICE), eps)
    s = x.double() + residual.double()
    want = s / torch.sqrt(s.pow(2).mean(-1, keepdim=True) + eps) * w.double()
    assert_close(new_residual.cpu(), s, dtype)
    assert_close(out.cpu(), want, dtype, scale=2)
