"""The sampler: turn one step's logits into one token per row (reference twin).

The pipeline, in vLLM v1's order (``vllm/v1/sample/sampler.py``)::

    logits (N, V), raw from the model
      |-- logprobs: log_softmax of the RAW logits (vLLM v1's default)
      |-- min_tokens: EOS and stop ids -> -inf until min_tokens are generated
      |-- penalties: repetition, then frequency, then presence
      |-- greedy rows: argmax ---------------------------------------+
      |-- temperature: logits / T                                    |
      |-- min-p: drop p < min_p * p_max                              |
      |-- top-k, then top-p on what top-k kept (renormalised)        |
      `-- random rows: argmax(softmax(logits) / q), q ~ Exp(1) ------+--> tokens

The last step is the *exponential race*: if ``q_i ~ Exp(1)`` independently,
``argmax_i p_i / q_i`` is distributed exactly as ``p``. All randomness is
``q``, drawn by :func:`~minivllm.sampling_metadata.draw_exponentials` per row
from that row's generator, so a seeded request gets the same tokens whatever
else is in the batch, and the ref and fast twins pick identical tokens.

This twin reads top to bottom: every filter is a mask written as its
definition (sort, cumulative sum, compare). ``minivllm/fast/sampler.py`` gives
the same results with fewer passes over the (N, V) logits.
"""

from __future__ import annotations

import torch

from minivllm.sampling_metadata import (
    LogprobsTensors,
    SamplerOutput,
    SamplingMetadata,
    draw_exponentials,
)

_NEG_INF = float("-inf")


