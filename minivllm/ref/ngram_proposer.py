"""The n-gram proposer (prompt lookup decoding): drafts copied from the request itself.

Text that repeats its input (a summary quoting the passage, an edited copy
of code, a JSON echo) often continues the way it continued before. The
proposer looks at the last ``n`` tokens of the request (prompt + output so
far), finds the same ``n`` tokens earlier on, and proposes the ``k`` tokens
that followed them there. It needs no model and no probabilities: the
rejection sampler treats its drafts as one-hot ``q``.

The rule, with vLLM's knobs (``vllm/v1/spec_decode/ngram_proposer.py``):

- ``n`` is the *longest* length in ``[prompt_lookup_min, prompt_lookup_max]``
  whose suffix occurs earlier, as a proper occurrence: one that starts before
  the suffix itself (it may overlap it), so at least one token follows it;
- of several occurrences of that longest suffix, the *earliest* one wins
  (vLLM's tie rule; the earliest also has the most tokens after it);
- the proposal is the up to ``k`` tokens after it, fewer if the request
  ends sooner; empty if nothing matches, or ``k == 0``.

For example ``[1, 2, 3, 4, 2, 3]`` with lengths in ``[2, 3]`` and ``k = 4``:
``[4, 2, 3]`` occurs nowhere else, ``[2, 3]`` occurs at 1, so the proposal
is ``[4, 2, 3]`` (only three tokens follow it).

The caller caps ``k`` (by ``max_model_len`` and the tokens left to
``max_tokens``). This twin is a plain loop over lengths and start positions;
``minivllm/fast/ngram_proposer.py`` searches every request at once.
"""

from __future__ import annotations

from collections.abc import Sequence


def _check(num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
    if num_speculative_tokens < 0:
        raise ValueError(f"num_speculative_tokens must be >= 0, got {num_speculative_tokens}")
    if prompt_lookup_min < 1:
        raise ValueError(f"prompt_lookup_min must be >= 1, got {prompt_lookup_min}")
    if prompt_lookup_max < prompt_lookup_min:
        raise ValueError(f"prompt_lookup_max must be >= prompt_lookup_min={prompt_lookup_min}, "
                         f"got {prompt_lookup_max}")


def propose(
    token_ids: Sequence[int],
    num_speculative_tokens: int,
    prompt_lookup_min: int,
    prompt_lookup_max: int,
) -> list[int]:
    """The draft for one request: up to ``k`` tokens that followed its longest repeated suffix.

    Args:
        token_ids: the request's tokens so far (prompt then output).
        num_speculative_tokens: ``k``, the most drafts to propose (``>= 0``).
        prompt_lookup_min / prompt_lookup_max: the n-gram lengths tried, ``1 <= min <= max``.
    """
    _check(num_speculative_tokens, prompt_lookup_min, prompt_lookup_max)
    tokens = list(token_ids)
    length = len(tokens)
    if num_speculative_tokens == 0:
        return []
    # The longest n first; a proper occurrence starts before length - n.
    for n in range(min(prompt_lookup_max, length - 1), prompt_lookup_min - 1, -1):
        suffix = tokens[length - n :]
        for start in range(length - n):  # earliest first
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + num_speculative_tokens]
    return []


def propose_batch(
    token_ids: Sequence[Sequence[int]],
    num_speculative_tokens: Sequence[int],
    prompt_lookup_min: int,
    prompt_lookup_max: int,
) -> list[list[int]]:
    """:func:`propose` for each request: ``token_ids[i]`` with at most ``num_speculative_tokens[i]``."""
    if len(token_ids) != len(num_speculative_tokens):
        raise ValueError(f"num_speculative_tokens has {len(num_speculative_tokens)} entries "
                         f"for {len(token_ids)} requests")
    return [propose(ids, k, prompt_lookup_min, prompt_lookup_max)
            for ids, k in zip(token_ids, num_speculative_tokens)]
