"""The float32 panel GEMM (``csrc/gemm_panels.cpp``) against a float64 matmul.

``torch.ops.minivllm.gemm_panels`` multiplies by a weight packed once into (P, K, 48)
panels (``fast/linear_prepack.py:pack_panels``). The oracle is ``x W^T + b`` in
float64 on the same inputs: row counts that leave a partial block of 8, output
features that leave a partial last panel, K of 1 to hundreds, large and small
magnitudes, and ``x`` whose rows are a strided view. The fast linear's dispatch
around :data:`PANEL_MAX_ROWS` (panels below, ``F.linear`` above) is checked the same way.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minivllm.fast import linear as fast_linear
from minivllm.fast import linear_prepack

WIDTH = linear_prepack._panel_width()
needs_panels = pytest.mark.skipif(WIDTH == 0, reason="this C++ build has no gemm_panels "
                                  "(it needs AVX-512F); oneDNN's GEMM runs instead")


def _oracle(x, w, b):
    y = x.double() @ w.double().T
    return y if b is None else y + b.double()


def _close(y, expect, k):
    scale = expect.abs().max().item() if expect.numel() else 0.0
    torch.testing.assert_close(y.double(), expect, rtol=2e-5, atol=2e-6 * k ** 0.5 * max(scale, 1e-30))


@needs_panels
@settings(max_examples=60, deadline=None)
@given(m=st.integers(1, 70), n=st.integers(1, 150), k=st.integers(1, 300),
       bias=st.booleans(), magnitude=st.sampled_from([1e-6, 1.0, 1e4]), seed=st.integers(0, 2**16))
def test_panels_match_float64(m, n, k, bias, magnitude, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * magnitude
    w = torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) * magnitude if bias else None
    packed = linear_prepack.pack_panels(w, WIDTH)
    assert packed.panels.shape == (-(-n // WIDTH), k, WIDTH) and packed.n == n
    out = torch.full((m, n), float("nan"))
    torch.ops.minivllm.gemm_panels(out, x, packed.panels, b)
    _close(out, _oracle(x, w, b), k)


@needs_panels
@pytest.mark.parametrize("m", [17, 64, 129])
def test_strided_rows_and_the_real_shapes(m):
    """x's rows a view with a row stride wider than K; SmolLM2's K = 576 and N = 1537."""
    g = torch.Generator().manual_seed(m)
    k, n = 576, 1537
    wide = torch.randn(m, k + 40, generator=g)
    x = wide[:, 7:7 + k]  # row stride k + 40, unit element stride
    w, b = torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    y = linear_prepack.panel_linear(x, linear_prepack.pack_panels(w, WIDTH), b)
    _close(y, _oracle(x, w, b), k)


@needs_panels
def test_the_loader_packs_float32_as_panels():
    w = torch.randn(100, 64)
    assert isinstance(fast_linear.prepack_weight(w), linear_prepack.PanelWeight)
    assert isinstance(fast_linear.prepack_weight(w, panels=False), (torch.Tensor, type(None)))
    if torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported():
        assert isinstance(fast_linear.prepack_weight(w.bfloat16()), torch.Tensor)  # oneDNN's


@needs_panels
@pytest.mark.parametrize("m", [fast_linear.GEMV_MAX_ROWS + 1, linear_prepack.PANEL_MAX_ROWS,
                               linear_prepack.PANEL_MAX_ROWS + 1])
def test_linear_dispatch_around_panel_max_rows(m, monkeypatch):
    """Up to PANEL_MAX_ROWS the panels answer, above it F.linear on the plain weight."""
    g = torch.Generator().manual_seed(m)
    w, b = torch.randn(49, 72, generator=g), torch.randn(49, generator=g)
    x = torch.randn(m, 72, generator=g)
    packed = fast_linear.prepack_weight(w)
    calls = []
    real = linear_prepack.panel_linear
    monkeypatch.setattr(linear_prepack, "panel_linear",
                        lambda *a: calls.append(1) or real(*a))
    y = fast_linear.linear(x, w, b, packed=packed)
    assert bool(calls) == (m <= linear_prepack.PANEL_MAX_ROWS)
    _close(y, _oracle(x, w, b), 72)


@needs_panels
def test_bad_shapes_are_refused():
    x, w = torch.randn(4, 8), torch.randn(10, 8)
    packed = linear_prepack.pack_panels(w, WIDTH)
    with pytest.raises(RuntimeError, match="panels must be contiguous"):
        torch.ops.minivllm.gemm_panels(torch.empty(4, 10), torch.randn(4, 9), packed.panels, None)
    with pytest.raises(RuntimeError, match="out must be contiguous"):
        torch.ops.minivllm.gemm_panels(torch.empty(4, 10 + WIDTH), x, packed.panels, None)
    with pytest.raises(RuntimeError, match="bias"):
        torch.ops.minivllm.gemm_panels(torch.empty(4, 10), x, packed.panels, torch.randn(9))
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.minivllm.gemm_panels(torch.empty(4, 10), x.double(), packed.panels, None)
