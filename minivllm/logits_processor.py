"""The logits-processor interface (vLLM v1's, minivllm-sized).

A logits processor edits one step's logits before the sampler sees them:
``logit_bias``, ``allowed_token_ids`` and ``bad_words`` are the built-ins
(the ``logits_processors`` component, :mod:`minivllm.ref.logits_processors`),
and ``LLM(logits_processors=[...])`` adds your own. Like vLLM's, a processor
is *batch-level*: it keeps per-request state, is told which requests joined
and left the batch, and edits the whole ``(rows, V)`` logits at once.

Each step, before sampling, the engine calls, on every processor::

    processor.update_state(BatchUpdate(added, removed, rows, row_drafts))
    logits = processor.apply(logits)         # (rows, V) float32; may edit in place

- ``added``: requests that sample for the first time this step, as
  ``(request_id, SamplingParams, prompt_token_ids, output_token_ids)``;
  ``output_token_ids`` is the request's own list, which grows as it generates,
  so the processor always sees the tokens so far.
- ``removed``: requests that left since the last step (finished, aborted, failed).
- ``rows``: the request id of each logits row, in order (the row order changes
  from step to step); ``row_drafts``: the draft tokens that come before each
  row (speculative decoding: a request verifying ``d`` drafts owns ``1 + d``
  rows, and row ``j`` continues ``output_token_ids + drafts[:j]``; ``()``
  without drafts).

Where vLLM keys its state by batch index (with moves and swaps), minivllm
keys it by request id and hands over the row order each step: the same
information, told the simple way.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from minivllm.sampling_params import SamplingParams

#: ``(request_id, params, prompt_token_ids, output_token_ids)`` of a request new to the batch.
AddedRequest = tuple[str, SamplingParams, list[int], list[int]]


@dataclass(frozen=True)
class LogitsProcessorConfig:
    """What a processor may need to know about the engine (vLLM passes its whole config).

    Attributes:
        vocab_size: ``V``, the width of the logits.
        max_num_seqs: the most requests running at once.
        num_speculative_tokens: ``k`` of speculative decoding (0 without it).
    """

    vocab_size: int
    max_num_seqs: int = 256
    num_speculative_tokens: int = 0


@dataclass(frozen=True)
class BatchUpdate:
    """What changed in the batch since the last step, and this step's row order.

    Attributes:
        added: requests new to the batch (:data:`AddedRequest`).
        removed: ids of requests that left it.
        rows: the request id of each logits row this step.
        row_drafts: per row, the draft tokens before it (``()`` without drafts).
    """

    added: Sequence[AddedRequest]
    removed: Sequence[str]
    rows: Sequence[str]
    row_drafts: Sequence[tuple[int, ...]]

    @property
    def batch_size(self) -> int:
        """The number of logits rows this step."""
        return len(self.rows)


class LogitsProcessor(ABC):
    """A batch-level logits processor (see the module docstring).

    Subclasses take ``(config, device, is_pin_memory)`` as vLLM's do, keep
    their own per-request state in :meth:`update_state`, and edit the logits
    in :meth:`apply`.
    """

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        """Raise ``ValueError`` if a request's params are bad for this processor.

        Called when the request is added, before it is queued (default: accept)."""
        return None

    @abstractmethod
    def __init__(self, config: LogitsProcessorConfig, device: torch.device,
                 is_pin_memory: bool) -> None:
        raise NotImplementedError

    @abstractmethod
    def update_state(self, batch_update: BatchUpdate) -> None:
        """Take in the batch's changes and this step's row order (before :meth:`apply`)."""
        raise NotImplementedError

    @abstractmethod
    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """The edited ``(rows, V)`` float32 logits (editing ``logits`` in place is fine)."""
        raise NotImplementedError

    @abstractmethod
    def is_argmax_invariant(self) -> bool:
        """True if :meth:`apply` never changes a row's argmax (the engine then skips
        it when every row is greedy)."""
        raise NotImplementedError


def load_logits_processor(spec: object) -> type[LogitsProcessor]:
    """A processor class from a class, ``"pkg.module:Class"`` or ``"pkg.module.Class"``.

    Raises ``ValueError`` naming ``logits_processors`` if it cannot be
    imported or is not a :class:`LogitsProcessor` subclass.
    """
    cls = spec
    if isinstance(spec, str):
        module, sep, name = spec.partition(":")
        if not sep:
            module, _, name = spec.rpartition(".")
        try:
            cls = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError, ValueError) as e:
            raise ValueError(f"logits_processors: cannot load {spec!r} "
                             f"('pkg.module:Class' or 'pkg.module.Class'): {e}") from None
    if not (isinstance(cls, type) and issubclass(cls, LogitsProcessor)):
        raise ValueError(f"logits_processors must hold LogitsProcessor subclasses or their "
                         f"import paths, got {spec!r}")
    return cls
