"""What ``LLM.generate`` hands back: ``RequestOutput`` / ``CompletionOutput`` / ``Logprob``.

Names and fields follow vLLM (``vllm/outputs.py`` and ``vllm/sequence.py``),
so code that reads vLLM's results reads ours::

    out = llm.generate(["Hello"], SamplingParams(max_tokens=8, logprobs=2))[0]
    out.outputs[0].text                 # the generated text
    out.outputs[0].token_ids            # the generated token ids
    out.outputs[0].logprobs[3]          # {token_id: Logprob, ...} for the 4th token
    out.outputs[0].finish_reason        # "stop" | "length" | "abort" | "error" | None
    out.error                           # the exception that ended it, if "error"

Logprobs (when ``SamplingParams.logprobs`` is set) are, as in vLLM v1, the
log-softmax of the model's *raw* logits, before temperature, penalties and
top-k/top-p filtering. Each generated token gets a dict holding the
``logprobs`` most likely tokens plus the sampled token (so it has
``logprobs`` or ``logprobs + 1`` entries).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

#: Per generated token: token id -> its :class:`Logprob`.
SampleLogprobs = list[dict[int, "Logprob"]]


@dataclass
class Logprob:
    """The log-probability of one token at one position.

    Attributes:
        logprob: ``log p(token)`` under the model's raw distribution.
        rank: 1 for the most likely token, 2 for the next, ...; as in vLLM,
            the rank of a token is the number of tokens at least as likely.
        decoded_token: the token's text, if the engine decoded it.
    """

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None

    def __repr__(self) -> str:
        tok = "" if self.decoded_token is None else f", {self.decoded_token!r}"
        return f"Logprob({self.logprob:.4f}, rank={self.rank}{tok})"


@dataclass
class CompletionOutput:
    """One completion of a request: one of its ``n`` (``index`` says which).

    Attributes:
        index: which of the request's ``n`` completions this is.
        text: the generated text (a stop string is cut off unless
            ``include_stop_str_in_output``).
        token_ids: the generated token ids (a stop *token* is included).
        cumulative_logprob: sum of the sampled tokens' logprobs, or None when
            logprobs were not requested.
        logprobs: per generated token, ``{token_id: Logprob}``; None when
            logprobs were not requested.
        finish_reason: ``"stop"``, ``"length"``, ``"abort"``, ``"error"`` (a
            failure of this request alone, see ``RequestOutput.error``), or
            None while the request is still running.
        stop_reason: the stop string or stop token id that ended it; None for
            EOS, length, or a running request.
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        """True once ``finish_reason`` is set."""
        return self.finish_reason is not None

    def __repr__(self) -> str:
        cum = "None" if self.cumulative_logprob is None else f"{self.cumulative_logprob:.4f}"
        nlp = "None" if self.logprobs is None else f"[{len(self.logprobs)} positions]"
        return (
            f"CompletionOutput(index={self.index}, text={self.text!r}, "
            f"token_ids={self.token_ids}, cumulative_logprob={cum}, logprobs={nlp}, "
            f"finish_reason={self.finish_reason}, stop_reason={self.stop_reason!r})"
        )


