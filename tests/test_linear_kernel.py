"""The one dispatch rule for a projection's C++ kernel, and the C++ layer stack's kind table.

:func:`minivllm.fast.linear_kernel.projection_kernel` decides which kernel
multiplies a weight, for the linear forward and the C++ layer stack alike; the
layer stack numbers the kinds in C++ and exports its table. These tests check
the two tables hold the same names (both directions), the rule against a
table written out here from the kernels' contracts, and that the linear
forward follows the rule. That the layer stack gives the model's bits for
every kind is ``tests/test_model_runner.py``'s.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from minivllm.fast import cpu_ops
from minivllm.fast import quantization as fast_quantization
from minivllm.fast.linear_kernel import (
    FLOAT_GEMV_MAX_ROWS,
    KINDS,
    kind_numbers,
    projection_kernel,
)
from minivllm.fast.linear_prepack import PANEL_MAX_ROWS, PanelWeight, prepack_weight
from minivllm.ref import quantization as ref_quantization

pytestmark = pytest.mark.skipif(not cpu_ops.available(), reason="the C++ ops did not build")


def test_python_and_cpp_kind_tables_hold_the_same_names() -> None:
    cpp = list(cpu_ops.ops().decode_layers_kinds())
    assert len(set(cpp)) == len(cpp), f"the C++ table names a kind twice: {cpp}"
    assert not set(KINDS) - set(cpp), f"C++ lacks {sorted(set(KINDS) - set(cpp))}"
    assert not set(cpp) - set(KINDS), f"Python lacks {sorted(set(cpp) - set(KINDS))}"
    assert kind_numbers() == {name: i for i, name in enumerate(cpp)}


def test_activation_group_size_is_the_refs() -> None:
    assert cpu_ops.ops().act_group_size() == ref_quantization.ACT_GROUP_SIZE


def test_python_and_cpp_float_gemv_rows_agree() -> None:
    """The layer stack's C++ switch from the GEMV to the panels, and Python's."""
    assert cpu_ops.ops().float_gemv_max_rows() == FLOAT_GEMV_MAX_ROWS


def test_a_float32_weight_with_panels_serves_more_rows() -> None:
    w = _weights()["float32"]
    packed = prepack_weight(w)
    got = projection_kernel(w, packed)
    if not isinstance(packed, PanelWeight):  # no AVX-512 in this build: the GEMV alone
        assert (got.kind, got.max_rows) == ("float", FLOAT_GEMV_MAX_ROWS)
        return
    assert (got.kind, got.max_rows) == ("float", PANEL_MAX_ROWS)
    assert got.tensors[0] is w and got.tensors[1] is packed.panels
    bf16 = w.bfloat16()  # oneDNN's copy, or none: the GEMV's rows
    assert projection_kernel(bf16, prepack_weight(bf16)).max_rows == FLOAT_GEMV_MAX_ROWS


def _weights() -> dict[str, object]:
    """One weight per case, (48, 96): K a multiple of every group size."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 96, generator=g)
    int8 = replace(fast_quantization.quantize_int8(w), ops=fast_quantization)
    int4 = replace(fast_quantization.quantize_int4(w), ops=fast_quantization)
    return {
        "float32": w, "bfloat16": w.bfloat16(), "float16": w.half(),
        "transposed": w.t().contiguous().t(), "3-D": w[None],
        "int8": int8, "int4": int4,
        "int8 act": replace(int8, activations="int8"),
        "int4 act": replace(int4, activations="int8"),
        "int8 fp16 scales": replace(int8, scales=int8.scales.half()),
        "int8 act fp16 scales": replace(int8, activations="int8", scales=int8.scales.half()),
    }


# The kernels' contracts, written out: the GEMV reads float32 / bf16 rows of a 2-D
# contiguous weight; the W8A16 / W4A16 kernels float32 scales; the W8A8 / W4A8 ones
# float32 or float16 scales, at any number of rows.
EXPECTED = {
    "float32": ("float", 16), "bfloat16": ("float", 16), "float16": None,
    "transposed": None, "3-D": None,
    "int8": ("w8a16", 128), "int4": ("w4a16", 128),
    "int8 act": ("w8a8", None), "int4 act": ("w4a8", None),
    "int8 fp16 scales": None, "int8 act fp16 scales": ("w8a8", None),
}


@pytest.mark.parametrize("case", list(EXPECTED))
def test_projection_kernel_follows_the_kernels_contracts(case: str) -> None:
    got = projection_kernel(_weights()[case])
    if EXPECTED[case] is None:
        assert isinstance(got, str), f"{case}: no C++ kernel takes it, got {got}"
        return
    assert not isinstance(got, str), f"{case}: {got}"
    assert (got.kind, got.max_rows) == EXPECTED[case]
    assert got.kind in KINDS


def test_projection_kernel_hands_over_the_weights_own_tensors() -> None:
    weights = _weights()
    w, int8, int4 = weights["float32"], weights["int8"], weights["int4"]
    assert all(t is w for t in projection_kernel(w).tensors)
    q, s, m, packed = projection_kernel(int4).tensors  # no copy: the qweight again
    assert q is int4.qweight and s is int4.scales and m is int4.mins and packed is q
    q, s, second, placeholder = projection_kernel(int8).tensors
    assert q is int8.qweight and s is int8.scales and second is int8.scales and placeholder is q
    copy = torch.empty(1, 1, 640, dtype=torch.uint8)  # a W4A8 weight's prepacked copy
    assert projection_kernel(int4, copy).tensors[3] is copy


@pytest.mark.parametrize("case", ["int8", "int4", "int8 act", "int8 fp16 scales"])
def test_the_linear_forward_takes_the_rules_kernel(case: str, monkeypatch) -> None:
    """The fast matmul calls the C++ op the rule names, and the ref where it names none."""
    weight = _weights()[case]
    x = torch.randn(3, 96, generator=torch.Generator().manual_seed(1))
    calls: list[str] = []
    ops = cpu_ops.ops()
    for name in ("int8_linear", "int4_linear", "w8a8_linear", "w4a8_linear"):
        real = getattr(ops, name)
        monkeypatch.setattr(ops, name, lambda *a, real=real, name=name: (calls.append(name),
                                                                          real(*a))[1])
    ref_calls: list[int] = []
    ref = fast_quantization.ref_quantized_linear
    monkeypatch.setattr(fast_quantization, "ref_quantized_linear",
                        lambda *a: (ref_calls.append(1), ref(*a))[1])
    fast_quantization.quantized_linear(x, weight)
    kernel = projection_kernel(weight)
    want = {"w8a16": "int8_linear", "w4a16": "int4_linear", "w8a8": "w8a8_linear",
            "w4a8": "w4a8_linear"}
    if isinstance(kernel, str):
        assert ref_calls and not calls
    else:
        assert calls == [want[kernel.kind]] and not ref_calls
