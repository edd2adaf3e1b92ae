"""Course task: int8 quantize / dequantize / GEMV, against the formulas in float64."""

from __future__ import annotations

import torch

from minivllm import backend


def test_scale_is_max_over_127_and_levels_round_to_nearest():
    w = torch.tensor([[1.27, -0.5, 0.004, 0.006, 0.0, 0.0, 0.0, 0.0]])
    qw = backend.get("quantization").quantize_int8(w)
    torch.testing.assert_close(qw.scales, torch.tensor([[0.01]]), msg="s = max|W| / 127")
    assert qw.qweight.dtype == torch.int8
    assert qw.qweight[0].tolist() == [127, -50, 0, 1, 0, 0, 0, 0], "q = round(W / s)"


def test_zero_rows_and_groups_give_zeros_not_nans():
    ops = backend.get("quantization")
    w = torch.zeros(3, 64)
    w[1, 32:] = 2.0
    qw = ops.quantize_int8(w, group_size=32)
    deq = ops.dequantize_int8(qw.qweight, qw.scales)
    assert not torch.isnan(deq).any(), "an all-zero group must not divide by zero"
    torch.testing.assert_close(deq, w)


def test_gemv_equals_x_times_dequantized_w_in_float64():
    ops = backend.get("quantization")
    g = torch.Generator().manual_seed(0)
    w = torch.randn(37, 96, generator=g) * torch.logspace(-3, 1, 37).unsqueeze(1)
    qw = ops.quantize_int8(w, group_size=32)
    q, s = qw.qweight.double(), qw.scales.double()
    w_deq = (q.reshape(37, 3, 32) * s.unsqueeze(-1)).reshape(37, 96)  # s * q, by hand
    torch.testing.assert_close(ops.dequantize_int8(qw.qweight, qw.scales).double(), w_deq)
    x = torch.randn(3, 96, generator=g)
    y = ops.int8_gemv(x, qw.qweight, qw.scales)
    assert y.shape == (3, 37) and y.dtype == torch.float32
    torch.testing.assert_close(y.double(), x.double() @ w_deq.T, rtol=1e-5, atol=1e-5)
    assert ((w_deq - w.double()).abs() <= s.repeat_interleave(32, 1) / 2 + 1e-9).all()