def sample(logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
    """Pick one token per row of ``logits`` (N, V) float32; the input is not modified."""
    # BEGIN SOLUTION
    logits = logits.to(torch.float32).clone()  # (N, V); stages below edit it in place
    logprobs = None
    if metadata.max_num_logprobs is not None:
        raw_logprobs = torch.log_softmax(logits, dim=-1)  # (N, V), before any processing

    logits = apply_penalties(logits, metadata)
    greedy_tokens = logits.argmax(dim=-1)  # (N,)

    if metadata.all_greedy:
        sampled = greedy_tokens
    else:
        probs = torch.softmax(filter_logits(logits, metadata), dim=-1)  # (N, V)
        q = draw_exponentials(metadata, logits.shape[1])  # (N, V), Exp(1)
        random_tokens = (probs / q).argmax(dim=-1)  # (N,)
        sampled = torch.where(metadata.greedy_mask, greedy_tokens, random_tokens)

    if metadata.max_num_logprobs is not None:
        logprobs = gather_logprobs(raw_logprobs, sampled, metadata.max_num_logprobs)
    return SamplerOutput(sampled_token_ids=sampled, logprobs=logprobs)
    # END SOLUTION


def apply_penalties(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """min_tokens masking, then repetition, frequency and presence penalties (in place).

    These change which token is best, so they run before the greedy argmax.

    - repetition ``r``: a token seen in the prompt or the output has its logit
      divided by ``r`` if positive, multiplied by ``r`` if not (so ``r > 1``
      always makes it less likely).
    - frequency ``f``: subtract ``f * count`` (occurrences in the output).
    - presence ``p``: subtract ``p`` once if the token is in the output.
    """
    # BEGIN SOLUTION
    if metadata.min_tokens_rows is not None:
        logits[metadata.min_tokens_rows, metadata.min_tokens_ids] = _NEG_INF
    if metadata.no_penalties:
        return logits

    num_rows, vocab_size = logits.shape
    # Count each token's occurrences in the output, one row at a time. The
    # padding id V counts into an extra column that is then dropped.
    output_counts = torch.stack(
        [torch.bincount(ids, minlength=vocab_size + 1) for ids in metadata.output_token_ids]
    )[:, :vocab_size].to(logits.dtype)  # (N, V)
    in_output = output_counts > 0  # (N, V) bool

    if metadata.repetition_penalties is not None:
        in_prompt = torch.stack(
            [torch.bincount(ids, minlength=vocab_size + 1) for ids in metadata.prompt_token_ids]
        )[:, :vocab_size] > 0  # (N, V) bool
        seen = in_prompt | in_output
        r = metadata.repetition_penalties[:, None].expand_as(logits)  # (N, V)
        r = torch.where(seen, r, torch.ones_like(r))
        positive = logits > 0
        logits[positive] /= r[positive]
        logits[~positive] *= r[~positive]
    if metadata.frequency_penalties is not None:
        logits -= metadata.frequency_penalties[:, None] * output_counts
    if metadata.presence_penalties is not None:
        logits -= metadata.presence_penalties[:, None] * in_output
    return logits
    # END SOLUTION


def filter_logits(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Temperature, min-p, top-k, top-p: the logits the random rows sample from.

    Returns a new (N, V) tensor with ``-inf`` at every removed token. Greedy
    rows are passed through at temperature 1 (their result is not used).
    """
    # Greedy rows have T = 0; dividing by 1 instead keeps them finite.
    # BEGIN SOLUTION
    temperature = torch.where(
        metadata.greedy_mask, torch.ones_like(metadata.temperature), metadata.temperature
    )
    logits = logits / temperature[:, None]  # (N, V)
    if metadata.min_p is not None:
        logits = apply_min_p(logits, metadata.min_p)
    if metadata.top_k is not None:
        logits = apply_top_k(logits, metadata.top_k)
    if metadata.top_p is not None:
        logits = apply_top_p(logits, metadata.top_p)
    return logits
    # END SOLUTION


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens with probability below ``min_p * max probability`` (per row)."""
    # BEGIN SOLUTION
    probs = torch.softmax(logits, dim=-1)  # (N, V)
    max_prob = probs.max(dim=-1, keepdim=True).values  # (N, 1)
    return logits.masked_fill(probs < min_p[:, None] * max_prob, _NEG_INF)
    # END SOLUTION


def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Keep the ``top_k`` largest logits per row (all ties with the k-th are kept)."""
    # BEGIN SOLUTION
    sorted_logits = logits.sort(dim=-1, descending=True, stable=True).values  # (N, V)
    kth_largest = sorted_logits.gather(1, (top_k - 1)[:, None])  # (N, 1)
    return logits.masked_fill(logits < kth_largest, _NEG_INF)
    # END SOLUTION


def apply_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probability reaches ``top_p``.

    A token is kept when the probability of the tokens ranked strictly above
    it is below ``top_p``; so the most likely token is always kept. Rows with
    ``top_p == 1`` are left alone: a cumulative sum can round up to 1 before
    the tail, and "keep everything" must mean everything.
    """
    # BEGIN SOLUTION
    sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)  # (N, V)
    sorted_probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # (N, V)
    remove_sorted = (mass_before >= top_p[:, None]) & (top_p[:, None] < 1.0)
    remove = torch.zeros_like(remove_sorted).scatter_(1, order, remove_sorted)  # unsort
    return logits.masked_fill(remove, _NEG_INF)
    # END SOLUTION


def gather_logprobs(
    logprobs: torch.Tensor, sampled: torch.Tensor, num_logprobs: int
) -> LogprobsTensors:
    """The sampled token's logprob and rank, plus the ``num_logprobs`` best per row.

    Args:
        logprobs: (N, V) log-softmax of the raw logits.
        sampled: (N,) the sampled token ids.
        num_logprobs: K, how many top tokens to return.
    """
    # BEGIN SOLUTION
    top_logprobs, top_ids = logprobs.topk(num_logprobs, dim=-1)  # (N, K)
    sampled_logprob = logprobs.gather(1, sampled[:, None])  # (N, 1)
    # vLLM's rank: how many tokens are at least as likely as the sampled one.
    ranks = (logprobs >= sampled_logprob).sum(dim=-1)  # (N,)
    return LogprobsTensors(
        logprob_token_ids=torch.cat([sampled[:, None], top_ids], dim=1),  # (N, K + 1)
        logprobs=torch.cat([sampled_logprob, top_logprobs], dim=1),  # (N, K + 1)
        selected_token_ranks=ranks,
    )
    # END SOLUTION
