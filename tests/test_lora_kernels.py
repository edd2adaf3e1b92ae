"""The ``lora`` component: each token's adapter delta, against a float64 oracle and the ref.

The oracle is the formula written independently of both twins: gather every
token's own A, B^T and scale (a batched einsum in float64, no loop over tokens),
mask the tokens without an adapter. Cases are mixed batches in any order, ranks
1 to 64 with each slot's own rank zero-padded, empty (rank-0) slots, slices an
adapter leaves alone (scale 0), tokens with no adapter, widths that are not
powers of 2, float32 and bf16. Under ``--backend=fast`` on a CPU it runs the C++
op and the Triton kernels (in the interpreter).

Tolerances: every twin accumulates in float32 and rounds once into ``y``; the
float64 oracle rounds once too. float32: sums of up to ~100 products of O(1)
terms carry a few 1e-6 of relative error, so 1e-4. bf16: ``y`` is rounded to 8
significant bits once, and two float32 values that differ in their last bits may
round to neighbouring bf16 numbers: one bf16 step, 2^-7 relative for |y| in [1, 2),
so 1.6e-2 (kernel_utils' bf16 tolerance).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_utils import DEVICE, examples, kernel_backend  # noqa: F401  (per kernel backend)

import minivllm.ref.lora as ref_lora
from minivllm import backend
from minivllm.lora.mapping import LoRAMapping
from minivllm.testing.strategies import lora_batches

TOL = {torch.float32: (1e-4, 1e-4), torch.bfloat16: (1.6e-2, 1.6e-2)}


def make_case(case: dict, dtype: torch.dtype):
    """Random tensors for ``case`` (a :func:`lora_batches` draw): y, x, stacks, mapping."""
    g = torch.Generator().manual_seed(case["seed"])
    t, k, slices = case["num_tokens"], case["in_features"], case["output_slices"]
    slots, rank = case["max_loras"], case["max_rank"]
    x = torch.randn(t, k, generator=g).to(dtype)
    y = torch.randn(t, sum(slices), generator=g).to(dtype)
    lora_a, lora_b, scalings = [], [], []
    for i, n in enumerate(slices):
        a = torch.randn(slots, rank, k, generator=g) / k**0.5
        b = torch.randn(slots, rank, n, generator=g) / rank**0.5
        scale = torch.rand(slots, generator=g) * 2 + 0.25
        for s, r in enumerate(case["ranks"]):  # slot s has rank r: zero-padded past it
            a[s, r:] = 0
            b[s, r:] = 0
            if (i, s) in case["zero_scale"]:  # an adapter that leaves this slice alone
                a[s], b[s], scale[s] = 0, 0, 0
        lora_a.append(a.to(dtype))
        lora_b.append(b.to(dtype))
        scalings.append(scale)
    return y, x, lora_a, lora_b, scalings, case["token_slots"]


def oracle(y, x, lora_a, lora_b, scalings, token_slots):
    """``y + scale[s_t] * (x_t A[s_t]^T) B[s_t]^T`` per token, in float64, by gathering."""
    slots = torch.tensor(token_slots)
    has = (slots >= 0).double()[:, None]  # (T, 1)
    idx = slots.clamp(min=0)
    pieces = []
    for a, b, scale in zip(lora_a, lora_b, scalings):
        h = torch.einsum("tk,trk->tr", x.double(), a.double()[idx])  # (T, R)
        delta = torch.einsum("tr,trn->tn", h, b.double()[idx])  # (T, n)
        pieces.append(delta * scale.double()[idx][:, None] * has)
    return y.double() + torch.cat(pieces, dim=1)


def run(impl, y, x, lora_a, lora_b, scalings, token_slots, slices):
    """``impl.add_lora`` on DEVICE; returns the new y on the CPU."""
    dev = lambda ts: [t.to(DEVICE) for t in ts]  # noqa: E731
    out = y.clone().to(DEVICE)
    impl.add_lora(out, x.to(DEVICE), dev(lora_a), dev(lora_b), dev(scalings),
                  LoRAMapping.build(token_slots, DEVICE), slices)
    return out.cpu()


def check(actual, expected, dtype):
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(actual.double(), expected.double(), rtol=rtol, atol=atol)


@settings(max_examples=examples(25))
@given(case=lora_batches(), dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_add_lora_matches_oracle(case, dtype):
    impl = backend.get("lora")
    y, x, a, b, s, token_slots = make_case(case, dtype)
    out = run(impl, y, x, a, b, s, token_slots, case["output_slices"])
    check(out, oracle(y, x, a, b, s, token_slots), dtype)
    # Rows without an adapter, and slices a token's adapter leaves alone, stay bit-exact.
    cols = torch.tensor([i for i, n in enumerate(case["output_slices"]) for _ in range(n)])
    for t, slot in enumerate(token_slots):
        untouched = torch.ones_like(cols, dtype=torch.bool) if slot < 0 else torch.tensor(
            [(int(i), slot) in case["zero_scale"] for i in cols], dtype=torch.bool)
        assert torch.equal(out[t][untouched], y[t][untouched]), f"token {t} changed"
    if impl is not ref_lora:
        check(out, run(ref_lora, y, x, a, b, s, token_slots, case["output_slices"]), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_long_segments_and_many_slots(dtype):
    """A segment longer than every kernel's token block (8 in C++, 16 in Triton), beside
    short ones, tokens interleaved; qkv-like slices with a rank-64 slot and a rank-1 slot."""
    g = torch.Generator().manual_seed(0)
    slots = [0] * 37 + [1] * 3 + [2] + [-1] * 4
    order = torch.randperm(len(slots), generator=g).tolist()
    case = dict(num_tokens=len(slots), in_features=57, output_slices=[40, 24, 24],
                max_loras=3, max_rank=64, ranks=[64, 1, 13], zero_scale={(1, 2)},
                token_slots=[slots[i] for i in order], seed=1)
    impl = backend.get("lora")
    y, x, a, b, s, token_slots = make_case(case, dtype)
    out = run(impl, y, x, a, b, s, token_slots, case["output_slices"])
    check(out, oracle(y, x, a, b, s, token_slots), dtype)


def test_no_adapter_anywhere_is_a_no_op():
    impl = backend.get("lora")
    case = dict(num_tokens=5, in_features=16, output_slices=[24], max_loras=2, max_rank=8,
                ranks=[8, 8], zero_scale=set(), token_slots=[-1] * 5, seed=3)
    y, x, a, b, s, token_slots = make_case(case, torch.float32)
    assert torch.equal(run(impl, y, x, a, b, s, token_slots, [24]), y)


def test_y_with_strided_rows_is_updated_in_place():
    """The fused projection's output may be a view (here every other column of a buffer)."""
    impl = backend.get("lora")
    case = dict(num_tokens=6, in_features=24, output_slices=[5, 16], max_loras=2, max_rank=4,
                ranks=[4, 2], zero_scale=set(), token_slots=[1, 0, -1, 1, 0, 0], seed=4)
    y, x, a, b, s, token_slots = make_case(case, torch.float32)
    buffer = torch.zeros(6, 42, device=DEVICE)
    view = buffer[:, ::2]  # (6, 21), column stride 2
    view.copy_(y)
    impl.add_lora(view, x.to(DEVICE), [t.to(DEVICE) for t in a], [t.to(DEVICE) for t in b],
                  [t.to(DEVICE) for t in s], LoRAMapping.build(token_slots, DEVICE), [5, 16])
    check(buffer[:, ::2].cpu(), oracle(y, x, a, b, s, token_slots), torch.float32)
    assert not buffer[:, 1::2].any(), "wrote outside the view"


