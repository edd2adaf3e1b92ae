"""The proposer interface: who guesses the drafts, and the n-gram proposer behind it.

Speculative decoding calls a proposer once per engine step, **after** the
step's tokens are appended (``Scheduler.update_from_output``) and before the
next :meth:`~minivllm.ref.scheduler.Scheduler.schedule`::

    drafts, draft_probs = proposer.propose(requests, max_num_drafts)

- ``requests``: the running requests that just emitted tokens and may be
  speculated (every token but the last sampled one computed; not in prefill,
  not resumed from a preemption, not backed off: :mod:`.step` decides);
- ``max_num_drafts[i]``: the most drafts request ``i`` may get (``k``, capped
  by ``max_model_len``, the tokens left to ``max_tokens`` and ``min_tokens``);
- returns ``drafts[i]`` (a list of at most ``max_num_drafts[i]`` token ids,
  possibly empty) and ``draft_probs``: None when the proposer has no
  distribution (n-gram: ``q`` is one-hot), else a ``(sum(len(d)), V)`` float32
  tensor, request after request, row ``j`` of request ``i`` the distribution
  ``drafts[i][j]`` was sampled from (the layout
  :func:`~minivllm.ref.rejection_sampler.rejection_sample` takes).

The engine stores each request's drafts on ``request.spec_token_ids``; the
scheduler verifies them in the next step as ``1 + d`` query tokens. It may
schedule fewer drafts than proposed (the token budget), then only the first
rows of ``draft_probs`` are used.

**A draft model** (or self-speculation: the target's first ``L`` layers plus its
norm and lm_head) implements the same protocol. It needs the worker's model
and KV cache: build it with the engine's executor (``make_proposer``). When it
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
from typing import Protocol, runtime_checkable

import torch

from minivllm import backend
from minivllm.request import Request, RequestStatus
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
                  executor=None) -> Proposer:
    """The proposer ``config.method`` names (``executor``: what a draft model runs on)."""
    if config.method == "ngram":
        return NgramProposer(config, components)
    if config.method == "draft_model":
        from minivllm.spec_decode.draft_model import make_draft_proposer

        return make_draft_proposer(config, executor.whole_model_worker())
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

    The engine's step calls it twice: :meth:`record` after verification (each
    request's acceptance feeds its back-off, :mod:`.backoff`) and
    :meth:`propose` after the scheduler has appended the step's tokens.

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

    def record(self, request_id: str, num_accepted: int, num_drafts: int, step: int) -> None:
        """One verification of ``num_drafts >= 1`` drafts at engine step ``step``."""
        self.backoff.record(request_id, num_accepted, num_drafts, step)

    def propose(self, running: Sequence[Request], step: int) -> dict[str, torch.Tensor]:
        """Set ``spec_token_ids`` of every running request for the next step.

        Returns each request's draft distributions ``q`` (``(d, V)``; none for
        a proposer without them). Only a request whose every token but the
        last sampled one is computed gets drafts (not one in prefill or
        recomputing after a preemption), none while it is backed off, none at
        all in a step with at least ``disable_by_batch_size`` running requests.
        """
        limit = self.config.disable_by_batch_size
        batch_off = limit is not None and len(running) >= limit
        requests, caps = [], []
        for r in running:
            r.spec_token_ids = []
            if batch_off or r.status != RequestStatus.RUNNING \
                    or r.num_computed_tokens != r.num_tokens - 1 \
                    or not self.backoff.may_propose(r.request_id, step):
                continue
            cap = self.max_num_drafts(r)
            if cap > 0:
                requests.append(r)
                caps.append(cap)
        if not requests:
            return {}
        drafts, probs = self.proposer.propose(requests, caps)
        draft_probs: dict[str, torch.Tensor] = {}
        at = 0
        for r, d, cap in zip(requests, drafts, caps):
            d = list(d)
            if len(d) > cap:
                raise ValueError(f"the proposer gave request {r.request_id!r} {len(d)} drafts; "
                                 f"at most {cap} were allowed")
            r.spec_token_ids = d
            if probs is not None and d:
                draft_probs[r.request_id] = probs[at : at + len(d)]
            at += len(d)
        return draft_probs

    def max_num_drafts(self, request: Request) -> int:
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

    def forget(self, request_id: str) -> None:
        """Drop what is kept for a finished request."""
        self.backoff.forget(request_id)