@dataclass
class RequestOutput:
    """Everything the engine reports for one request at one step (or at the end).

    Attributes:
        request_id: the request's id.
        prompt: the prompt text, if the request was given as text.
        prompt_token_ids: the prompt as token ids.
        outputs: one :class:`CompletionOutput` per completion (``n=1``: one).
        finished: True once the request has finished.
        num_cached_tokens: prompt tokens served from the prefix cache.
        prompt_logprobs: with ``SamplingParams.prompt_logprobs``, one entry per
            prompt token: None for the first, then ``{token_id: Logprob}`` holding
            that prompt token and the ``prompt_logprobs`` most likely tokens at its
            position (vLLM's). Set once the whole prompt is computed (a delta
            stream gets it once); None otherwise.
        lora_request: the :class:`~minivllm.lora.request.LoRARequest` it ran under
            (None: the base model), as vLLM's ``RequestOutput.lora_request``.
        error: the exception that ended this request, when a failure that
            belongs to it alone (preparing its inputs, sampling it,
            detokenizing it, matching its stop strings) aborted it; then
            ``finished`` is True and ``finish_reason`` is ``"error"``. The
            engine kept serving every other request.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int | None = None
    prompt_logprobs: list | None = field(default=None, repr=False)
    error: BaseException | None = field(default=None, repr=False)
    lora_request: Any = None

    def __repr__(self) -> str:
        err = "" if self.error is None else f", error={self.error!r}"
        return (
            f"RequestOutput(request_id={self.request_id!r}, prompt={self.prompt!r}, "
            f"prompt_token_ids={self.prompt_token_ids}, outputs={self.outputs}, "
            f"finished={self.finished}, num_cached_tokens={self.num_cached_tokens}{err})"
        )


@dataclass
class BeamSearchSequence:
    """One finished sequence of a beam search (vLLM's ``BeamSearchSequence``).

    Attributes:
        tokens: the prompt and the generated tokens (an EOS that ended it included).
        cum_logprob: the sum of the generated tokens' log-probabilities.
        score: ``cum_logprob / generated_tokens ** length_penalty``, what the
            sequences are sorted by (best first).
        text: the generated text.
        finish_reason: ``"stop"`` (EOS) or ``"length"`` (``max_tokens``).
    """

    tokens: list[int]
    cum_logprob: float
    score: float
    text: str | None = None
    finish_reason: str | None = None


@dataclass
class BeamSearchOutput:
    """What ``LLM.beam_search`` returns for one prompt: its best sequences, best first."""

    sequences: list[BeamSearchSequence]


class RequestFailedError(RuntimeError):
    """``LLM.generate``: some requests failed on their own; the others finished.

    Raised after every other request of the call has finished, so their work
    is not lost: ``outputs`` holds one :class:`RequestOutput` per prompt, in
    order (the failed ones with ``error`` set). The first failure is the
    ``__cause__``.

    Attributes:
        failed: ``(prompt index, request id, exception)`` per failed request.
        outputs: every prompt's final output, in prompt order.
    """

    def __init__(self, failed: list[tuple[int, str, BaseException]],
                 outputs: list[RequestOutput]) -> None:
        index, request_id, error = failed[0]
        more = f" (and {len(failed) - 1} more)" if len(failed) > 1 else ""
        super().__init__(f"prompts[{index}] (request {request_id!r}) failed: "
                         f"{type(error).__name__}: {error}{more}")
        self.failed = failed
        self.outputs = outputs


@dataclass(frozen=True)
class StepStats:
    """What one engine step did: the per-step record that tutorials, tests,
    the profiler and the server's ``/metrics`` read (returned by
    :meth:`minivllm.engine.llm_engine.LLMEngine.step_with_stats`).

    Attributes:
        step: index of this step (0 for the engine's first step).
        num_scheduled_tokens: request id -> tokens computed for it this step.
        decode_req_ids: the scheduled requests that ran a decode: one token,
            plus its drafts with speculative decoding (every other scheduled
            request ran a prefill or recompute chunk).
        preempted_req_ids: requests preempted this step.
        finished_req_ids: requests that finished this step (stop, length or abort).
        num_running: requests holding KV blocks after the step.
        num_waiting: requests queued after the step.
        num_blocks: KV blocks in the pool.
        num_free_blocks: blocks free after the step (cached-but-unused count as free).
        num_prefix_cache_queries: prompt tokens looked up in the prefix cache
            (requests admitted this step).
        num_prefix_cache_hits: of those, tokens found cached.
        num_drafts / num_draft_tokens / num_accepted_tokens /
        num_accepted_tokens_per_pos: speculative decoding, vLLM's
            ``SpecDecodingStats``: requests that verified drafts this step,
            drafts verified, drafts accepted, and per draft position ``j``
            how many requests accepted draft ``j`` (all 0 / empty without it).
        step_seconds: the step's wall time, in the engine (``time.perf_counter``).
        forward_seconds: of it, the time spent sending the step to the executor
            and waiting for its logits: the model's forward (every rank's). The
            rest (``step_seconds - forward_seconds``) is host work: scheduling,
            preparing inputs, sampling, detokenizing (``bench latency``'s host ms).
    """

    step: int
    num_scheduled_tokens: dict[str, int]
    decode_req_ids: frozenset[str]
    preempted_req_ids: tuple[str, ...]
    finished_req_ids: tuple[str, ...]
    num_running: int
    num_waiting: int
    num_blocks: int
    num_free_blocks: int
    num_prefix_cache_queries: int = 0
    num_prefix_cache_hits: int = 0
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: tuple[int, ...] = ()
    step_seconds: float = 0.0
    forward_seconds: float = 0.0

    @classmethod
    def of(cls, step: int, so: Any, outputs: list[RequestOutput], spec: Any, scheduler: Any,
           num_blocks: int) -> StepStats:
        """The record of engine step ``step``: what ``so`` (a ``SchedulerOutput``; None:
        nothing was scheduled) ran, the outputs it made, its speculative decoding
        (``SpecStats``) and the ``scheduler``'s queues and pool after it."""
        return cls(
            step=step,
            num_scheduled_tokens={} if so is None else dict(so.num_scheduled_tokens),
            decode_req_ids=frozenset() if so is None else so.decode_req_ids,
            preempted_req_ids=() if so is None else tuple(so.preempted_req_ids),
            finished_req_ids=tuple(o.request_id for o in outputs if o.finished),
            num_running=len(scheduler.running),
            num_waiting=len(scheduler.waiting),
            num_blocks=num_blocks,
            num_free_blocks=scheduler.num_free_blocks,
            num_prefix_cache_queries=0 if so is None else so.num_prefix_cache_queries,
            num_prefix_cache_hits=0 if so is None else so.num_prefix_cache_hits,
            num_drafts=spec.num_drafts,
            num_draft_tokens=spec.num_draft_tokens,
            num_accepted_tokens=spec.num_accepted_tokens,
            num_accepted_tokens_per_pos=spec.num_accepted_tokens_per_pos,
        )

    @property
    def draft_acceptance_rate(self) -> float | None:
        """Accepted drafts / verified drafts (None if none were verified)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens \
            else None

    @property
    def mean_acceptance_length(self) -> float | None:
        """Tokens emitted per verified request: ``1 + accepted / drafts``, the extra
        (recovered or bonus) token counted, as vLLM reports it."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else None

    @property
    def num_batched_tokens(self) -> int:
        """Tokens computed this step, all requests together."""
        return sum(self.num_scheduled_tokens.values())

    @property
    def num_decode_tokens(self) -> int:
        """Tokens of the decodes (a decode verifying ``d`` drafts computes ``1 + d``)."""
        return sum(self.num_scheduled_tokens[r] for r in self.decode_req_ids)

    @property
    def kv_cache_usage(self) -> float:
        """Fraction of the KV pool held by requests, in [0, 1]."""
        return 1.0 - self.num_free_blocks / self.num_blocks
