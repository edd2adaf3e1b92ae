"""The built-in logits processors, reference twin: a loop over the rows.

Three of vLLM's per-request logits controls, each a batch-level
:class:`~minivllm.logits_processor.LogitsProcessor` (the interface: see
:mod:`minivllm.logits_processor`). For logits row ``i`` of request ``r``:

- ``allowed_token_ids``: ``logits[i, t] = -inf`` for every ``t`` not allowed;
- ``bad_words``: with ``past`` the tokens ``r`` generated so far (plus the
  drafts before row ``i`` when verifying speculative tokens), for every bad
  word's token sequence ``w``: if ``past`` ends with ``w[:-1]``, then
  ``logits[i, w[-1]] = -inf`` (a one-token word always matches);
- ``logit_bias``: ``logits[i, t] += bias[t]`` for each biased token ``t``.

applied in that order (vLLM's). Every processor keeps its requests' state by
request id (:class:`PerRequestProcessor`) and the row order of the step.

The fast twin (:mod:`minivllm.fast.logits_processors`) does each as one
batched scatter over the whole batch.
"""

from __future__ import annotations

import torch

from minivllm.logits_processor import BatchUpdate, LogitsProcessor, LogitsProcessorConfig
from minivllm.sampling_params import SamplingParams

_NEG_INF = float("-inf")


class PerRequestProcessor(LogitsProcessor):
    """Bookkeeping the built-ins share: a state per request id that uses the
    processor, the step's row order, and each row's draft tokens.

    Subclasses say which state a request needs (:meth:`state_for`, None: the
    processor has nothing to do for it) and write :meth:`apply`.
    """

    def __init__(self, config: LogitsProcessorConfig, device: torch.device,
                 is_pin_memory: bool) -> None:
        self.vocab_size = config.vocab_size
        self.device = torch.device(device)
        self.states: dict[str, object] = {}
        self.outputs: dict[str, list[int]] = {}  # each request's live output_token_ids
        self.rows: list[str] = []
        self.row_drafts: list[tuple[int, ...]] = []

    def state_for(self, params: SamplingParams) -> object | None:
        """What this processor keeps for a request with ``params``; None if nothing."""
        raise NotImplementedError

    def update_state(self, batch_update: BatchUpdate) -> None:
        """Forget the removed requests, take in the added ones, keep the row order."""
        for rid in batch_update.removed:
            self.states.pop(rid, None)
            self.outputs.pop(rid, None)
        for rid, params, _, output_token_ids in batch_update.added:
            state = self.state_for(params)
            if state is not None:
                self.states[rid] = state
                self.outputs[rid] = output_token_ids
        self.rows = list(batch_update.rows)
        self.row_drafts = list(batch_update.row_drafts)

    def is_argmax_invariant(self) -> bool:
        """False: each of the built-ins can change which token is most likely."""
        return False


class AllowedTokenIdsLogitsProcessor(PerRequestProcessor):
    """``allowed_token_ids``: every other token's logit becomes ``-inf``."""

    def state_for(self, params: SamplingParams) -> object | None:
        return list(params.allowed_token_ids) if params.allowed_token_ids else None

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for i, rid in enumerate(self.rows):
            allowed = self.states.get(rid)
            if allowed is None:
                continue
            kept = logits[i, allowed].clone()  # (len(allowed),)
            logits[i] = _NEG_INF
            logits[i, allowed] = kept
        return logits


class BadWordsLogitsProcessor(PerRequestProcessor):
    """``bad_words``: the last token of a bad word whose other tokens were just generated
    is forbidden (needs ``SamplingParams.bad_words_token_ids``, set by the engine)."""

    def state_for(self, params: SamplingParams) -> object | None:
        words = params.bad_words_token_ids
        return [list(w) for w in words] if words else None

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for i, rid in enumerate(self.rows):
            words = self.states.get(rid)
            if words is None:
                continue
            past = list(self.outputs[rid]) + list(self.row_drafts[i])
            for word in words:
                prefix, last = word[:-1], word[-1]
                if len(prefix) > len(past):
                    continue
                if past[len(past) - len(prefix):] == prefix:
                    logits[i, last] = _NEG_INF
        return logits


class LogitBiasLogitsProcessor(PerRequestProcessor):
    """``logit_bias``: each biased token's logit gets its bias added."""

    def state_for(self, params: SamplingParams) -> object | None:
        return dict(params.logit_bias) if params.logit_bias else None

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for i, rid in enumerate(self.rows):
            for token, bias in (self.states.get(rid) or {}).items():
                logits[i, token] += bias
        return logits


def builtin_processors(config: LogitsProcessorConfig, device: torch.device,
                       is_pin_memory: bool = False) -> list[LogitsProcessor]:
    """One of each built-in, in the order they apply: allowed ids, bad words, bias."""
    return [cls(config, device, is_pin_memory) for cls in
            (AllowedTokenIdsLogitsProcessor, BadWordsLogitsProcessor, LogitBiasLogitsProcessor)]
