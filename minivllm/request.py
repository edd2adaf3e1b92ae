"""``Request``: the state one prompt carries through the engine.

Both scheduler twins (``minivllm/ref/scheduler.py`` and
``minivllm/fast/scheduler.py``) read and update these objects; the model runner
reads them to build each step's batch. Names follow vLLM v1
(``vllm/v1/request.py``).
"""

from __future__ import annotations

import enum
import time
from types import MappingProxyType
from typing import Any

from minivllm.prefix_hash import hash_block_tokens
from minivllm.sampling_params import SamplingParams

#: Tags the seed of a LoRA request's block hashes (so it is no block's hash of tokens).
LORA_HASH_TAG = 2**64 - 1


class RequestStatus(enum.IntEnum):
    """Where a request is in its life. Every value from ``FINISHED_STOPPED`` on is final."""

    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()  # EOS, a stop token id or a stop string
    FINISHED_LENGTH = enum.auto()  # max_tokens or max_model_len reached
    FINISHED_ABORTED = enum.auto()  # aborted by the user (or a client that hung up)
    FINISHED_ERROR = enum.auto()  # a failure that belongs to this request alone

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        return status >= RequestStatus.FINISHED_STOPPED

    @staticmethod
    def finish_reason(status: RequestStatus) -> str | None:
        """vLLM's ``finish_reason`` string for a final status, else None."""
        return _FINISH_REASON.get(status)


_FINISH_REASON = MappingProxyType({
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
})


class Request:
    """One generation request.

    Attributes:
        request_id: unique id (a string, as in vLLM).
        prompt_token_ids: the prompt, as token ids.
        sampling_params: how to sample and when to stop.
        eos_token_id: the model's end-of-sequence id (None if it has none).
        output_token_ids: tokens generated so far.
        num_computed_tokens: how many of ``all_token_ids`` already have their
            K/V in the paged cache (prefix-cache hits count as computed).
        num_cached_tokens: prompt tokens served from the prefix cache the
            first time the request was scheduled (-1 until then).
        status: a :class:`RequestStatus`.
        stop_reason: the stop string or token id that ended it, if any.
        num_preemptions: how often it was preempted and recomputed.
        spec_token_ids: draft tokens proposed for its next step (speculative
            decoding; vLLM's name). The scheduler moves them into the step it
            schedules (``SchedulerOutput.scheduled_spec_decode_tokens``); a
            preemption drops them.
        block_hashes: chained hashes of its full blocks computed so far
            (:mod:`minivllm.prefix_hash`), filled in by the KV cache manager
            when prefix caching is on. They live on the request, as in vLLM
            v1, so they survive a preemption: a resumed request is not
            re-hashed from its first token.
        lora_request: its LoRA adapter (a ``LoRARequest``), or None: the base model.
        root_block_hash: the parent hash of its first block (see
            :mod:`minivllm.prefix_hash`): None (the shared seed) for the base
            model, a seed of the adapter's own under a LoRA adapter, so that
            KV computed under one adapter is never found for another (vLLM's
            "extra keys").
        priority: its priority under the ``priority`` scheduling policy (vLLM's:
            lower is served first; ties by ``arrival_time``); 0 under ``fcfs``.
        skip_reading_prefix_cache: True when it asked for ``prompt_logprobs``
            (vLLM's name and rule): every prompt position must be computed to
            have its logits, so the KV cache manager finds no prefix-cache hit
            for it (its blocks still enter the cache for others).
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_id: int | None = None,
        arrival_time: float | None = None,
        lora_request: Any = None,
        priority: int = 0,
    ) -> None:
        self.request_id = request_id
        self.lora_request = lora_request
        self.root_block_hash = None if lora_request is None else \
            hash_block_tokens(None, [LORA_HASH_TAG, lora_request.lora_int_id])
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.priority = priority
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(self.prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.num_preemptions = 0
        self.block_hashes: list[int] = []
        self.spec_token_ids: list[int] = []
        self.skip_reading_prefix_cache = \
            getattr(sampling_params, "prompt_logprobs", None) is not None
        # max_tokens=None means "until max_model_len"; the scheduler fills it in.
        self.max_tokens = sampling_params.max_tokens

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        """``num_tokens`` plus the drafts waiting to be verified."""
        return len(self.all_token_ids) + len(self.spec_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    def get_finished_reason(self) -> str | None:
        return RequestStatus.finish_reason(self.status)

    def branch(self, request_id: str, token_ids: list[int]) -> Request:
        """A new request that continues this one: the same prompt, parameters and adapter,
        its output tokens so far plus ``token_ids`` (a beam search's new beam). Nothing is
        computed or scheduled yet; this request is unchanged."""
        child = Request(request_id, self.prompt_token_ids, self.sampling_params,
                        self.eos_token_id, lora_request=self.lora_request,
                        priority=self.priority)
        child.output_token_ids = [*self.output_token_ids, *token_ids]
        child.all_token_ids = [*self.all_token_ids, *token_ids]
        return child

    def append_output_token_ids(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, prompt={self.num_prompt_tokens}, "
            f"out={self.num_output_tokens}, computed={self.num_computed_tokens}, "
            f"{self.status.name})"
        )


def check_stop(request: Request, max_model_len: int) -> bool:
    """Set ``request.status`` to a final value if its last token ends it.

    Called by the scheduler right after a sampled token is appended. Stop
    *strings* need the detokenized text, so the engine checks those itself.
    Returns True if the request is now finished.
    """
    params = request.sampling_params
    if request.num_tokens >= max_model_len or (
        request.max_tokens is not None and request.num_output_tokens >= request.max_tokens
    ):
        request.status = RequestStatus.FINISHED_LENGTH
        return True
    if request.num_output_tokens < params.min_tokens:
        return False
    last = request.output_token_ids[-1]
    if not params.ignore_eos and last == request.eos_token_id:
        request.status = RequestStatus.FINISHED_STOPPED
        return True
    if last in params.stop_token_ids:
        request.status = RequestStatus.FINISHED_STOPPED
        request.stop_reason = last
        return True
    return False
