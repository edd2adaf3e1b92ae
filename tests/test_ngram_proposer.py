"""The n-gram proposer under test vs an oracle written from the definition, and vs the ref.

The oracle enumerates every proper earlier occurrence of every suffix length
and picks (longest, earliest) by sorting; the ref twin searches length by
length. Token lists come from tiny alphabets, so repeats, overlapping
matches, no match and matches right before the end (fewer than k followers)
are all common.

Run: ``CI=true pytest -q tests/test_ngram_proposer.py --backend=ref`` (and ``--backend=fast``).
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minivllm import backend
from minivllm.ref import ngram_proposer as ref_ngram


def oracle(tokens: list[int], k: int, lo: int, hi: int) -> list[int]:
    """All (length, start) of proper earlier occurrences of a suffix; best = longest, earliest."""
    n_tokens = len(tokens)
    found = [(n, start) for n in range(lo, hi + 1) for start in range(n_tokens)
             if start + n < n_tokens and n <= n_tokens - 1
             and tokens[start : start + n] == tokens[n_tokens - n :]]
    if not found or k == 0:
        return []
    n, start = min(found, key=lambda f: (-f[0], f[1]))
    return tokens[start + n : start + n + k]


token_lists = st.lists(st.integers(0, 3), max_size=40) | st.lists(st.integers(0, 1), max_size=12)
lookups = st.integers(1, 4).flatmap(lambda lo: st.tuples(st.just(lo), st.integers(lo, lo + 3)))


@settings(max_examples=min(200, settings.default.max_examples * 8))
@given(tokens=token_lists, k=st.integers(0, 6), lookup=lookups)
def test_propose_matches_the_oracle(tokens, k, lookup):
    impl = backend.get("ngram_proposer")
    lo, hi = lookup
    want = oracle(tokens, k, lo, hi)
    assert impl.propose(tokens, k, lo, hi) == want
    assert ref_ngram.propose(tokens, k, lo, hi) == want


@settings(max_examples=min(60, settings.default.max_examples * 3))
@given(batch=st.lists(st.tuples(token_lists, st.integers(0, 6)), min_size=1, max_size=6),
       lookup=lookups)
def test_batch_is_each_request_alone(batch, lookup):
    impl = backend.get("ngram_proposer")
    lo, hi = lookup
    tokens, ks = [t for t, _ in batch], [k for _, k in batch]
    assert impl.propose_batch(tokens, ks, lo, hi) == [oracle(t, k, lo, hi)
                                                      for t, k in batch]


@pytest.mark.parametrize("tokens, k, lo, hi, want", [
    ([1, 2, 3, 4, 2, 3], 4, 2, 3, [4, 2, 3]),  # vLLM's docstring example: 3 followers only
    ([1, 2, 3, 4, 2, 3], 1, 2, 3, [4]),
    ([5, 6, 7], 3, 1, 3, []),  # no repeat at all
    ([], 3, 1, 3, []),
    ([9], 3, 1, 1, []),  # a single token has no earlier occurrence
    ([1, 1, 1, 1], 5, 1, 2, [1, 1]),  # overlapping: [1, 1] at 0, two followers
    ([7, 8, 0, 7, 8, 1, 7, 8], 2, 2, 2, [0, 7]),  # earliest of two matches wins
    ([7, 8, 0, 9, 7, 8, 1, 9, 7, 8], 3, 1, 3, [1, 9, 7]),  # the longer match [9, 7, 8] wins
    ([3, 4, 3, 4], 3, 3, 4, []),  # [4, 3, 4] never occurred before: below the minimum
    ([1, 2, 1], 0, 1, 2, []),  # k = 0
])
def test_examples(tokens, k, lo, hi, want):
    assert backend.get("ngram_proposer").propose(tokens, k, lo, hi) == want


def test_bad_arguments_raise_value_errors_naming_the_field():
    impl = backend.get("ngram_proposer")
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        impl.propose([1, 2], -1, 1, 2)
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        impl.propose([1, 2], 2, 0, 2)
    with pytest.raises(ValueError, match="prompt_lookup_max"):
        impl.propose([1, 2], 2, 3, 2)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        impl.propose_batch([[1], [2]], [1], 1, 2)
