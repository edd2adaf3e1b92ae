"""The built-in logits processors, fast twin: one batched write over the batch each.

The same processors and results as :mod:`minivllm.ref.logits_processors`
(whose bookkeeping they reuse); what changes is how the logits are written:

- ``allowed_token_ids``: each request's forbidden-token mask is built once,
  when it joins (``(V,)`` bool on the device); a step stacks the masks of its
  rows and does one ``masked_fill_`` over ``(rows, V)``, instead of a gather,
  a fill and a scatter per row.
- ``bad_words``: each request's words are grouped once by prefix length into
  ``{prefix tuple: [last tokens]}``, so a row costs one dict look-up per
  distinct length instead of a list comparison per word; the forbidden
  ``(row, token)`` pairs of the whole batch go in one ``index_put_``.
- ``logit_bias``: the ``(row, token, bias)`` triples of the batch go in one
  ``index_put_(accumulate=True)`` instead of a Python ``+=`` per token; the
  index tensors are rebuilt only when the row order or the requests change.
"""

from __future__ import annotations

import torch

from minivllm.logits_processor import BatchUpdate, LogitsProcessor, LogitsProcessorConfig
from minivllm.ref import logits_processors as _ref
from minivllm.ref.logits_processors import PerRequestProcessor
from minivllm.sampling_params import SamplingParams

_NEG_INF = float("-inf")


class AllowedTokenIdsLogitsProcessor(_ref.AllowedTokenIdsLogitsProcessor):
    """``allowed_token_ids`` as one ``masked_fill_`` (see the module docstring)."""

    def state_for(self, params: SamplingParams) -> object | None:
        if not params.allowed_token_ids:
            return None
        forbidden = torch.ones(self.vocab_size, dtype=torch.bool, device=self.device)  # (V,)
        forbidden[torch.tensor(params.allowed_token_ids, device=self.device)] = False
        return forbidden

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        used = [i for i, rid in enumerate(self.rows) if rid in self.states]
        if not used:
            return logits
        mask = torch.zeros(logits.shape, dtype=torch.bool, device=logits.device)  # (N, V)
        mask[used] = torch.stack([self.states[self.rows[i]] for i in used])
        return logits.masked_fill_(mask, _NEG_INF)


def _tail(output: list[int], drafts: tuple[int, ...], length: int) -> tuple[int, ...] | None:
    """The last ``length`` tokens of ``output + drafts`` (None if there are fewer)."""
    if length > len(output) + len(drafts):
        return None
    if length <= len(drafts):
        return drafts[len(drafts) - length:]
    return tuple(output[len(output) - (length - len(drafts)):]) + drafts


class BadWordsLogitsProcessor(_ref.BadWordsLogitsProcessor):
    """``bad_words`` by prefix look-up and one ``index_put_`` (see the module docstring)."""

    def state_for(self, params: SamplingParams) -> object | None:
        words = params.bad_words_token_ids
        if not words:
            return None
        by_len: dict[int, dict[tuple, list[int]]] = {}
        for w in words:
            by_len.setdefault(len(w) - 1, {}).setdefault(tuple(w[:-1]), []).append(w[-1])
        return by_len

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        rows: list[int] = []
        tokens: list[int] = []
        for i, rid in enumerate(self.rows):
            by_len = self.states.get(rid)
            if by_len is None:
                continue
            for length, prefixes in by_len.items():
                last = prefixes.get(_tail(self.outputs[rid], self.row_drafts[i], length))
                if last:
                    rows += [i] * len(last)
                    tokens += last
        if rows:
            index = (torch.tensor(rows, device=logits.device),
                     torch.tensor(tokens, device=logits.device))
            logits.index_put_(index, torch.tensor(_NEG_INF, device=logits.device))
        return logits


class LogitBiasLogitsProcessor(_ref.LogitBiasLogitsProcessor):
    """``logit_bias`` as one ``index_put_(accumulate=True)`` (see the module docstring)."""

    def __init__(self, config: LogitsProcessorConfig, device: torch.device,
                 is_pin_memory: bool) -> None:
        super().__init__(config, device, is_pin_memory)
        self._key: tuple | None = None  # (rows, request ids) the index below was built for
        self._index: tuple[torch.Tensor, torch.Tensor] | None = None
        self._values: torch.Tensor | None = None

    def update_state(self, batch_update: BatchUpdate) -> None:
        super().update_state(batch_update)
        if not self.states:  # the common case: no request biases anything
            self._key, self._index, self._values = None, None, None
            return
        key = (tuple(self.rows), tuple(self.states))
        if key == self._key:
            return
        self._key = key
        rows, tokens, values = [], [], []
        for i, rid in enumerate(self.rows):
            bias = self.states.get(rid)
            if bias:
                rows += [i] * len(bias)
                tokens += list(bias)
                values += list(bias.values())
        self._index = (torch.tensor(rows, dtype=torch.int64, device=self.device),
                       torch.tensor(tokens, dtype=torch.int64, device=self.device))
        self._values = torch.tensor(values, dtype=torch.float32, device=self.device)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if self._values is None or not self._values.numel():
            return logits
        return logits.index_put_(self._index, self._values.to(logits.dtype), accumulate=True)


def builtin_processors(config: LogitsProcessorConfig, device: torch.device,
                       is_pin_memory: bool = False) -> list[LogitsProcessor]:
    """One of each built-in, in the order they apply: allowed ids, bad words, bias."""
    return [cls(config, device, is_pin_memory) for cls in
            (AllowedTokenIdsLogitsProcessor, BadWordsLogitsProcessor, LogitBiasLogitsProcessor)]


__all__ = ["AllowedTokenIdsLogitsProcessor", "BadWordsLogitsProcessor",
           "LogitBiasLogitsProcessor", "PerRequestProcessor", "builtin_processors"]
