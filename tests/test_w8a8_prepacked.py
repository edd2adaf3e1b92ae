"""Int8 and 4-bit weights prepacked at load for batch-1 W8A8 / W4A8.

``prepack_w8a8`` / ``prepack_w4a8`` (``minivllm/fast/linear_prepack.py``) and the
C++ ops that read the copies, ``w8a8_linear_prepacked`` / ``w4a8_linear_prepacked``.
Oracles: each layout written out here, byte by byte, from its definition; the ref
twin's ``w8a8_matmul`` / ``w4a8_matmul``, which the C++ ops must equal *exactly* (the
same int32 group sums, the same float32 rescale in the same order), with awkward row
counts (a ragged last panel of 32), group counts, scale groups and magnitudes; and
the model's own forward, which the C++ layer stack reading the copies must equal
bit for bit. The ops exist where the CPU has AVX512-VNNI.

Run: ``pytest -q tests/test_w8a8_prepacked.py``.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_utils import examples
from test_w8a8 import activations

from minivllm.fast import cpu_ops
from minivllm.fast import quantization as fast_quantization
from minivllm.fast.linear_prepack import prepack_w4a8, prepack_w8a8, prepack_weight
from minivllm.ref import quantization as ref

needs_cpp = pytest.mark.skipif(not cpu_ops.available(), reason="the C++ CPU ops did not build")


def _available() -> bool:
    return cpu_ops.available() and cpu_ops.ops().w8a8_prepacked_available()


needs_op = pytest.mark.skipif(not _available(), reason="needs AVX512-VNNI and the C++ ops")


def int4_weight(n: int, groups: int, seed: int, scale_dtype: torch.dtype):
    """A W4A8 weight with a zero group; its scales as a float16 holds them if asked."""
    w = torch.randn(n, 32 * groups, generator=torch.Generator().manual_seed(seed))
    w[0, :32] = 0.0
    qw = ref.quantize_int4(w)
    if scale_dtype == torch.float16:
        qw = dataclasses.replace(qw, scales=qw.scales.half(), mins=qw.mins.half())
    return qw


@pytest.mark.parametrize("n,groups,scale_dtype", [(37, 3, torch.float16), (32, 1, torch.float32),
                                                  (5, 2, torch.float32)])
def test_the_layout_is_its_definition(n, groups, scale_dtype):
    """Panel p, group g: word j of row c (bytes 4 j .. 4 j + 3 of the row's group) at
    (j * 32 + c) * 4, then row c's scale, then its minimum; rows past n are zeros."""
    qw = int4_weight(n, groups, 0, scale_dtype)
    packed = prepack_w4a8(qw.qweight, qw.scales, qw.mins)
    size = scale_dtype.itemsize
    panels = -(-n // 32)
    assert packed.shape == (panels, groups, 512 + 64 * size) and packed.dtype == torch.uint8
    q = qw.qweight.tolist()
    raw = packed.tolist()
    for p in range(panels):
        for g in range(groups):
            for c in range(32):
                r = 32 * p + c
                for j in range(4):
                    for b in range(4):
                        want = q[r][16 * g + 4 * j + b] if r < n else 0
                        assert raw[p][g][(j * 32 + c) * 4 + b] == want
                for i, t in enumerate((qw.scales, qw.mins)):
                    at = 512 + (i * 32 + c) * size
                    got = packed[p, g, at : at + size].view(scale_dtype).item()
                    assert got == (t[r, g].item() if r < n else 0.0)


@pytest.mark.parametrize("n,groups,group_size,scale_dtype", [
    (37, 3, None, torch.float32), (32, 2, 32, torch.float16), (5, 4, 64, torch.float32)])
def test_the_int8_layout_is_its_definition(n, groups, group_size, scale_dtype):
    """Panel p: row c's scale for scale group sg at (sg * 32 + c) * size; then group g's
    word j of row c (bytes 4 j .. 4 j + 3 of the group, each plus 128) at
    (g * 8 + j) * 128 + 4 c; rows past n are zero bytes (their lanes are dropped)."""
    qw = ref.quantize_int8(torch.randn(n, 32 * groups), group_size)
    scales = qw.scales.to(scale_dtype)
    packed = prepack_w8a8(qw.qweight, scales)
    size, sg_count = scale_dtype.itemsize, scales.shape[1]
    panels = -(-n // 32)
    assert packed.shape == (panels, 32 * (sg_count * size + 32 * groups))
    q = qw.qweight.tolist()
    raw = packed.tolist()
    words_at = 32 * sg_count * size
    for p in range(panels):
        for c in range(32):
            r = 32 * p + c
            for sg in range(sg_count):
                at = (sg * 32 + c) * size
                got = packed[p, at : at + size].view(scale_dtype).item()
                assert got == (scales[r, sg].item() if r < n else 0.0)
            for g in range(groups):
                for j in range(8):
                    for b in range(4):
                        want = q[r][32 * g + 4 * j + b] + 128 if r < n else 0
                        assert raw[p][words_at + (g * 8 + j) * 128 + 4 * c + b] == want


@needs_op
@settings(max_examples=examples(40), deadline=None)
@given(n=st.sampled_from([1, 5, 31, 32, 33, 70, 100]),
       fmt=st.sampled_from([(1, None), (2, 32), (3, 32), (4, 64), (18, None), (18, 32),
                            (48, 96)]),
       seed=st.integers(0, 99), magnitude=st.sampled_from([1e-6, 1.0, 3e4]),
       scale_dtype=st.sampled_from([torch.float32, torch.float16]))
def test_the_int8_prepacked_op_equals_the_ref_exactly(n, fmt, seed, magnitude, scale_dtype):
    """Per channel (one scale a row), per 32 (Q8_0), per 64 and 96 (a scale group over
    several activation groups); the weights include -127 and 127, x a zero group."""
    groups, group_size = fmt
    w = torch.randn(n, 32 * groups, generator=torch.Generator().manual_seed(seed))
    qw = ref.quantize_int8(w, group_size)
    scales = qw.scales.to(scale_dtype)
    x = activations(1, 32 * groups, seed + 1, magnitude)
    a = ref.quantize_activations(x)
    want = ref.w8a8_matmul(a, qw.qweight, scales.float())
    out = torch.full((1, n), float("nan"))
    cpu_ops.ops().w8a8_linear_prepacked(out, a.q, a.scales, prepack_w8a8(qw.qweight, scales),
                                        scales)
    assert torch.equal(out, want), (scale_dtype, (out - want).abs().max())


@needs_op
@settings(max_examples=examples(40), deadline=None)
@given(n=st.sampled_from([1, 5, 31, 32, 33, 70, 100]),
       groups=st.sampled_from([1, 2, 3, 18, 48]), seed=st.integers(0, 99),
       magnitude=st.sampled_from([1e-6, 1.0, 3e4]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       scale_dtype=st.sampled_from([torch.float32, torch.float16]))
def test_the_prepacked_op_equals_the_ref_exactly(n, groups, seed, magnitude, dtype,
                                                 scale_dtype):
    qw = int4_weight(n, groups, seed, scale_dtype)
    x = activations(1, 32 * groups, seed + 1, magnitude).to(dtype)
    a = ref.quantize_activations(x)
    want = ref.w4a8_matmul(a, qw.qweight, qw.scales.float(), qw.mins.float())
    out = torch.full((1, n), float("nan"))
    cpu_ops.ops().w4a8_linear_prepacked(out, a.q, a.scales, a.sums,
                                        prepack_w4a8(qw.qweight, qw.scales, qw.mins))
    assert torch.equal(out, want), (scale_dtype, (out - want).abs().max())


@needs_op
def test_the_prepacked_ops_refuse_what_they_do_not_take():
    qw = int4_weight(40, 2, 0, torch.float16)
    packed = prepack_w4a8(qw.qweight, qw.scales, qw.mins)
    a = ref.quantize_activations(torch.randn(2, 64))
    op = cpu_ops.ops().w4a8_linear_prepacked
    with pytest.raises(RuntimeError, match="one row of x"):
        op(torch.empty(2, 40), a.q, a.scales, a.sums, packed)
    one = ref.quantize_activations(torch.randn(1, 64))
    with pytest.raises(RuntimeError, match="packed"):
        op(torch.empty(1, 70), one.q, one.scales, one.sums, packed)  # 3 panels, not 2
    with pytest.raises(RuntimeError, match="packed"):
        op(torch.empty(1, 40), one.q, one.scales, one.sums, packed[:, :1].contiguous())
    # The int8 op: its scales must be the weight's, the copy of that weight's shape.
    qw8 = ref.quantize_int8(torch.randn(40, 64), 32)
    packed8 = prepack_w8a8(qw8.qweight, qw8.scales)
    op8 = cpu_ops.ops().w8a8_linear_prepacked
    with pytest.raises(RuntimeError, match="one row of x"):
        op8(torch.empty(2, 40), a.q, a.scales, packed8, qw8.scales)
    with pytest.raises(RuntimeError, match="packed"):  # per-channel scales: another layout
        op8(torch.empty(1, 40), one.q, one.scales, packed8, qw8.scales[:, :1].contiguous())
    with pytest.raises(RuntimeError, match="scales"):  # 3 scale groups do not divide 2 groups
        op8(torch.empty(1, 40), one.q, one.scales, packed8, torch.ones(40, 3))


@needs_cpp
@pytest.mark.parametrize("method", ["int8", "int4"])
def test_only_int8_activations_with_the_fast_twin_get_a_copy(method):
    qw = ref.quantize(torch.randn(40, 64), method)
    w8a8 = dataclasses.replace(qw, activations="int8", ops=fast_quantization)
    copy = prepack_weight(w8a8)
    if not _available():
        assert copy is None
    elif method == "int8":
        assert torch.equal(copy, prepack_w8a8(qw.qweight, qw.scales))
    else:
        assert torch.equal(copy, prepack_w4a8(qw.qweight, qw.scales, qw.mins))
    assert prepack_weight(dataclasses.replace(w8a8, ops=ref)) is None  # the ref multiplies it
    assert prepack_weight(dataclasses.replace(qw, ops=fast_quantization)) is None  # W8A16


@needs_cpp
@pytest.mark.parametrize("scheme", ["w8a8", "w4a8"])
@pytest.mark.parametrize("prepack", [True, False])
def test_the_layer_stack_reads_the_copies_at_batch_1(tiny_model_dir, scheme, prepack):
    """Every projection and the LM head hand their copies to the C++ layer stack, and one
    sequence at a time (every decode step one row) gives the model's own forward's
    tokens and log-probabilities, bit for bit. Without copies (``prepack=False``, or a
    CPU without AVX512-VNNI) the stack reads the weights as stored, with the same bits."""
    from minivllm import LLM, SamplingParams

    path = str(tiny_model_dir("llama", num_hidden_layers=3))
    kw = dict(backend="fast", dtype="float32", device="cpu", quantization=scheme)
    fast, eager = LLM(path, prepack=prepack, **kw), LLM(path, enforce_eager=True, **kw)
    stack = fast.llm_engine.executor.worker.model_runner.layer_stack
    model = fast.llm_engine.executor.worker.model
    layers = [m for m in model.modules() if getattr(m, "packed_weight", None) is not None]
    # every projection, and the LM head (int8 in both schemes)
    assert len(layers) == (3 * 4 + 1 if prepack and _available() else 0)
    bound = {id(t) for p in (*stack.projections, stack.lm_head) for t in p.tensors}
    missing = [type(m).__name__ for m in layers if id(m.packed_weight) not in bound]
    assert not missing
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=1)
    for prompt in ([5, 9, 2, 33, 17], [40, 41]):
        got, want = (llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
                     .outputs[0] for llm in (fast, eager))
        assert got.token_ids == want.token_ids
        assert [d[t].logprob for d, t in zip(got.logprobs, got.token_ids)] == \
            [d[t].logprob for d, t in zip(want.logprobs, want.token_ids)]
