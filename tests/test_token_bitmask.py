"""Applying a token bitmask to logits: every twin equals a bit-by-bit oracle.

``apply_token_bitmask_inplace(logits, bitmask, indices)`` must set exactly the
forbidden logits of the listed rows to ``-inf`` and leave every other value
bit for bit as it was. The oracle reads each bit with Python integers. Under
``--backend=fast`` on a CPU the C++ op runs, and the Triton kernel in the
interpreter; on CUDA the Triton kernel. Vocabulary sizes are awkward (not
multiples of 32, SmolLM2's 49152 + 17), rows are subsets with repeats.

Run: ``pytest -q tests/test_token_bitmask.py --backend=ref`` (and ``=fast``).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_utils import DEVICE, examples

from minivllm import backend
from minivllm.fast import cpu_ops
from minivllm.fast import structured_output as fast_so
from minivllm.structured_output.bitmask import pack_bitmask, unpack_bitmask


def implementations() -> list:
    """The apply functions under test: the swap layer's, and each fast path that runs here."""
    impl = backend.get("structured_output")
    fns = [impl.apply_token_bitmask_inplace]
    if impl is fast_so:
        if DEVICE == "cpu" and cpu_ops.available():
            fns.append(fast_so.apply_token_bitmask_inplace_cpu)
        if backend.triton_available() and (DEVICE == "cuda" or backend.triton_interpreted()):
            fns.append(fast_so.apply_token_bitmask_inplace_triton)
    return fns


def oracle(logits: torch.Tensor, bitmask: torch.Tensor, rows) -> torch.Tensor:
    """The expected logits: a Python loop over rows and tokens, one bit at a time."""
    out = logits.clone().cpu()
    words = bitmask.cpu().tolist()
    for r in set(rows):
        for t in range(logits.shape[1]):
            if not (words[r][t // 32] >> (t % 32)) & 1:  # Python ints: the sign bit is bit 31
                out[r, t] = float("-inf")
    return out


def random_case(seed: int, batch: int, vocab: int, dtype, density: float, wide: bool):
    g = torch.Generator().manual_seed(seed)
    full = torch.randn(batch, vocab + (5 if wide else 0), generator=g).to(dtype)
    logits = full[:, :vocab]  # wide: rows stride past the vocabulary (a view)
    allowed = torch.rand(batch, vocab, generator=g) < density
    allowed[:, ::7] = True  # some words all ones, some with holes
    if vocab > 64:
        allowed[0, 32:64] = True
        allowed[-1, :32] = False
    return full, logits, pack_bitmask(allowed)


@pytest.mark.parametrize("fn", implementations(), ids=lambda f: f.__name__)
@settings(max_examples=examples(12), deadline=None)
@given(seed=st.integers(0, 2**16), batch=st.integers(1, 5),
       vocab=st.sampled_from([1, 31, 32, 33, 100, 1000 + 3]),
       dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
       density=st.sampled_from([0.0, 0.1, 0.9, 1.0]), wide=st.booleans(),
       rows=st.one_of(st.none(), st.lists(st.integers(0, 4), max_size=6)))
def test_apply_matches_the_bit_by_bit_oracle(fn, seed, batch, vocab, dtype, density, wide, rows):
    rows = None if rows is None else [r % batch for r in rows]
    full, logits, bitmask = random_case(seed, batch, vocab, dtype, density, wide)
    expected = oracle(logits, bitmask, range(batch) if rows is None else rows)
    full, bitmask = full.to(DEVICE), bitmask.to(DEVICE)
    logits = full[:, :vocab]
    fn(logits, bitmask, rows)
    assert torch.equal(logits.cpu(), expected)  # bit for bit, -inf included
    if full.shape[1] > vocab:  # the columns past the view are not the kernel's
        assert torch.isfinite(full[:, vocab:]).all()


@pytest.mark.parametrize("fn", implementations(), ids=lambda f: f.__name__)
def test_smollm2_sized_vocabulary_and_a_row_subset(fn):
    """49152 + 17 tokens (a partial last word), 6 rows of which 3 are masked (as a batch
    with 3 constrained requests); one row forbids everything but the padding-free tail."""
    batch, vocab = 6, 49152 + 17
    full, logits, bitmask = random_case(3, batch, vocab, torch.float32, 0.3, False)
    bitmask[4] = pack_bitmask(torch.arange(vocab) >= vocab - 17)
    rows = [4, 1, 5]
    expected = logits.clone()
    allowed = unpack_bitmask(bitmask[rows], vocab)
    expected[rows] = expected[rows].masked_fill(~allowed, float("-inf"))
    logits, bitmask = logits.to(DEVICE), bitmask.to(DEVICE)
    fn(logits, bitmask, torch.tensor(rows, device=DEVICE))
    assert torch.equal(logits.cpu(), expected)
    assert torch.isfinite(logits[4, -17:]).all() and torch.isinf(logits[4, :-17]).all()


def test_allocate_token_bitmask():
    impl = backend.get("structured_output")
    bm = impl.allocate_token_bitmask(3, 49152 + 17)
    assert bm.dtype == torch.int32 and bm.shape == (3, 1537)
    assert bool((bm == -1).all())  # every token allowed until a row is filled
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="batch_size"):
            impl.allocate_token_bitmask(bad, 10)
        with pytest.raises(ValueError, match="vocab_size"):
            impl.allocate_token_bitmask(2, bad)


@pytest.mark.parametrize("fn", implementations(), ids=lambda f: f.__name__)
def test_bad_input(fn):
    logits = torch.zeros(2, 40, device=DEVICE)
    good = torch.full((2, 2), -1, dtype=torch.int32, device=DEVICE)
    cases = [
        (logits[0], good, None, "logits"),
        (logits.long(), good, None, "logits"),
        (logits, good.long(), None, "bitmask"),
        (logits, good[:, :1], None, "bitmask"),
        (logits, good[:1], None, "bitmask"),
        (logits, good, [0, 2], "indices"),
        (logits, good, [-1], "indices"),
        (logits, good, [[0]], "indices"),
        (logits, good, [0.5], "indices"),
    ]
    if DEVICE == "cuda":
        cases.append((logits, good.cpu(), None, "device"))
    for lg, bm, idx, field in cases:
        with pytest.raises(ValueError, match=field):
            fn(lg, bm, idx)
    fn(logits, good, [])  # no rows: nothing to do
    assert (logits == 0).all()
