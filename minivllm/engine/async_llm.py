"""``AsyncLLM``: the online engine, stepping ``LLMEngine`` while requests keep arriving.

:class:`~minivllm.engine.llm_engine.LLMEngine` is a synchronous, single-threaded
object: ``add_request``, ``abort_request`` and ``step_with_stats`` must never run
at the same time. A server, on the other hand, receives requests at any moment
on an asyncio event loop. vLLM's ``AsyncLLM`` bridges the two; this is the same
design, readable in one file::

    event loop (HTTP handlers)                 engine thread (the only one touching LLMEngine)
    -------------------------------            -----------------------------------------------
    add_request() --("add", ...)--> inbox ---> while True:
    abort()       --("abort", ...)-> inbox         apply every command in the inbox
                                                   if anything is unfinished:
    _dispatch(outputs, stats) <-------------------     outputs, stats = engine.step_with_stats()
      put each output in its request's queue       (sleep on the inbox when idle)
    generate() yields StreamDelta s from its queue

The engine thread steps back to back, as vLLM's ``EngineCore`` busy loop
does: it never waits for the event loop between steps, so serving adds no
hand-off to a step (which matters on a busy CPU, where every thread wake-up
may wait for a time slice). Commands and outputs cross between the threads
only through the inbox (a thread-safe queue) and ``call_soon_threadsafe``.

- **Deltas.** Each output carries the text added since the last one. Text that
  may still turn into a stop string is held back (as the detokenizer does for
  the chat REPL), so concatenating the deltas gives exactly the final text.
- **Abort.** ``abort(request_id)`` (or a consumer that stops iterating, e.g. a
  client that hung up) sends the id to the engine thread, which frees its KV
  blocks before its next step.
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
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
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
        # Event-loop side: the streams of the requests in flight.
        self._streams: dict[str, RequestStream] = {}
        self._ids = itertools.count()
        # Between the threads: commands in, outputs out through call_soon_threadsafe.
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

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
        self._ensure_thread()
        request_id = f"req-{next(self._ids)}" if request_id is None else request_id
        if request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} is already in flight")
        text, ids = (prompt, self.encode(prompt)) if isinstance(prompt, str) else (None, prompt)
        stream = RequestStream(request_id, sampling_params)
        # Registered before the engine sees it, so the next step's output finds it.
        self._streams[request_id] = stream
        try:
            await self._send("add", (text, list(ids), sampling_params, request_id))
        except BaseException:
            # A bad prompt (ValueError), or the caller was cancelled meanwhile: in
            # that case the engine may have queued it, so abort it to be sure.
            self._abort_soon(request_id)
            raise
        return stream

    async def abort(self, request_id: str) -> None:
        """Stop a request and free its KV blocks; return once they are free."""
        self._streams.pop(request_id, None)
        if self._thread is not None:
            await self._send("abort", [request_id])

    async def shutdown(self) -> None:
        """Stop the engine thread, fail what is still in flight, stop the engine's workers."""
        if self._thread is not None:
            self._inbox.put(("stop", None, None))
            await asyncio.to_thread(self._thread.join)
            self._thread = None
        if self.error is None:
            self._fail_all(EngineDeadError("the engine was shut down"))
        await asyncio.to_thread(self.engine.shutdown)

    # -- the two threads ----------------------------------------------------------

    def _ensure_thread(self) -> None:
        if self._thread is None:
            self._loop = asyncio.get_running_loop()
            self._thread = threading.Thread(target=self._engine_loop, name="minivllm-engine",
                                            daemon=True)
            self._thread.start()

    async def _send(self, kind: str, arg) -> None:
        """Send a command to the engine thread; wait until it is applied (or raises)."""
        done = self._loop.create_future()
        self._inbox.put((kind, arg, done))
        await done

    def _abort_soon(self, request_id: str) -> None:
        """Forget the request now; the engine thread frees its blocks before its next step."""
        self._streams.pop(request_id, None)
        if self._thread is not None:
            self._inbox.put(("abort", [request_id], None))

    def _engine_loop(self) -> None:
        """(engine thread) Apply the commands, step while there is work, hand the outputs
        to the event loop; sleep on the inbox when idle. Runs until ``"stop"``."""
        error: EngineDeadError | None = None
        refresh = False  # an abort happened: step once, so the stats show the freed blocks
        while True:
            busy = error is None and (refresh or self.engine.has_unfinished_requests())
            commands = [] if busy else [self._inbox.get()]  # block only when idle
            while not self._inbox.empty():
                commands.append(self._inbox.get())
            for kind, arg, done in commands:
                if kind == "stop":
                    return
                refresh |= self._apply(kind, arg, done, error)
            if error is not None or not (refresh or self.engine.has_unfinished_requests()):
                continue
            refresh = False
            try:
                outputs, stats = self.engine.step_with_stats()
            except Exception as e:
                logger.exception("minivllm: the engine loop failed")
                error = EngineDeadError(f"the engine failed: {e}")
                self._loop.call_soon_threadsafe(self._fail_all, error)
                continue
            self._loop.call_soon_threadsafe(self._dispatch, outputs, stats)

    def _apply(self, kind: str, arg, done, error: EngineDeadError | None) -> bool:
        """(engine thread) Run one command; report to its future. True after an abort."""
        exc: BaseException | None = error if kind == "add" else None
        try:
            if kind == "add" and error is None:
                self.engine.add_request(*arg)
            elif kind == "abort" and error is None:
                self.engine.abort_request(arg)
        except Exception as e:  # a bad prompt: ValueError for the caller
            exc = e
        if done is not None:
            self._loop.call_soon_threadsafe(_resolve, done, exc)
        return kind == "abort"

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


def _resolve(future: asyncio.Future, exc: BaseException | None) -> None:
    """(event loop) Finish a command's future, unless its caller gave up waiting."""
    if not future.done():
        if exc is None:
            future.set_result(None)
        else:
            future.set_exception(exc)
