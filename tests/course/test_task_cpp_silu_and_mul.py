"""Course task: SiLU-and-mul as a C++ op, built with torch.utils.cpp_extension, against
``silu(g) * u`` in float64.

The extension is compiled when this module is imported (collection has no
timeout; a first build takes a minute or more, later ones are cached). A
compile error is reported by every test, with the compiler's last line.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_task import kernel_module

cpp = kernel_module("activation", "activation_cpp")
try:
    cpp._library()
    BUILD_ERROR = None
except Exception as e:  # a compile error in the student's C++: every test says so
    lines = [line for line in str(e).splitlines() if "error" in line.lower()] or [str(e)]
    BUILD_ERROR = f"the C++ extension did not build: {lines[0][:300]}"


def _oracle(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.double().chunk(2, dim=-1)
    return F.silu(gate) * up


@pytest.fixture(autouse=True)
def _built():
    if BUILD_ERROR:
        pytest.fail(BUILD_ERROR, pytrace=False)


@pytest.mark.parametrize("rows,inter", [(1, 1), (7, 13), (3, 1500), (64, 96)])
def test_matches_the_formula_float32(rows, inter):
    """Awkward sizes, and rows longer than the kernel's 1024-feature chunks."""
    x = torch.randn(rows, 2 * inter, generator=torch.Generator().manual_seed(rows + inter)) * 4
    out = cpp.silu_and_mul(x)
    assert out.shape == (rows, inter) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), _oracle(x), rtol=1e-5, atol=1e-6)


def test_bf16_rounds_once():
    x = torch.randn(5, 2 * 300, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    out = cpp.silu_and_mul(x)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), _oracle(x), rtol=1e-2, atol=1e-2)


def test_gate_is_the_first_half_and_large_gates_saturate():
    x = torch.zeros(2, 8)
    x[0, :4] = torch.tensor([-100.0, -5.0, 5.0, 100.0])  # gates: silu -> 0, ..., -> g
    x[0, 4:] = 2.0  # up
    x[1, :4] = 1.0
    x[1, 4:] = torch.tensor([1.0, 2.0, 3.0, 4.0])
    out = cpp.silu_and_mul(x)
    assert torch.isfinite(out).all(), "exp() of a large |gate| must not give inf/NaN"
    torch.testing.assert_close(out.double(), _oracle(x), rtol=1e-5, atol=1e-6)


def test_strided_rows_and_3d_input():
    wide = torch.randn(6, 50, generator=torch.Generator().manual_seed(4))
    x = wide[:, 5:45]  # row stride 50, unit column stride: read in place
    torch.testing.assert_close(cpp.silu_and_mul(x).double(), _oracle(x), rtol=1e-5, atol=1e-6)
    x3 = torch.randn(2, 3, 10, generator=torch.Generator().manual_seed(5))
    out = cpp.silu_and_mul(x3)
    assert out.shape == (2, 3, 5)
    torch.testing.assert_close(out.double(), _oracle(x3), rtol=1e-5, atol=1e-6)
