"""The greedy pick's C++ op (``torch.ops.minivllm.argmax_rows``) against ``torch.argmax``.

Exactly the same index on every row: ties (values rounded to a coarse grid, so most
rows hold several maxima, which must give the first one), NaN anywhere (argmax
counts NaN as the largest: the first NaN wins), rows of -inf, +0 against -0,
widths below, at and just past the op's 16-lane blocks, and rows that are
strided views. The fast sampler's greedy rows go through this op on a CPU.
Run: ``pytest -q tests/test_argmax.py``.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_utils import examples

from minivllm.fast import cpu_ops

pytestmark = pytest.mark.skipif(not cpu_ops.available(),
                                reason=f"the C++ ops did not build: {cpu_ops.unavailable_reason()}")


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    return cpu_ops.ops().argmax_rows(x)


@settings(max_examples=examples(200), deadline=None)
@given(rows=st.integers(1, 5), width=st.sampled_from([1, 2, 15, 16, 17, 31, 33, 100, 257, 4099]),
       grid=st.sampled_from([0.0, 0.5, 4.0]), nans=st.integers(0, 3), neg_inf_row=st.booleans(),
       stride_pad=st.sampled_from([0, 3]), seed=st.integers(0, 2**16))  # fmt: skip
def test_argmax_rows_is_torch_argmax(rows, width, grid, nans, neg_inf_row, stride_pad, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, width + stride_pad, generator=g)
    if grid:  # a coarse grid: many equal maxima per row
        x = torch.round(x * grid) / grid
    for _ in range(nans):  # NaN at random places of random rows
        x[torch.randint(rows, (), generator=g), torch.randint(width, (), generator=g)] = float("nan")
    if neg_inf_row:
        x[-1] = float("-inf")
    view = x[:, :width]  # rows stride_pad elements apart beyond their width
    assert torch.equal(argmax_rows(view), torch.argmax(view, dim=-1))


def test_signed_zeros_and_infinities():
    """A row whose largest value is a zero gets its first zero, +0 or -0 (they are
    equal); +inf beats everything but NaN; a row of -inf gets 0."""
    rows = torch.tensor([[-1.0, -0.0, 0.0, -0.0], [0.0, -0.0, -2.0, 0.0],
                         [1.0, float("inf"), float("inf"), 3.0],
                         [float("inf"), float("nan"), 1.0, float("nan")],
                         [float("-inf")] * 4])
    assert torch.equal(argmax_rows(rows), torch.argmax(rows, dim=-1))
    assert argmax_rows(rows).tolist() == [1, 0, 1, 1, 0]


def test_a_vocabulary_wide_batch():
    """SmolLM2's vocabulary, 64 rows (the thread team splits them), the maximum planted
    at a row's last element, inside its last 16-lane block and at its first element."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(64, 49152, generator=g)
    x[3, 49151] = x[5, 49140] = x[7, 0] = 100.0
    assert torch.equal(argmax_rows(x), torch.argmax(x, dim=-1))


def test_bad_input_is_a_clear_error():
    with pytest.raises(RuntimeError, match="float32"):
        argmax_rows(torch.zeros(2, 5, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="no logits"):
        argmax_rows(torch.zeros(2, 0))
