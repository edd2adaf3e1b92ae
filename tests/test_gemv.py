"""The fast ``linear`` twin's small-M C++ kernel (``minivllm/fast/csrc/gemv.cpp``).

Oracle: a float64 matmul of the same bf16 or float32 weights (and the same
activations, rounded to the activation dtype). Awkward shapes: every M from 1 to 17 (17
goes to ``F.linear``), K and N that are not multiples of 16 or 32, so a kernel
that drops or double-counts a tail element fails. Both the compiled path
(AVX-512 BF16 where the CPU has it) and the portable float32-FMA path run.
"""

from __future__ import annotations

import pytest
import torch

from minivllm.fast import cpu_ops
from minivllm.fast import linear as fast_linear

pytestmark = pytest.mark.skipif(not cpu_ops.available(),
                                reason=f"C++ CPU ops unavailable: {cpu_ops.unavailable_reason()}")

SHAPES = [(576, 1537), (1823, 781), (33, 17), (7, 1), (64, 576)]  # (K, N)


def oracle(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    y = x.double() @ w.double().T
    return y if b is None else y + b.double()


def check(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b=None,
          rounded_before_bias: bool = False) -> None:
    """Within the rounding of the output dtype plus fp32 accumulation over K.

    ``rounded_before_bias``: the layer rounds ``x W^T`` to the output dtype and
    then adds the bias (the row-parallel layer: bias after the all-reduce).
    """
    expect = oracle(x, w, b)
    rounded = oracle(x, w, None).abs() if rounded_before_bias else 0
    assert y.dtype == x.dtype and y.shape == expect.shape
    # The scale of the sum: |x| . |w|, so cancellation does not loosen the test.
    mag = x.double().abs() @ w.double().abs().T + 1e-30
    out_eps = 2.0**-8 if y.dtype == torch.bfloat16 else 2.0**-20
    err = (y.double() - expect).abs()
    # bf16 activations on the BF16 path are exact products; float32 ones keep ~16 bits.
    bound = mag * (2.0**-14) + (expect.abs() + rounded) * out_eps
    assert (err <= bound).all(), err.max().item()


@pytest.mark.parametrize("portable", [False, True], ids=["native", "portable"])
@pytest.mark.parametrize("act", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("k,n", SHAPES)
def test_small_m_against_float64(k, n, act, portable) -> None:
    g = torch.Generator().manual_seed(k * 31 + n)
    w = torch.randn(n, k, generator=g).to(torch.bfloat16)
    b = torch.randn(n, generator=g).to(act)
    for m in range(1, 18 if act == torch.bfloat16 else 17):  # F.linear needs one dtype
        x = torch.randn(m, k, generator=g).to(act)
        check(fast_linear.linear(x, w, None, portable=portable), x, w)
        check(fast_linear.linear(x, w, b, portable=portable), x, w, b)


@pytest.mark.parametrize("portable", [False, True], ids=["native", "portable"])
def test_tail_elements_count(portable) -> None:
    """Only the last element of each K row is non-zero: a dropped tail gives 0."""
    for k in (1, 31, 33, 63, 65, 577):
        w = torch.zeros(5, k, dtype=torch.bfloat16)
        w[:, -1] = torch.arange(1, 6, dtype=torch.bfloat16)
        x = torch.zeros(3, k)
        x[:, -1] = 2.0
        y = fast_linear.linear(x, w, portable=portable)
        assert torch.equal(y, torch.tensor([[2.0, 4, 6, 8, 10]] * 3)), (k, y)


@pytest.mark.parametrize("portable", [False, True], ids=["native", "portable"])
def test_strided_and_batched_inputs(portable) -> None:
    g = torch.Generator().manual_seed(1)
    w = torch.randn(781, 200, generator=g).to(torch.bfloat16)
    wide = torch.randn(5, 450, generator=g)
    x = wide[:, 100:300]  # rows with a stride: a narrowed (row-parallel) input
    check(fast_linear.linear(x, w, portable=portable), x, w)
    xt = torch.randn(200, 3, generator=g).T  # no unit stride at all: copied first
    check(fast_linear.linear(xt, w, portable=portable), xt, w)
    x3 = torch.randn(2, 3, 200, generator=g).to(torch.bfloat16)  # (B, T, K)
    y3 = fast_linear.linear(x3, w, portable=portable)
    assert y3.shape == (2, 3, 781)
    check(y3.reshape(6, 781), x3.reshape(6, 200), w)


def check_f32(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b=None) -> None:
    """float32 weights and activations: float32 accumulation error over K only."""
    expect = oracle(x, w, b)
    assert y.dtype == x.dtype and y.shape == expect.shape
    mag = x.double().abs() @ w.double().abs().T + (0 if b is None else b.double().abs())
    bound = mag * (x.shape[-1] + 2) * 2.0**-24 + 1e-30
    if x.dtype == torch.bfloat16:  # the output is rounded to bf16
        bound = bound + expect.abs() * 2.0**-8
    assert ((y.double() - expect).abs() <= bound).all()


@pytest.mark.parametrize("act", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("k,n", SHAPES + [(577, 1029)])
def test_float32_weights_against_float64(k, n, act) -> None:
    """Float32 weights: M = 1..17 (17 is F.linear's), K % 8 != 0, N % 8 != 0."""
    g = torch.Generator().manual_seed(k * 17 + n)
    w = torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g)
    # F.linear (m = 17) needs one dtype: bf16 activations only where the GEMV runs.
    top = fast_linear.GEMV_MAX_ROWS + (2 if act == torch.float32 else 1)
    rows = range(1, top)
    for m in rows:
        x = torch.randn(m, k, generator=g).to(act)
        check_f32(fast_linear.linear(x, w), x, w)
        check_f32(fast_linear.linear(x, w, b), x, w, b)
    wide = torch.randn(5, 2 * k + 3, generator=g)
    x = wide[:, 3 : 3 + k]  # rows with a stride: not contiguous
    check_f32(fast_linear.linear(x, w, b), x, w, b)
    xt = torch.randn(k, 3, generator=g).T  # no unit stride: copied first
    check_f32(fast_linear.linear(xt, w), xt, w)


def test_float32_tail_elements_count() -> None:
    """Only the last element of each float32 K row is non-zero: a dropped tail gives 0."""
    for k in (1, 7, 9, 15, 17, 577):
        w = torch.zeros(5, k)
        w[:, -1] = torch.arange(1.0, 6.0)
        for m in (1, 3):  # the 1 x 8 block and the 2 x 4 block with an odd row
            x = torch.zeros(m, k)
            x[:, -1] = 2.0
            y = torch.empty(m, 5)
            cpu_ops.ops().linear_small_m(y, x, w, None, False)
            assert torch.equal(y, torch.tensor([[2.0, 4, 6, 8, 10]] * m)), (k, m, y)


def test_dispatch_rules() -> None:
    """The GEMV serves 1 to 16 rows; everything else is F.linear's."""
    w16 = torch.zeros(8, 8, dtype=torch.bfloat16)
    assert fast_linear._gemv_applies(torch.zeros(1, 8), w16)
    assert fast_linear._gemv_applies(torch.zeros(16, 8), w16)
    assert not fast_linear._gemv_applies(torch.zeros(17, 8), w16)
    assert fast_linear._gemv_applies(torch.zeros(1, 8), w16.float())
    assert fast_linear._gemv_applies(torch.zeros(2, 8), w16.float())
    assert fast_linear._gemv_applies(torch.zeros(4, 4, 8), w16.float())
    assert not fast_linear._gemv_applies(torch.zeros(17, 8), w16.float())
    assert not fast_linear._gemv_applies(torch.zeros(2, 8), w16.half())
    assert not fast_linear._gemv_applies(torch.zeros(1, 8, dtype=torch.float16), w16)


def test_fused_and_sharded_layers_use_it() -> None:
    """The fused QKV / gate-up and the row-parallel layer at tp=1 vs float64."""
    g = torch.Generator().manual_seed(2)
    qkv = fast_linear.QKVParallelLinear(96, 16, 3, 1, bias=True).to(torch.bfloat16)
    mlp = fast_linear.MergedColumnParallelLinear(96, [70, 70]).to(torch.bfloat16)
    down = fast_linear.RowParallelLinear(140, 96, bias=True).to(torch.bfloat16)
    for layer in (qkv, mlp, down):
        for p in layer.parameters():
            p.data.copy_(torch.randn(p.shape, generator=g))
    x = torch.randn(3, 96, generator=g).to(torch.bfloat16)
    check(qkv(x), x, qkv.weight, qkv.bias)
    check(mlp(x), x, mlp.weight)
    h = torch.randn(3, 140, generator=g).to(torch.bfloat16)
    check(down(h), h, down.weight, down.bias, rounded_before_bias=True)


def test_bad_shapes_raise() -> None:
    ops = cpu_ops.ops()
    w = torch.zeros(4, 8, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="weight"):
        ops.linear_small_m(torch.empty(1, 4), torch.zeros(1, 9), w, None, False)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        ops.linear_small_m(torch.empty(1, 4), torch.zeros(1, 8), w.half(), None, False)


def test_ref_twin_is_the_textbook_matmul() -> None:
    from minivllm.ref import linear as ref_linear

    g = torch.Generator().manual_seed(3)
    w = torch.randn(781, 33, generator=g).to(torch.bfloat16)
    x = torch.randn(5, 33, generator=g).to(torch.bfloat16)
    b = torch.randn(781, generator=g).to(torch.bfloat16)
    check(ref_linear.linear(x, w, b), x, w, b, rounded_before_bias=True)


@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("w_dtype,portable", [(torch.bfloat16, False), (torch.bfloat16, True),
                                              (torch.float32, False)])
@pytest.mark.parametrize("k,n", [(576, 1537), (31, 9), (100, 37)])
def test_one_row_gives_the_bits_of_a_row_among_many(x_dtype, w_dtype, portable, k, n):
    """One row runs blocks of its own (8 weight rows; with AVX-512 BF16 its accumulators in
    registers); a row's result must not depend on the rows beside it: the same bits as
    that row in a call of 2 and of 5 rows (the general blocks; a K of 31 / 100 / 576 leaves
    a tail of 31 / 4 / 0 past a multiple of 32)."""
    g = torch.Generator().manual_seed(k + n)
    w = torch.randn(n, k, generator=g).to(w_dtype)
    x = torch.randn(5, k, generator=g).to(x_dtype)
    op = cpu_ops.ops().linear_small_m
    for rows in (2, 5):
        many = torch.empty(rows, n, dtype=x_dtype)
        op(many, x[:rows], w, None, portable)
        for r in range(rows):
            one = torch.empty(1, n, dtype=x_dtype)
            op(one, x[r : r + 1], w, None, portable)
            assert torch.equal(one[0], many[r]), (rows, r)
