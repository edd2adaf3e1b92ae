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
from minivllm.request import Request
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

        return make_draft_proposer(config, executor)
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