@pytest.mark.parametrize("field, change", [
    ("lora_b", lambda kw: kw.update(lora_b=[kw["lora_b"][0][:, :, :3]])),  # width 3, not 5
    ("lora_a", lambda kw: kw.update(lora_a=[kw["lora_a"][0][:, :, :7]])),  # in 7, not 8
    ("y", lambda kw: kw.update(output_slices=[4])),  # slices no longer add up to y's width
    ("scalings", lambda kw: kw.update(scalings=[torch.ones(3)])),  # 3 slots, not 2
    ("slot", lambda kw: kw.update(mapping=LoRAMapping.build([0, 2, 1]))),  # slot 2 of 2
    ("mapping", lambda kw: kw.update(mapping=LoRAMapping.build([0, 1]))),  # 2 tokens, not 3
    ("output slice", lambda kw: kw.update(lora_b=[])),
])
def test_bad_arguments_raise_value_error_naming_them(field, change):
    impl = backend.get("lora")
    kw = dict(y=torch.zeros(3, 5), x=torch.zeros(3, 8), lora_a=[torch.zeros(2, 4, 8)],
              lora_b=[torch.zeros(2, 4, 5)], scalings=[torch.ones(2)],
              mapping=LoRAMapping.build([0, -1, 1]), output_slices=[5])
    change(kw)
    with pytest.raises(ValueError, match=field):
        impl.add_lora(**kw)


@settings(max_examples=examples(50))
@given(st.lists(st.integers(-1, 6), max_size=30))
def test_mapping_groups_tokens_by_slot_in_order(token_slots):
    m = LoRAMapping.build(token_slots)
    expected = sorted((s, t) for t, s in enumerate(token_slots) if s >= 0)  # by slot, then token
    assert m.sorted_tokens.tolist() == [t for _, t in expected]
    assert list(m.slots) == sorted({s for s in token_slots if s >= 0})
    assert m.seg_starts.tolist()[-1] == len(expected) and m.num_tokens == len(token_slots)
    for seg, slot in enumerate(m.slots):
        lo, hi = m.seg_starts[seg], m.seg_starts[seg + 1]
        assert hi - lo == m.seg_lens[seg] == token_slots.count(slot)
        assert all(token_slots[t] == slot for t in m.sorted_tokens[lo:hi].tolist())
    assert m.token_slots.tolist() == token_slots


def test_mapping_from_requests_and_bad_slots():
    m = LoRAMapping.from_requests([1, -1, 0], [2, 1, 3])
    assert m.token_slots.tolist() == [1, 1, -1, 0, 0, 0]
    assert m.sorted_tokens.tolist() == [3, 4, 5, 0, 1] and m.slots == (0, 1)
    with pytest.raises(ValueError, match="token_slots"):
        LoRAMapping.build([0, -2])
    with pytest.raises(ValueError, match="num_tokens"):
        LoRAMapping.from_requests([0, 1], [3])
