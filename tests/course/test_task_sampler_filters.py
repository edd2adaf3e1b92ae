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


@pytest.mark.parametrize("seed", range(4))
def test_top_p_on_tied_logits_keeps_a_valid_set(seed):
    """Logits rounded to halves: many exact ties. Any member of a tie group at the boundary
    may be kept, so the test checks what top-p defines, not which tie was picked:
    how many tokens are kept, their mass, and that no dropped token is more likely than
    a kept one."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.round(torch.randn(6, 200, generator=g) * 6) / 2  # (N, V)
    top_p = torch.tensor([0.05, 0.3, 0.5, 0.8, 0.95, 0.999])
    out = backend.get("sampler").apply_top_p(logits.clone(), top_p)
    for i, p in enumerate(top_p.tolist()):
        probs = torch.softmax(logits[i].double(), dim=-1)
        ranked = probs.sort(descending=True).values
        before = ranked.cumsum(0) - ranked
        expected = int((before < p).sum())  # tokens whose preceding mass is below p
        kept = torch.isfinite(out[i])
        assert int(kept.sum()) == expected, (
            f"row {i}: top_p={p} keeps {int(kept.sum())} tokens, expected {expected}")
        assert float(probs[kept].sum()) == pytest.approx(float(ranked[:expected].sum()),
                                                         rel=1e-6), f"row {i}: kept mass"
        if not kept.all():
            assert logits[i][kept].min() >= logits[i][~kept].max(), (
                f"row {i}: a dropped token is more likely than a kept one")
        assert torch.equal(out[i][kept], logits[i][kept]), "kept logits must not change"
