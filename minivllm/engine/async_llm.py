"""``AsyncLLM``: the online engine, stepping ``LLMEngine`` while requests keep arriving.

:class:`~minivllm.engine.llm_engine.LLMEngine` is a synchronous, single-threaded
object: ``add_request``, ``abort_request`` and ``step_with_stats`` must never run
at the same time. A server, on the other hand, receives requests at any moment
on an asyncio event loop. vLLM's ``AsyncLLM`` bridges the two; this is the same
design, readable in one file::

    event loop (HTTP handlers)              engine thread (one, owns LLMEngine)
    ------------------------------          ------------------------------------
    generate() -> add_request   ----------> engine.add_request(...)
    _run_loop: while work:
        step  ------------------------------> engine.abort_request(aborted)
                                              engine.step_with_stats()
        <------ outputs, StepStats ----------
        put each output in its request's asyncio.Queue
    generate() yields StreamDelta s from its queue

Every engine call goes through ONE single-thread executor, so they are
serialised without a lock, and the event loop never blocks on a model step.

- **Deltas.** Each output carries the text added since the last one. Text that
  may still turn into a stop string is held back (as the detokenizer does for
  the chat REPL), so concatenating the deltas gives exactly the final text.
- **Abort.** ``abort(request_id)`` (or a consumer that stops iterating, e.g. a
  client that hung up) queues the id; the next engine call frees its KV blocks,
  before any further step runs.
- **Failure.** If a step raises (a tensor-parallel worker died, a kernel
  failed), every waiting request receives :class:`EngineDeadError` and new
  requests are refused with it: nobody waits forever.
- **Back-pressure.** At most ``max_num_seqs + max_waiting_requests`` requests
  are in flight; one more raises :class:`QueueFullError` at once.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from minivllm.engine.llm_engine import EngineConfig, LLMEngine
from minivllm.outputs import Logprob, RequestOutput, StepStats
from minivllm.sampling_params import SamplingParams

logger = logging.getLogger("minivllm")


class EngineDeadError(RuntimeError):
    """The engine loop failed; no request can make progress any more."""


class QueueFullError(RuntimeError):
    """Too many requests are waiting; the caller should retry later (HTTP 503)."""


@dataclass
class StreamDelta:
    """What one engine step added to one request.

    Attributes:
        request_id: the request's id.
        text: text added since the previous delta (may be empty).
        token_ids: token ids sampled since the previous delta.
        logprobs: per new token, ``{token_id: Logprob}``; None unless requested.
        finished: True on the request's last delta.
        finish_reason: ``"stop"``, ``"length"`` or ``"abort"`` once finished.
        stop_reason: the stop string or token id that ended it, if any.
        output: the engine's cumulative :class:`RequestOutput` at this step.
    """

    request_id: str
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]] | None
    finished: bool
    finish_reason: str | None
    stop_reason: int | str | None
    output: RequestOutput

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.output.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Tokens generated so far, this delta included."""
        return len(self.output.outputs[0].token_ids)


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


#: A stat logger gets every step's :class:`StepStats` and :class:`IterationStats`.
StatLogger = Callable[[StepStats, IterationStats], None]


