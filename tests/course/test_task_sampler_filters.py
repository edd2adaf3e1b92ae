"""Course task: the sampling filters, called one by one, on exact boundaries.

Probabilities of ``V`` equal logits are exactly ``1/V`` for ``V`` a power of
two, and so are their cumulative sums: the top-p boundary can be hit exactly.
"""

from __future__ import annotations

import math

import pytest
import torch

from minivllm import backend


def _kept(row: torch.Tensor) -> int:
    return int(torch.isfinite(row).sum())


@pytest.mark.parametrize("vocab_size", [4, 8])
def test_top_p_exact_boundaries(vocab_size):
    top_ps = [k / vocab_size for k in range(1, vocab_size)] + [0.3, 0.99]
    logits = torch.zeros(len(top_ps), vocab_size)
    out = backend.get("sampler").apply_top_p(logits.clone(), torch.tensor(top_ps))
    for i, p in enumerate(top_ps):
        # The smallest set whose probability reaches p: ceil(p * V) tokens.
        expected = math.ceil(round(p * vocab_size, 9))
        assert _kept(out[i]) == expected, (
            f"row {i}: top_p={p} over {vocab_size} equally likely tokens keeps "
            f"{_kept(out[i])}, expected {expected} (a token whose preceding mass already "
            f"reaches top_p is dropped)")


def test_top_p_keeps_the_most_likely_tokens():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0, -1.0]])
    probs = torch.softmax(logits.double(), dim=-1)[0]
    out = backend.get("sampler").apply_top_p(logits.clone(), torch.tensor([0.9]))
    kept = set(torch.isfinite(out[0]).nonzero().flatten().tolist())
    order = probs.argsort(descending=True).tolist()
    expected, mass = set(), 0.0
    for t in order:
        if mass >= 0.9:
            break
        expected.add(t)
        mass += float(probs[t])
    assert kept == expected, f"top-p kept {sorted(kept)}, expected {sorted(expected)}"
    assert torch.equal(out[0][list(kept)], logits[0][list(kept)]), "kept logits must not change"


def test_top_k_keeps_ties_with_the_kth():
    logits = torch.tensor([[3.0, 2.0, 2.0, 2.0, 1.0], [0.5, 0.5, 0.5, 0.5, 0.5]])
    out = backend.get("sampler").apply_top_k(logits.clone(), torch.tensor([2, 1]))
    assert _kept(out[0]) == 4, "the k-th largest is 2.0: every token tied with it is kept"
    assert _kept(out[1]) == 5, "all five tie with the largest"


def test_min_p_threshold_is_inclusive():
    logits = torch.zeros(2, 4)
    logits[1, 0] = math.log(2.0)  # probs 0.4, 0.2, 0.2, 0.2
    out = backend.get("sampler").apply_min_p(logits.clone(), torch.tensor([1.0, 0.5]))
    assert _kept(out[0]) == 4, "min_p=1 over equal tokens: every p equals min_p * p_max, kept"
    assert _kept(out[1]) == 4, "p = 0.2 = 0.5 * 0.4 sits on the threshold: kept"
