"""``AsyncLLM``: the online engine, stepping ``LLMEngine`` while requests keep arriving.

:class:`~minivllm.engine.llm_engine.LLMEngine` is a synchronous, single-threaded
object: ``add_request``, ``abort_request`` and ``step_with_stats`` must never run
at the same time. A server, on the other hand, receives requests at any moment
on an asyncio event loop. vLLM's ``AsyncLLM`` bridges the two; this is the same
design, readable in one file::

    event loop(s) (HTTP handlers)               engine thread (the only one touching LLMEngine)
    -------------------------------             -----------------------------------------------
    add_requests() --("add", [...])--> inbox --> while True:
    abort()        --("abort", [...])-> inbox        apply every command in the inbox
                                                     if anything is unfinished:
    stream.put(delta) <--call_soon_threadsafe---         outputs, stats = engine.step_with_stats()
      (on the loop that added the request)               route each output to its stream
    generate() yields StreamDelta s from its stream  (sleep on the inbox when idle)

The engine thread steps back to back, as vLLM's ``EngineCore`` busy loop
does: it never waits for an event loop between steps, so serving adds no
hand-off to a step (which matters on a busy CPU, where every thread wake-up
may wait for a time slice). Commands and outputs cross between the threads
only through the inbox (a thread-safe queue) and ``call_soon_threadsafe`` on
the loop of whoever waits: each command's future and each request's stream
remembers its own loop, so one ``AsyncLLM`` serves from any event loop (two
``asyncio.run`` one after the other, or a loop per thread).

- **One add, many requests.** :meth:`AsyncLLM.add_requests` queues a whole
  batch (an HTTP request's prompts x ``n``) as one command, applied between two
  steps: all of them are scheduled together, and if one is refused none stays.
- **Deltas.** Every request asks the engine for ``RequestOutputKind.DELTA``
  outputs: each carries only the text, token ids and logprobs added since the
  last one (the detokenizer holds back text that may still become a stop
  string, so concatenating the deltas gives exactly the final text). A step
  costs O(new tokens) per request however long it has run, and a consumer
  that falls behind gets its unread deltas merged into one
  (:class:`RequestStream`), so its buffer holds one item, never one per step.
- **Abort.** ``abort(request_id)`` (or a consumer that stops iterating, e.g. a
  client that hung up) sends the id to the engine thread, which frees its KV
  blocks before its next step.
- **Failure.** A failure that belongs to one request (``finish_reason="error"``)
  reaches its consumer alone, as :class:`RequestError`. If a step raises (a
  rank died), every waiting request receives :class:`EngineDeadError`, new
  ones are refused with it, and ``failed_at`` says when (the server exits).
- **Structured outputs.** A request's constraint (a JSON schema, a regex...)
  is compiled on a thread of its own before the request is sent to the
  engine thread (:meth:`AsyncLLM.add_requests`), with the engine's time cap:
  a bad one is refused there, and a slow one stalls no stream. The engine's
  own compile, at add, is then a hit in the compiled-constraint cache.
- **Back-pressure.** At most ``max_num_seqs + max_waiting_requests`` requests
  are in flight; more raise :class:`QueueFullError` at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import ThreadPoolExecutor

from minivllm.engine.async_stream import (  # noqa: F401  (re-exported: the server imports them here)
    EngineDeadError,
    InvalidRequestError,
    IterationStats,
    QueueFullError,
    RequestError,
    RequestStream,
    StatLogger,
    StreamDelta,
)
from minivllm.engine.config import EngineConfig
from minivllm.engine.llm_engine import LLMEngine
from minivllm.outputs import CompletionOutput, RequestOutput, StepStats
from minivllm.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams

logger = logging.getLogger("minivllm")


class AsyncLLM:
    """Serve many concurrent requests from one :class:`LLMEngine`.

    Args:
        engine: the engine to drive. From now on only this object may call it.
        max_waiting_requests: how many requests may wait beyond the
            ``max_num_seqs`` that can run; more raise :class:`QueueFullError`.
        stat_loggers: callables given each step's :class:`StepStats` and
            :class:`IterationStats` on the engine thread (the server's
            Prometheus metrics are one).

    Use it from inside any running event loop::

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
        self.failed_at: float | None = None  # time.monotonic() when a step raised
        self._stopping: asyncio.Future | None = None
        # Caller side: the requests in flight (added, not yet finished or aborted).
        self._streams: dict[str, RequestStream] = {}
        self._ids = itertools.count()
        # Engine-thread side: where each running request's outputs go.
        self._routes: dict[str, list[RequestStream]] = {}  # one stream per completion
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._thread_lock = threading.Lock()
        # Compiles constraints off the event loop and off the engine thread.
        self._grammar_pool = ThreadPoolExecutor(1, thread_name_prefix="minivllm-grammar")

    @classmethod
    def from_config(cls, config: EngineConfig, **kwargs) -> AsyncLLM:
        """Build the :class:`LLMEngine` (loads the model), then wrap it."""
        return cls(LLMEngine(config), **kwargs)

    # -- the public API ---------------------------------------------------------

    @property
    def num_in_flight(self) -> int:
        """Completions added and not yet finished or aborted (a request of ``n``: ``n``)."""
        return len(self._streams)

    def encode(self, prompt: str) -> list[int]:
        """The prompt's token ids (the tokenizer is read-only, so any thread may call it)."""
        return self.tokenizer.encode(prompt)

    async def generate(self, prompt: str | list[int], sampling_params: SamplingParams,
                       request_id: str | None = None) -> AsyncIterator[StreamDelta]:
        """Add a request and yield a :class:`StreamDelta` per step that advanced it.

        Raises ``ValueError`` (bad prompt), :class:`QueueFullError` or
        :class:`EngineDeadError` before the first delta; mid-stream,
        :class:`RequestError` if this request failed on its own and
        :class:`EngineDeadError` if the engine failed. A consumer that
        stops iterating early aborts the request and frees its KV blocks (at
        once if it closes this generator, e.g. with ``contextlib.aclosing``).
        """
        stream = await self.add_request(prompt, sampling_params, request_id)
        async with contextlib.aclosing(self.stream_outputs(stream)) as deltas:
            async for delta in deltas:
                yield delta

    async def stream_outputs(self, stream: RequestStream) -> AsyncIterator[StreamDelta]:
        """Yield the deltas of a request added with :meth:`add_request` (see :meth:`generate`)."""
        finished = False
        try:
            while not finished:
                delta = await stream.get()
                finished = delta.finished
                yield delta
        finally:
            if not finished:
                self._abort_soon([stream.request_id])

    async def add_request(self, prompt: str | list[int], sampling_params: SamplingParams,
                          request_id: str | None = None) -> RequestStream:
        """Queue one request in the engine; return the stream its outputs arrive on."""
        try:
            return (await self.add_requests([(prompt, sampling_params, request_id)]))[0]
        except InvalidRequestError as e:
            raise ValueError(e.reason) from None

    async def add_requests(self, requests: Sequence[tuple]) -> list[RequestStream]:
        """Queue ``(prompt, params, request_id[, lora_request[, priority]])`` as one command.

        ``params``: a :class:`SamplingParams` (``n`` completions: ``n`` streams, in
        order) or a :class:`BeamSearchParams` (``beam_width`` streams, best first).

        The engine thread adds them all between two steps, so the next step can
        schedule all of them. All or nothing: if one is refused, the ones
        before it are taken out again before any step runs, and
        :class:`InvalidRequestError` (a ``ValueError``) names the refused one.
        """
        if self.error is not None:
            raise self.error
        asked = sum(r[1].beam_width if isinstance(r[1], BeamSearchParams) else r[1].n
                    for r in requests)  # each completion counts
        if self.num_in_flight + asked > self.max_requests:
            raise QueueFullError(
                f"the server is full: {self.num_in_flight} requests in flight and "
                f"{asked} more asked for (at most {self.max_requests}); "
                f"retry later or raise --max-waiting-requests"
            )
        loop = asyncio.get_running_loop()
        batch, streams, ids = [], [], set()
        for prompt, params, request_id, *extra in requests:
            lora, priority = (*extra, *(None, 0)[len(extra):])[:2]
            request_id = f"req-{next(self._ids)}" if request_id is None else request_id
            if request_id in self._engine_ids or request_id in ids:
                raise ValueError(f"request_id {request_id!r} is already in flight")
            ids.add(request_id)
            text, ids_ = (prompt, self.encode(prompt)) if isinstance(prompt, str) \
                else (None, list(prompt))
            if isinstance(params, SamplingParams) and params.output_kind != \
                    RequestOutputKind.DELTA:  # a copy: the caller's stays
                params = dataclasses.replace(params, output_kind=RequestOutputKind.DELTA)
            size = params.beam_width if isinstance(params, BeamSearchParams) else params.n
            group = [RequestStream(request_id, loop, i, size) for i in range(size)]
            batch.append((text, ids_, params, group, lora, priority))
            streams += group
        await self._compile_constraints(batch)
        self._ensure_thread()
        for s in streams:
            self._streams[s.key] = s
        try:
            await self._send("add", batch)
        except BaseException:
            # A refused request, or the caller was cancelled meanwhile: in that
            # case the engine may have queued them, so abort them to be sure.
            self._abort_soon(list(ids))
            raise
        return streams

    async def _compile_constraints(self, batch) -> None:
        """Compile each constrained request's constraint on the grammar thread (cached):
        :class:`InvalidRequestError` names a refused one, before anything is queued."""
        loop = asyncio.get_running_loop()
        for index, (_, _, params, *_) in enumerate(batch):
            if isinstance(params, SamplingParams) and params.structured_outputs is not None:
                try:
                    await loop.run_in_executor(self._grammar_pool,
                                               self.engine.structured.validate, params)
                except ValueError as e:
                    raise InvalidRequestError(str(e), index, len(batch)) from None

    @property
    def _engine_ids(self) -> set[str]:
        return {s.request_id for s in self._streams.values()}

    async def add_lora(self, lora_request) -> None:
        """Load a LoRA adapter on every rank (between two steps); ``ValueError`` if bad."""
        await self._send("lora", ("add", lora_request))

    async def remove_lora(self, lora_int_id: int) -> None:
        """Forget an adapter; ``ValueError`` while a request still uses it."""
        await self._send("lora", ("remove", lora_int_id))

    async def abort(self, request_id: str) -> None:
        """Stop a request (all its ``n`` completions) and free its KV blocks; return once
        they are free."""
        self._drop_streams([request_id])
        if self._thread is not None:
            await self._send("abort", [request_id])

    async def shutdown(self) -> None:
        """Stop the engine thread, fail what is in flight, stop the workers (once)."""
        if self._stopping is None:
            self._stopping = asyncio.ensure_future(self._shutdown())
        await self._stopping

    async def _shutdown(self) -> None:
        if self._thread is not None:
            self._inbox.put(("stop", None, None))
            await asyncio.to_thread(self._thread.join)
            self._thread = None
        if self.error is None:
            self.error = EngineDeadError("the engine was shut down")
        for stream in list(self._streams.values()):
            self._hand_over(stream, self.error)
        self._streams.clear()
        self._grammar_pool.shutdown(wait=False, cancel_futures=True)
        await asyncio.to_thread(self.engine.shutdown)

    # -- the two threads ----------------------------------------------------------

    def _ensure_thread(self) -> None:
        with self._thread_lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._engine_loop,
                                                name="minivllm-engine", daemon=True)
                self._thread.start()

    async def _send(self, kind: str, arg) -> None:
        """Send a command to the engine thread; wait until it is applied (or raises)."""
        done = asyncio.get_running_loop().create_future()
        self._inbox.put((kind, arg, done))
        await done

    def _drop_streams(self, request_ids: list[str]) -> None:
        ids = set(request_ids)
        for key in [k for k, s in self._streams.items() if s.request_id in ids]:
            del self._streams[key]

    def _abort_soon(self, request_ids: list[str]) -> None:
        """Forget requests now; the engine thread frees their blocks before its next step."""
        self._drop_streams(request_ids)
        if self._thread is not None:
            self._inbox.put(("abort", request_ids, None))

    def _hand_over(self, stream: RequestStream, item: StreamDelta | BaseException) -> bool:
        """(any thread) Deliver ``item`` on the stream's loop; False if that loop is gone."""
        try:
            stream.loop.call_soon_threadsafe(self._deliver, stream, item)
        except RuntimeError:  # the loop was closed: nobody will read this request
            return False
        return True

    def _deliver(self, stream: RequestStream, item: StreamDelta | BaseException) -> None:
        """(the stream's loop) Put ``item`` on the stream; forget a request that ended."""
        if isinstance(item, BaseException) or item.finished:
            if self._streams.get(stream.key) is stream:
                del self._streams[stream.key]
        stream.put(item)

    def _engine_loop(self) -> None:
        """(engine thread) Apply the commands, step while there is work, hand the outputs
        to their streams; sleep on the inbox when idle. Runs until ``"stop"``."""
        refresh = False  # an abort happened: step once, so the stats show the freed blocks
        while True:
            busy = self.error is None and (refresh or self.engine.has_unfinished_requests())
            commands = [] if busy else [self._inbox.get()]  # block only when idle
            while not self._inbox.empty():
                commands.append(self._inbox.get())
            for kind, arg, done in commands:
                if kind == "stop":
                    return
                refresh |= self._apply(kind, arg, done)
            if self.error is not None or not (refresh or self.engine.has_unfinished_requests()):
                continue
            refresh = False
            try:
                outputs, stats = self.engine.step_with_stats()
            except Exception as e:
                logger.exception("minivllm: the engine loop failed")
                self.error = EngineDeadError(f"the engine failed: {e}")
                self.failed_at = time.monotonic()
                for group in self._routes.values():
                    for stream in group:
                        self._hand_over(stream, self.error)
                self._routes.clear()
                continue
            refresh = self._dispatch(outputs, stats)

    def _apply(self, kind: str, arg, done) -> bool:
        """(engine thread) Run one command; report to its future. True after an abort."""
        exc: BaseException | None = None
        if kind == "add":
            exc = self.error or self._add(arg)
        elif kind == "abort" and self.error is None:
            self._abort(arg)
        elif kind == "lora":
            exc = self.error or self._lora(*arg)
        if done is not None:
            with contextlib.suppress(RuntimeError):  # its loop is gone: nobody waits
                done.get_loop().call_soon_threadsafe(_resolve, done, exc)
        return kind == "abort"

    def _add(self, batch) -> BaseException | None:
        """(engine thread) Add every request of ``batch``, or none of them."""
        added: list[str] = []
        for index, (text, ids, params, group, lora, priority) in enumerate(batch):
            request_id = group[0].request_id
            try:
                if isinstance(params, BeamSearchParams):
                    self.engine.add_beam_search(ids, params, request_id, lora)
                else:
                    self.engine.add_request(text, ids, params, request_id, lora, priority)
            except Exception as e:  # a refused request: the caller's error
                self.engine.abort_request(added)
                if not isinstance(e, ValueError):
                    return e
                return InvalidRequestError(str(e), index, len(batch))
            added.append(request_id)
        for _, _, _, group, *_ in batch:
            self._routes[group[0].request_id] = group
        return None

    def _lora(self, action: str, arg) -> BaseException | None:
        """(engine thread) Load or remove an adapter; the caller's error, if any."""
        try:
            if action == "add":
                self.engine.lora.check(arg)
            elif any(r.lora_request is not None and r.lora_request.lora_int_id == arg
                     for r in self.engine.scheduler.requests.values()):
                return ValueError(f"adapter {arg} is in use by a request; retry when it is done")
            elif not self.engine.lora.remove(arg):
                return ValueError(f"no adapter with lora_int_id {arg} is loaded")
        except Exception as e:  # noqa: BLE001 -- a bad adapter: the caller's error
            return e
        return None

    def _abort(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self._routes.pop(rid, None)
        self.engine.abort_request(request_ids)

    def _dispatch(self, outputs: list[RequestOutput], stats: StepStats) -> bool:
        """(engine thread) Hand each output to its stream; run the stat loggers.

        Returns True if a stream's loop was gone and its request was aborted.
        """
        self.last_stats = stats  # before any consumer can see this step's outputs
        it = IterationStats(now=time.monotonic())
        orphans = []
        for out in outputs:
            group = self._routes.get(out.request_id)
            if group is None:
                continue  # aborted while this step ran
            if out.finished:
                del self._routes[out.request_id]
            if out.error is not None:  # this request alone failed; it is already freed
                for stream in group:
                    self._hand_over(stream, RequestError.of(out))
                continue
            comps = list(out.outputs)
            if out.finished:  # a completion it did not report (a beam search that
                # found fewer sequences) ends empty, so no stream waits forever
                shown = {c.index for c in comps}
                comps += [CompletionOutput(i, "", [], None, None, "length")
                          for i, stream in enumerate(group)
                          if i not in shown and not stream.finished]
            for comp in comps:
                stream = group[comp.index]
                it.record(stream, out, comp)
                if not self._hand_over(stream, stream.delta(out, comp)) and not out.finished:
                    orphans.append(out.request_id)
        if orphans:
            self._abort(orphans)
        for log in self.stat_loggers:
            log(stats, it)
        return bool(orphans)


def _resolve(future: asyncio.Future, exc: BaseException | None) -> None:
    """(the future's loop) Finish a command's future, unless its caller gave up waiting."""
    if not future.done():
        if exc is None:
            future.set_result(None)
        else:
            future.set_exception(exc)
