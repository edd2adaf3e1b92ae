"""The n-gram proposer, fast twin: one NumPy search over every request and position.

Read ``minivllm/ref/ngram_proposer.py`` first for the rule; this twin returns
the same drafts. The ref tries each length ``n`` from the longest down and
each start position in turn, ``O(L * n_max)`` Python-level comparisons per
request, each slicing a list. This twin turns the search around:

- For every position ``e`` where an earlier occurrence could *end*, the
  longest ``n`` for which ``tokens[e-n:e] == tokens[L-n:L]`` is the length of
  the common run of ``tokens[e-1], tokens[e-2], ...`` and ``tokens[L-1],
  tokens[L-2], ...``: a sliding-window view compares all ``n_max`` offsets of
  all positions of all requests in one vectorised ``==`` (requests padded
  into one ``(B, L_max)`` array), and a cumulative product along the offsets
  gives each run's length.
- The longest run is the matched length; the first ``e`` that reaches it is
  the earliest occurrence (vLLM's tie rule), one ``argmax``.

Work is ``B * L_max * n_max`` byte compares with no Python per token; a
Python loop remains only over requests, to copy each request in and its
draft out.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from minivllm.ref.ngram_proposer import _check


def propose(
    token_ids: Sequence[int],
    num_speculative_tokens: int,
    prompt_lookup_min: int,
    prompt_lookup_max: int,
) -> list[int]:
    """The draft for one request (see the ref twin)."""
    return propose_batch([token_ids], [num_speculative_tokens], prompt_lookup_min,
                         prompt_lookup_max)[0]


def propose_batch(
    token_ids: Sequence[Sequence[int]],
    num_speculative_tokens: Sequence[int],
    prompt_lookup_min: int,
    prompt_lookup_max: int,
) -> list[list[int]]:
    """:func:`propose` for each request, searched all at once."""
    if len(token_ids) != len(num_speculative_tokens):
        raise ValueError(f"num_speculative_tokens has {len(num_speculative_tokens)} entries "
                         f"for {len(token_ids)} requests")
    for k in num_speculative_tokens:
        _check(k, prompt_lookup_min, prompt_lookup_max)
    _check(0, prompt_lookup_min, prompt_lookup_max)
    num_requests = len(token_ids)
    if num_requests == 0:
        return []
    lengths = np.array([len(ids) for ids in token_ids], dtype=np.int64)  # (B,)
    max_len = int(lengths.max())
    n_max = max(1, min(prompt_lookup_max, max_len - 1))  # a match is at most L - 1 long
    # Left-pad by n_max with -1 (before the start) and right-pad with -1 (after the end).
    padded = np.full((num_requests, n_max + max_len), -1, dtype=np.int64)
    for b, ids in enumerate(token_ids):
        padded[b, n_max : n_max + len(ids)] = ids
    # windows[b, e, j] = tokens[b, e - 1 - j]: the n_max tokens before position e, newest first.
    windows = np.lib.stride_tricks.sliding_window_view(padded, n_max, axis=1)[:, :, ::-1]
    # suffix[b, j] = tokens[b, L_b - 1 - j] (-2, matching nothing, before the start).
    back = lengths[:, None] - 1 - np.arange(n_max)[None, :]  # (B, n_max)
    at = np.clip(n_max + back, 0, padded.shape[1] - 1)
    suffix = np.where(back >= 0, padded[np.arange(num_requests)[:, None], at], -2)
    same = windows == suffix[:, None, :]  # (B, L_max + 1, n_max)
    run = np.cumprod(same, axis=2).sum(axis=2)  # (B, L_max + 1): match length ending at e
    ends = np.arange(max_len + 1)[None, :]
    run[(ends < 1) | (ends > lengths[:, None] - 1)] = 0  # proper occurrences: e in [1, L - 1]
    best = run.max(axis=1)  # (B,) the longest match
    first_end = np.argmax(run == best[:, None], axis=1)  # (B,) its earliest occurrence

    drafts = []
    for b, k in enumerate(num_speculative_tokens):
        if k == 0 or best[b] < prompt_lookup_min:
            drafts.append([])
            continue
        e = int(first_end[b])
        drafts.append(padded[b, n_max + e : n_max + min(e + k, int(lengths[b]))].tolist())
    return drafts