def held_back(text: str, stop: list[str]) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of a stop string.

    That tail must not be streamed yet: the next token may complete the stop
    string, and the engine then cuts it from the text.
    """
    longest = max((len(s) for s in stop), default=1) - 1
    for n in range(min(longest, len(text)), 0, -1):
        if any(s.startswith(text[-n:]) for s in stop):
            return n
    return 0


class RequestStream:
    """The async side of one request: its queue of outputs, and what was streamed."""

    def __init__(self, request_id: str, params: SamplingParams) -> None:
        self.request_id = request_id
        self.stop = params.stop_strings
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.arrival = time.monotonic()
        self.last_token_time: float | None = None
        self.num_text_sent = 0
        self.num_tokens_sent = 0

    def delta(self, out: RequestOutput) -> StreamDelta:
        """The part of ``out`` not yet streamed."""
        comp = out.outputs[0]
        end = len(comp.text) if out.finished else len(comp.text) - held_back(comp.text, self.stop)
        text = comp.text[self.num_text_sent:end]
        self.num_text_sent = max(self.num_text_sent, end)
        sent, now = self.num_tokens_sent, len(comp.token_ids)
        # token_ids is a copy per step, but the engine keeps appending to the
        # logprobs list it shares with every output: cut it at this step's length.
        logprobs = None if comp.logprobs is None else comp.logprobs[sent:now]
        new_ids = comp.token_ids[sent:now]
        self.num_tokens_sent = now
        return StreamDelta(out.request_id, text, new_ids, logprobs, out.finished,
                           comp.finish_reason, comp.stop_reason, out)


class AsyncLLM:
    """Serve many concurrent requests from one :class:`LLMEngine`.

    Args:
        engine: the engine to drive. From now on only this object may call it.
        max_waiting_requests: how many requests may wait beyond the
            ``max_num_seqs`` that can run; one more raises :class:`QueueFullError`.
        stat_loggers: callables given each step's :class:`StepStats` and
            :class:`IterationStats` (the server's Prometheus metrics are one).

    Use it from inside a running event loop::

        llm = AsyncLLM.from_config(EngineConfig(model="smollm2"))
        async for delta in llm.generate("Hello", SamplingParams(max_tokens=8)):
            print(delta.text, end="")
        await llm.shutdown()
    """

    def __init__(self, engine: LLMEngine, max_waiting_requests: int = 256,
                 stat_loggers: list[StatLogger] | None = None) -> None:
        if max_waiting_requests < 0:
            raise ValueError(f"max_waiting_requests must be >= 0, got {max_waiting_requests}")
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.scheduler_config.max_model_len
        self.max_requests = engine.config.max_num_seqs + max_waiting_requests
        self.stat_loggers = list(stat_loggers or [])
        self.last_stats: StepStats | None = None
        self.error: EngineDeadError | None = None
        # One thread, so every engine call is serialised (LLMEngine is not thread-safe).
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="minivllm-engine")
        self._streams: dict[str, RequestStream] = {}
        self._aborts: list[str] = []
        self._wake: asyncio.Event | None = None
        self._loop_task: asyncio.Task | None = None
        self._ids = itertools.count()

    @classmethod
    def from_config(cls, config: EngineConfig, **kwargs) -> AsyncLLM:
        """Build the :class:`LLMEngine` (loads the model), then wrap it."""
        return cls(LLMEngine(config), **kwargs)

    # -- the public API ---------------------------------------------------------

    @property
    def num_in_flight(self) -> int:
        """Requests added and not yet finished or aborted."""
        return len(self._streams)

    def encode(self, prompt: str) -> list[int]:
        """The prompt's token ids (the tokenizer is read-only, so any thread may call it)."""
        return self.tokenizer.encode(prompt)

    async def generate(self, prompt: str | list[int], sampling_params: SamplingParams,
                       request_id: str | None = None) -> AsyncIterator[StreamDelta]:
        """Add a request and yield a :class:`StreamDelta` per step that advanced it.

        Raises ``ValueError`` (bad prompt), :class:`QueueFullError` or
        :class:`EngineDeadError` before the first delta, and
        :class:`EngineDeadError` mid-stream if the engine fails. A consumer that
        stops iterating early aborts the request and frees its KV blocks.
        """
        stream = await self.add_request(prompt, sampling_params, request_id)
        async for delta in self.stream_outputs(stream):
            yield delta

    async def stream_outputs(self, stream: RequestStream) -> AsyncIterator[StreamDelta]:
        """Yield the deltas of a request added with :meth:`add_request` (see :meth:`generate`)."""
        finished = False
        try:
            while not finished:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield stream.delta(item)
        finally:
            if not finished:
                self._abort_soon(stream.request_id)

    async def add_request(self, prompt: str | list[int], sampling_params: SamplingParams,
                          request_id: str | None = None) -> RequestStream:
        """Queue a request in the engine; return the stream its outputs arrive on."""
        if self.error is not None:
            raise self.error
        if self.num_in_flight >= self.max_requests:
            raise QueueFullError(
                f"the server is full: {self.num_in_flight} requests in flight (at most "
                f"{self.max_requests}); retry later or raise --max-waiting-requests"
            )
        self._ensure_loop()
        request_id = f"req-{next(self._ids)}" if request_id is None else request_id
        if request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} is already in flight")
        text, ids = (prompt, self.encode(prompt)) if isinstance(prompt, str) else (None, prompt)
        stream = RequestStream(request_id, sampling_params)
        # Registered before the engine sees it, so the next step's output finds it.
        self._streams[request_id] = stream
        try:
            await self._call(self.engine.add_request, text, list(ids), sampling_params,
                             request_id)
        except BaseException:
            self._streams.pop(request_id, None)
            raise
        self._wake.set()
        return stream

    async def abort(self, request_id: str) -> None:
        """Stop a request and free its KV blocks; return once they are free."""
        self._abort_soon(request_id)
        ids, self._aborts = self._aborts, []  # lists move only on the event loop
        await self._call(self.engine.abort_request, ids)

    async def shutdown(self) -> None:
        """Stop the loop, fail what is still in flight, stop the engine's workers."""
        if self._loop_task is not None:
            self._loop_task.cancel()
            await asyncio.gather(self._loop_task, return_exceptions=True)
            self._loop_task = None
        self._fail_all(EngineDeadError("the engine was shut down"))
        await self._call(self.engine.shutdown)
        self._thread.shutdown(wait=True)

    # -- the loop ---------------------------------------------------------------

    async def _call(self, fn, *args):
        """Run ``fn(*args)`` on the engine thread, after every call queued before it."""
        return await asyncio.get_running_loop().run_in_executor(self._thread, fn, *args)

    def _ensure_loop(self) -> None:
        if self._loop_task is None:
            self._wake = asyncio.Event()
            self._loop_task = asyncio.get_running_loop().create_task(self._run_loop())

    def _abort_soon(self, request_id: str) -> None:
        """Forget the request now; the engine frees its blocks before its next step."""
        if self._streams.pop(request_id, None) is not None:
            self._aborts.append(request_id)
            if self._wake is not None:
                self._wake.set()

    def _step(self, aborts: list[str]) -> tuple[list[RequestOutput], StepStats]:
        """(engine thread) free aborted requests, then run one engine step."""
        if aborts:
            self.engine.abort_request(aborts)
        # With nothing left to run this is a cheap empty step whose StepStats
        # still report the pool (e.g. fully free right after a disconnect).
        return self.engine.step_with_stats()

    async def _run_loop(self) -> None:
        """Step while any request is in flight (or an abort is pending); else sleep."""
        while True:
            if not self._streams and not self._aborts:
                self._wake.clear()
                await self._wake.wait()
                continue
            aborts, self._aborts = self._aborts, []
            try:
                outputs, stats = await self._call(self._step, aborts)
            except Exception as e:
                logger.exception("minivllm: the engine loop failed")
                self._fail_all(EngineDeadError(f"the engine failed: {e}"))
                return
            self._dispatch(outputs, stats)

    def _dispatch(self, outputs: list[RequestOutput], stats: StepStats) -> None:
        """Hand each output to its request's queue; record timings for the loggers."""
        it = IterationStats(now=time.monotonic())
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue  # aborted while this step ran
            self._record(stream, out, it)
            stream.queue.put_nowait(out)
            if out.finished:
                del self._streams[out.request_id]
        self.last_stats = stats
        for log in self.stat_loggers:
            log(stats, it)

    @staticmethod
    def _record(stream: RequestStream, out: RequestOutput, it: IterationStats) -> None:
        if stream.last_token_time is None:
            it.time_to_first_tokens.append(it.now - stream.arrival)
            it.num_prompt_tokens += len(out.prompt_token_ids)
        else:
            it.inter_token_latencies.append(it.now - stream.last_token_time)
        stream.last_token_time = it.now
        it.num_generation_tokens += 1  # a step samples one token per request it reports
        if out.finished:
            it.finished.append((out.outputs[0].finish_reason or "abort", it.now - stream.arrival))

    def _fail_all(self, error: EngineDeadError) -> None:
        """Give every in-flight request ``error`` and refuse new ones with it."""
        self.error = error
        for stream in self._streams.values():
            stream.queue.put_nowait(error)
        self._streams.clear()
