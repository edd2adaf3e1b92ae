"""The proposer interface: who guesses the drafts, and the n-gram proposer behind it.

Speculative decoding calls a proposer once per step, in the sampling worker,
**after** the step's tokens are sampled (and appended to the worker's copy of
each request), before the engine schedules the next step::

    drafts, draft_probs = proposer.propose(requests, max_num_drafts)

- ``requests``: the requests that just emitted tokens and may be speculated
  (every token but the last sampled one computed, not constrained, not backed
  off: :class:`Speculator` decides). They are the worker's
  :class:`~minivllm.worker.sampling.CachedRequestState`: ``request_id``,
  ``all_token_ids``, ``num_tokens``, ``sampling_params``;
- ``max_num_drafts[i]``: the most drafts request ``i`` may get (``k``, capped
  by ``max_model_len``, the tokens left to ``max_tokens`` and ``min_tokens``);
- returns ``drafts[i]`` (a list of at most ``max_num_drafts[i]`` token ids,
  possibly empty) and ``draft_probs``: None when the proposer has no
  distribution (n-gram: ``q`` is one-hot), else a ``(sum(len(d)), V)`` float32
  tensor, request after request, row ``j`` of request ``i`` the distribution
  ``drafts[i][j]`` was sampled from (the layout
  :func:`~minivllm.ref.rejection_sampler.rejection_sample` takes).

The drafts go back to the engine with the step's tokens, and the scheduler
takes them (``Scheduler.update_draft_token_ids`` sets ``request.spec_token_ids``);
it verifies them in the next step as ``1 + d`` query tokens. It may
schedule fewer drafts than proposed (the token budget), then only the first
rows of ``draft_probs`` are used.

**A draft model** (or self-speculation: the target's first ``L`` layers plus its
norm and lm_head) implements the same protocol. It needs the worker's model
and KV cache: the sampling worker builds it beside itself (``make_proposer``). When it
runs, request ``r`` has ``r.num_computed_tokens == r.num_tokens - 1``; the draft
feeds ``r.all_token_ids[-1]`` at position ``r.num_tokens - 1`` and then its own
guesses, writing K/V at positions ``r.num_tokens - 1 .. r.num_tokens + k - 2``.
``SchedulerConfig.num_lookahead_tokens = k`` makes the scheduler reserve those
slots in the step before (``KVCacheManager.allocate_slots(...,
num_lookahead_tokens)``). Self-speculation may write its layers' K/V into the
target's own cache there: the next verify pass recomputes exactly those
positions with the same layers and overwrites them with identical values for
the accepted prefix (and a rejected position is rolled back, never read).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import torch

from minivllm import backend
from minivllm.request import Request
from minivllm.spec_decode.backoff import BackOff
from minivllm.spec_decode.config import SpeculativeConfig


@runtime_checkable
class Proposer(Protocol):
    """Anything that proposes drafts for a batch of requests (see the module docstring)."""

    def propose(
        self, requests: Sequence[Request], max_num_drafts: Sequence[int]
    ) -> tuple[list[list[int]], torch.Tensor | None]:
        """``(drafts per request, draft_probs (sum of drafts, V) float32 or None)``."""
        ...


class NgramProposer:
    """Prompt lookup (vLLM's ``method="ngram"``) over each request's own tokens.

    Args:
        config: ``prompt_lookup_min`` / ``prompt_lookup_max`` come from it.
        components: the engine's components; ``ngram_proposer`` does the search.
    """

    def __init__(self, config: SpeculativeConfig, components: backend.Components) -> None:
        self.config = config
        self.ngram = components.ngram_proposer

    def propose(
        self, requests: Sequence[Request], max_num_drafts: Sequence[int]
    ) -> tuple[list[list[int]], torch.Tensor | None]:
        """The tokens that followed the longest earlier match of each request's suffix."""
        if not requests:
            return [], None
        drafts = self.ngram.propose_batch(
            [r.all_token_ids for r in requests], list(max_num_drafts),
            self.config.prompt_lookup_min, self.config.prompt_lookup_max,
        )
        return [list(d) for d in drafts], None


def make_proposer(config: SpeculativeConfig, components: backend.Components,
                  worker=None) -> Proposer:
    """The proposer ``config.method`` names (``worker``: the sampling worker a draft
    model runs beside, or None if it does not hold the whole model)."""
    if config.method == "ngram":
        return NgramProposer(config, components)
    if config.method == "draft_model":
        from minivllm.spec_decode.draft_model import make_draft_proposer

        return make_draft_proposer(config, worker)
    raise ValueError(f"speculative_config.method {config.method!r} has no proposer in this "
                     f"engine yet (built: 'ngram')")


def num_lookahead_tokens(config: SpeculativeConfig | None) -> int:
    """KV slots the scheduler reserves past each chunk for the proposer (vLLM's rule).

    n-gram drafts are host-side guesses: they need slots only when verified,
    as scheduled tokens. A draft model writes ``k`` positions ahead.
    """
    if config is None or config.method == "ngram":
        return 0
    return config.num_speculative_tokens


class Speculator:
    """Who gets drafts, and how many, each step; the proposer that guesses them.

    It lives in the sampling worker, beside the sampler that verifies the
    drafts (vLLM v1's model runner proposes too). After each step's sampling,
    :meth:`step` records each verification (it feeds the request's back-off,
    :mod:`.backoff`) and proposes the next drafts for the requests that just
    sampled; the drafts go back to the engine in the step's
    :class:`~minivllm.step_sampling.ModelRunnerOutput` and enter the scheduler
    through ``update_draft_token_ids``; a draft model's ``q`` rows stay here,
    with the sampler, until those drafts are verified.

    Args:
        config: the engine's :class:`SpeculativeConfig`.
        proposer: who guesses (:func:`make_proposer`).
        max_model_len: drafts never reach past it.
    """

    def __init__(self, config: SpeculativeConfig, proposer: Proposer,
                 max_model_len: int) -> None:
        self.config = config
        self.proposer = proposer
        self.max_model_len = max_model_len
        self.backoff = BackOff()

    def step(self, requests: Sequence[Any], tokens: Sequence[Sequence[int]],
             drafts: Sequence[Sequence[int]], allowed: Sequence[bool], step: int,
             num_running: int) -> tuple[dict[str, list[int]], dict[str, torch.Tensor]]:
        """After sampling at worker step ``step``: record, then propose.

        ``requests[i]`` just emitted ``tokens[i]`` after verifying ``drafts[i]``
        (its outputs already hold them); ``allowed[i]``: it may get drafts (a
        constrained request may not). Returns ``(drafts by id, q rows by id)``.
        """
        for r, t, d in zip(requests, tokens, drafts):
            if d:
                self.backoff.record(r.request_id, len(t) - 1, len(d), step)
        limit = self.config.disable_by_batch_size
        if limit is not None and num_running >= limit:
            return {}, {}
        eligible = [r for r, ok in zip(requests, allowed)
                    if ok and self.backoff.may_propose(r.request_id, step + 1)]
        return self.propose(eligible)

    def propose(self, requests: Sequence[Any]
                ) -> tuple[dict[str, list[int]], dict[str, torch.Tensor]]:
        """Drafts for ``requests`` (every token but the last sampled one computed):
        ``(drafts by id, each one's q rows (d, V) by id: none for a proposer without)``."""
        caps = [self.max_num_drafts(r) for r in requests]
        requests = [r for r, cap in zip(requests, caps) if cap > 0]
        caps = [cap for cap in caps if cap > 0]
        if not requests:
            return {}, {}
        drafts, probs = self.proposer.propose(requests, caps)
        out: dict[str, list[int]] = {}
        draft_probs: dict[str, torch.Tensor] = {}
        at = 0
        for r, d, cap in zip(requests, drafts, caps):
            d = list(d)
            if len(d) > cap:
                raise ValueError(f"the proposer gave request {r.request_id!r} {len(d)} drafts; "
                                 f"at most {cap} were allowed")
            if d:
                out[r.request_id] = d
            if probs is not None and d:
                draft_probs[r.request_id] = probs[at : at + len(d)]
            at += len(d)
        return out, draft_probs

    def max_num_drafts(self, request: Any) -> int:
        """``k``, capped so that no draft lies past what plain decoding could emit.

        Drafts stay below ``max_model_len`` and leave room for the extra token
        within ``max_tokens``; below ``min_tokens`` a request gets at most
        ``min_tokens - num_output_tokens - 1`` drafts, so that every position
        it verifies is still below ``min_tokens`` (the stop tokens stay masked
        at all of them, as the rejection sampler masks per request).
        """
        n_out = request.num_output_tokens
        cap = min(self.config.num_speculative_tokens,
                  self.max_model_len - request.num_tokens,
                  request.max_tokens - n_out - 1)
        min_tokens = request.sampling_params.min_tokens
        if n_out < min_tokens:
            cap = min(cap, min_tokens - n_out - 1)
        return max(cap, 0)

    def invalidate(self, request_id: str) -> None:
        """The request's block-table row went (preempted, forked): a separate draft's
        cache of it is void."""
        forget_cache = getattr(self.proposer, "invalidate", None)
        if forget_cache is not None:
            forget_cache(request_id)

    def forget(self, request_id: str) -> None:
        """Drop what is kept for a finished request."""
        self.backoff.forget(request_id)
        forget = getattr(self.proposer, "forget", None)
        if forget is not None:
            forget(request_id)
