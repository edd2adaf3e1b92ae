"""Logits shaping: the engine's logits processors, applied before each sampling step.

:class:`LogitsShaper` holds the built-in processors (the ``logits_processors``
component: ``allowed_token_ids``, ``bad_words``, ``logit_bias``) and the
custom ones of ``LLM(logits_processors=[...])``. The engine's
:class:`~minivllm.worker.sampling.StepSampler` calls :meth:`LogitsShaper.apply`
on each step's logits, after the grammar masks and before the sampler (or the
rejection sampler) component, so shaping composes with structured outputs,
penalties, ``min_tokens`` (which stay in the sampler), ``n > 1`` and
speculative decoding (a draft position's row continues the drafts before it).

It turns the engine's requests into the interface's
:class:`~minivllm.logits_processor.BatchUpdate`: a request is *added* the
first time it samples, *removed* when the engine forgets it (finished,
aborted, failed), and every step says which request each row belongs to.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType

import torch

from minivllm.logits_processor import BatchUpdate, LogitsProcessor, LogitsProcessorConfig
from minivllm.request import Request
from minivllm.sampling_params import SamplingParams


class LogitsShaper:
    """The step's logits processors (see the module docstring).

    Args:
        module: the ``logits_processors`` component (its ``builtin_processors``).
        custom: the user's processor classes (already loaded and checked).
        config: what the processors are told about the engine.
        device: where the logits live.
    """

    def __init__(self, module: ModuleType, custom: Sequence[type[LogitsProcessor]],
                 config: LogitsProcessorConfig, device: torch.device) -> None:
        self.custom = tuple(custom)
        self.processors: list[LogitsProcessor] = list(
            module.builtin_processors(config, device, False))
        self.processors += [cls(config, device, False) for cls in self.custom]
        self.known: set[str] = set()  # requests the processors were told of
        self.removed: list[str] = []  # forgotten since the last step

    def validate(self, params: SamplingParams) -> None:
        """Each custom processor's ``validate_params`` (``ValueError`` for a bad request)."""
        for cls in self.custom:
            cls.validate_params(params)

    def remove_request(self, request_id: str) -> None:
        """The request left the engine: the processors hear it at the next step."""
        if request_id in self.known:
            self.known.discard(request_id)
            self.removed.append(request_id)

    def apply(self, logits: torch.Tensor, reqs: list[Request], drafts: list[tuple[int, ...]]
              ) -> tuple[torch.Tensor, list[tuple[Request, Exception]]]:
        """The shaped logits, and the requests left with no allowed token at some row.

        ``logits`` holds ``1 + len(drafts[i])`` rows for ``reqs[i]``; it is not
        modified: the result is a float32 copy, or ``logits`` itself when no
        processor has work this step.
        """
        rows, row_drafts = [], []
        for r, d in zip(reqs, drafts):
            for j in range(len(d) + 1):
                rows.append(r.request_id)
                row_drafts.append(tuple(d[:j]))
        added = [(r.request_id, r.sampling_params, r.prompt_token_ids, r.output_token_ids)
                 for r in reqs if r.request_id not in self.known]
        self.known.update(a[0] for a in added)
        update = BatchUpdate(tuple(added), tuple(self.removed), tuple(rows), tuple(row_drafts))
        self.removed = []
        for p in self.processors:
            p.update_state(update)
        if not self.custom and not any(r.sampling_params.uses_logits_shaping for r in reqs):
            return logits, []
        all_greedy = all(r.sampling_params.greedy for r in reqs)
        shaped = logits.to(torch.float32, copy=True)  # (rows, V)
        for p in self.processors:
            if not (all_greedy and p.is_argmax_invariant()):
                shaped = p.apply(shaped)
        return shaped, self._dead(shaped, reqs, drafts)

    @staticmethod
    def _dead(logits: torch.Tensor, reqs: list[Request], drafts: list[tuple[int, ...]]
              ) -> list[tuple[Request, Exception]]:
        """Requests with a row where every logit is ``-inf`` (nothing could be sampled)."""
        empty = (logits == float("-inf")).all(dim=-1).tolist()  # (rows,)
        dead, start = [], 0
        for r, d in zip(reqs, drafts):
            if any(empty[start : start + len(d) + 1]):
                dead.append((r, ValueError(
                    "no token is left to sample: allowed_token_ids, bad_words, logit_bias "
                    "and the other constraints of the request exclude every token")))
            start += len(d) + 1
        return dead
