"""What the worker is told to sample in a step, and what it gives back (vLLM v1's split).

The worker turns logits into tokens: the last pipeline stage (its tensor-
parallel rank 0) runs the forward pass, then the logits processors, the grammar
bitmask, and the sampler or the rejection sampler, and sends back token ids
(:class:`ModelRunnerOutput`), never logit rows. The engine says what to sample
in a :class:`SamplingPlan` that travels inside the step's
:class:`~minivllm.metadata.StepInput`:

- **who samples**, in logits-row order: ``req_ids[i]`` owns ``1 + len(drafts[i])``
  rows (its last real token, then one row per draft it verifies);
- **what the worker must know of them**: :class:`NewRequestData` the first time a
  request samples (its parameters, prompt and the outputs it already has), then
  only the tokens the engine appended since (``new_token_ids``), and the ids the
  engine forgot (``finished_req_ids``). The worker's copy of a request is the
  engine's, whoever chose the tokens (the sampler, a beam search, a fork), so
  penalties and ``bad_words`` read the same history on either side;
- **the features' shares of the step**: rows a sibling of ``n > 1`` samples from
  (``fan_out``), rows a beam ranks instead of sampling (``ranked``), the grammar
  bitmask of the constrained rows (built on the engine's side, where the grammars
  live, and applied by the worker), and the prompt-logprob rows.

The worker's copy of a request takes the tokens it emitted at once (so that it
can propose drafts after them, as vLLM v1's model runner does); the engine
counts them as heard, and sends only the tokens the worker did not choose.

Both classes are frozen: a step's plan and its output are read, never changed.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from minivllm.sampling_params import SamplingParams

#: One emitted token's logprob row: (token ids, logprobs, rank of the sampled token).
LogprobRow = tuple[list[int], list[float], int]


@dataclass(frozen=True)
class NewRequestData:
    """A request the sampling worker has not seen yet: what sampling it needs."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    output_token_ids: tuple[int, ...]  # a forked child or a requeued sibling has some
    sampling_params: SamplingParams
    eos_token_id: int | None
    max_tokens: int  # the scheduler's (max_model_len - prompt when the params say None)


@dataclass(frozen=True)
class SamplingPlan:
    """What the sampling worker does with a step's logits (see the module docstring).

    Attributes:
        req_ids: the requests that sample, in logits-row order (after the
            prompt-logprob rows, which :attr:`prompt_logprob_rows` locate).
        drafts: per request, the drafts it verifies (its ``1 + d`` rows).
        new_requests: requests sampling for the first time.
        new_token_ids: ``(request id, tokens)``: outputs the engine appended
            since the worker last heard of the request.
        finished_req_ids: requests the engine forgot: their state goes.
        fan_out: ``(sibling id, source request id)``: the sibling samples its
            own token from the source's (single) row, with its own generator.
        ranked: ``(request id, k, temperature)``: the request's row gives its
            top ``k`` log-probabilities of ``logits / temperature`` (a beam),
            and nothing is sampled for it.
        skipped: requests whose rows are left out (the engine already knows
            they fail: a grammar dead end).
        grammar_bitmask: ``(len(bitmask_req_ids), W)`` int32 packed allowed
            tokens, or None; row ``i`` masks ``bitmask_req_ids[i]``'s row.
        bitmask_req_ids: the constrained requests, in bitmask-row order.
        prompt_logprob_rows: ``(request id, first_position, first_row, count)``
            (:attr:`minivllm.metadata.StepInput.prompt_logprob_rows`).
        prompt_logprobs: request id -> how many prompt logprobs it asks for.
        no_drafts: requests that get no speculative drafts (constrained ones).
        num_running: requests running when the step was scheduled
            (``disable_by_batch_size`` turns speculation off at that many).
    """

    req_ids: tuple[str, ...] = ()
    drafts: tuple[tuple[int, ...], ...] = ()
    new_requests: tuple[NewRequestData, ...] = ()
    new_token_ids: tuple[tuple[str, tuple[int, ...]], ...] = ()
    finished_req_ids: tuple[str, ...] = ()
    fan_out: tuple[tuple[str, str], ...] = ()
    ranked: tuple[tuple[str, int, float], ...] = ()
    skipped: frozenset[str] = frozenset()
    grammar_bitmask: torch.Tensor | None = None
    bitmask_req_ids: tuple[str, ...] = ()
    prompt_logprob_rows: tuple[tuple[str, int, int, int], ...] = ()
    prompt_logprobs: Mapping[str, int] = field(default_factory=dict)
    no_drafts: frozenset[str] = frozenset()
    num_running: int = 0


@dataclass(frozen=True)
class PromptLogprobs:
    """One request's prompt-logprob rows of a step: row ``i`` scores prompt token
    ``first_position + i + 1`` (ids, logprobs and rank of that token, as a
    :data:`LogprobRow`)."""

    request_id: str
    first_position: int
    rows: tuple[LogprobRow, ...]


@dataclass(frozen=True)
class ModelRunnerOutput:
    """What the sampling worker sends back for one step (vLLM v1's name).

    Attributes:
        req_ids: the requests that got tokens, in plan order (fanned-out
            siblings last).
        sampled_token_ids: per request, the tokens it emitted: one, or with
            drafts the accepted ones plus one more.
        logprobs: per request, one :data:`LogprobRow` per emitted token, or None
            if it asked for none.
        prompt_logprobs: the step's :class:`PromptLogprobs`.
        ranked: request id -> ``(logprobs, token ids)``: a beam's top ``k``.
        failures: ``(request id, error)``: requests whose sampling failed (a
            logits processor, a dead row): they alone end.
        draft_token_ids: request id -> the drafts proposed for its next step
            (speculative decoding; only requests that got some).
        logits: the raw ``(num_logits, vocab)`` float32 logits, only when the
            step had no plan (tests and benchmarks of the forward pass).
    """

    req_ids: tuple[str, ...] = ()
    sampled_token_ids: tuple[tuple[int, ...], ...] = ()
    logprobs: tuple[list[LogprobRow] | None, ...] = ()
    prompt_logprobs: tuple[PromptLogprobs, ...] = ()
    ranked: Mapping[str, tuple[list[float], list[int]]] = field(default_factory=dict)
    failures: tuple[tuple[str, Any], ...] = ()
    draft_token_ids: Mapping[str, list[int]] = field(default_factory=dict)
    logits: torch.Tensor | None = None
