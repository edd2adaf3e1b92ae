"""What a request's stream of outputs is made of, on the server's side of the engine.

:class:`~minivllm.engine.async_llm.AsyncLLM` hands each request's outputs to
its consumer as :class:`StreamDelta` s through a :class:`RequestStream`, and
reports what went wrong with the errors below; the server turns those into
HTTP answers (a 400, a 503, an SSE error event).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from minivllm.outputs import CompletionOutput, Logprob, RequestOutput, StepStats


class EngineDeadError(RuntimeError):
    """The engine loop failed; no request can make progress any more."""


class QueueFullError(RuntimeError):
    """Too many requests are waiting; the caller should retry later (HTTP 503)."""


class RequestError(RuntimeError):
    """This request failed on its own (sampling, detokenizing it...) and was aborted.

    The engine keeps serving every other request; the engine's exception is
    the ``__cause__``.
    """

    @classmethod
    def of(cls, out: RequestOutput) -> RequestError:
        error = cls(f"request {out.request_id!r} failed and was aborted: "
                    f"{type(out.error).__name__}: {out.error}")
        error.__cause__ = out.error
        return error


class InvalidRequestError(ValueError):
    """One request of a batch was refused (so none of the batch was queued).

    Attributes:
        index: the position of the refused request in the batch.
        reason: the engine's message about it.
    """

    def __init__(self, reason: str, index: int, batch_size: int) -> None:
        where = f"request {index} of {batch_size}: " if batch_size > 1 else ""
        super().__init__(where + reason)
        self.index, self.reason = index, reason


@dataclass
class StreamDelta:
    """What one or more engine steps added to one request.

    Attributes:
        request_id: the request's id.
        text: text added since the previous delta (may be empty).
        token_ids: token ids sampled since the previous delta.
        logprobs: per new token, ``{token_id: Logprob}``; None unless requested.
        finished: True on the request's last delta.
        finish_reason: ``"stop"``, ``"length"`` or ``"abort"`` once finished.
        stop_reason: the stop string or token id that ended it, if any.
        num_prompt_tokens: the prompt's length in tokens.
        num_output_tokens: tokens generated so far, this delta's included.
        prompt_token_ids: the prompt (what ``echo`` repeats).
        prompt_logprobs: the prompt's logprob entries (``RequestOutput.prompt_logprobs``),
            on the delta that first carries them; None otherwise.
    """

    request_id: str
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]] | None
    finished: bool
    finish_reason: str | None
    stop_reason: int | str | None
    num_prompt_tokens: int
    num_output_tokens: int
    prompt_token_ids: list[int] = field(default_factory=list)
    prompt_logprobs: list | None = None


@dataclass
class IterationStats:
    """Per-step request timings for the stat loggers (seconds, ``time.monotonic``)."""

    now: float
    time_to_first_tokens: list[float] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    #: (finish_reason, end-to-end latency) of each request that finished this step.
    finished: list[tuple[str, float]] = field(default_factory=list)

    def record(self, stream: RequestStream, out: RequestOutput,
               comp: CompletionOutput) -> None:
        """Count one completion's new token of this step (and its end, if it ended)."""
        if stream.last_token_time is None:
            self.time_to_first_tokens.append(self.now - stream.arrival)
            if comp.index == 0:  # a group's prompt is computed once
                self.num_prompt_tokens += len(out.prompt_token_ids)
        else:
            self.inter_token_latencies.append(self.now - stream.last_token_time)
        stream.last_token_time = self.now
        self.num_generation_tokens += 1  # a step samples one token per request it reports
        if comp.finish_reason is not None or out.finished:
            self.finished.append((comp.finish_reason or "abort", self.now - stream.arrival))


#: A stat logger gets every step's :class:`StepStats` and :class:`IterationStats`
#: (called on the engine thread).
StatLogger = Callable[[StepStats, IterationStats], None]


class RequestStream:
    """One request in flight: where its deltas wait for their consumer.

    The engine thread hands each delta to the stream's own event loop
    (:meth:`put` runs there). A consumer that falls behind does not queue one
    delta per step: the deltas it has not read yet are merged into one, so
    the stream holds at most one pending item, whose size is the tokens not
    yet read (never more than ``max_tokens``), and a slow client costs the
    engine O(new tokens) per step however far behind it is.
    """

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop, index: int = 0,
                 group_size: int = 1) -> None:
        self.request_id = request_id  # the engine's id: a group's, for each of its n
        self.index = index  # which completion of the request this stream carries
        self.key = request_id if group_size == 1 else f"{request_id}[{index}]"
        self.loop = loop
        self.arrival = time.monotonic()
        # Engine-thread side: what was handed over, and when.
        self.last_token_time: float | None = None
        self.num_tokens_sent = 0
        self.finished = False  # its last delta was handed over
        # Event-loop side: the merged deltas not yet read, or the error to raise.
        self._pending: StreamDelta | BaseException | None = None
        self._pending_text: list[str] = []
        self._ready = asyncio.Event()

    def delta(self, out: RequestOutput, comp: CompletionOutput) -> StreamDelta:
        """(engine thread) Completion ``comp`` of the engine's DELTA output ``out``.

        The stream ends with its completion's finish reason, or with ``out``
        (a group's other completions may still run).
        """
        self.num_tokens_sent += len(comp.token_ids)
        finished = out.finished or comp.finish_reason is not None
        self.finished = finished
        return StreamDelta(out.request_id, comp.text, list(comp.token_ids), comp.logprobs,
                           finished, comp.finish_reason, comp.stop_reason,
                           len(out.prompt_token_ids), self.num_tokens_sent,
                           out.prompt_token_ids, out.prompt_logprobs)

    def put(self, item: StreamDelta | BaseException) -> None:
        """(its event loop) Add a delta, appended to any unread one, or an error."""
        if isinstance(self._pending, BaseException):
            return  # already failed: nothing after the error counts
        if isinstance(self._pending, StreamDelta) and isinstance(item, StreamDelta):
            self._pending_text.append(item.text)  # joined once, in get(): O(new) here
            self._pending.token_ids += item.token_ids
            if self._pending.logprobs is not None:
                self._pending.logprobs += item.logprobs or []
            self._pending.finished, self._pending.finish_reason = item.finished, \
                item.finish_reason
            self._pending.stop_reason = item.stop_reason
            self._pending.num_output_tokens = item.num_output_tokens
            if self._pending.prompt_logprobs is None:
                self._pending.prompt_logprobs = item.prompt_logprobs
        else:
            self._pending = item
            self._pending_text = [item.text] if isinstance(item, StreamDelta) else []
        self._ready.set()

    async def get(self) -> StreamDelta:
        """(its event loop) The next delta: every step's since the previous call, merged."""
        await self._ready.wait()
        self._ready.clear()
        item, self._pending = self._pending, None
        if isinstance(item, BaseException):
            self._pending = item  # every later call raises it too
            self._ready.set()
            raise item
        item.text = "".join(self._pending_text)
        return item
