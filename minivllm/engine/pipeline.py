"""The batch queue: up to ``pipeline_parallel_size`` micro-batches in flight (vLLM v1's
``step_with_batch_queue``).

With one stage, an engine step schedules a batch, runs it and samples from
it before the next one is scheduled. With ``P`` stages that would leave
``P - 1`` of them idle at any moment. So, as vLLM v1 does, the engine keeps
up to ``max_concurrent_batches = P`` scheduled batches in flight: each
:meth:`BatchQueue.step_with_stats` either

1. schedules a new batch and sends it into the pipeline without waiting
   (while fewer than ``P`` are in flight and the scheduler has something
   to run), or
2. waits for the *oldest* batch's logits, samples them and updates the
   scheduler (when the queue is full, or nothing new could be scheduled).

A request in flight is never scheduled again until its batch's output has
come back: its next token is not known yet, and its blocks are in use.
:func:`schedule_excluding` hides the in-flight requests from the scheduler
for the duration of one ``schedule()`` (they are neither scheduled nor
preempted, and still count against ``max_num_seqs``), so the scheduler
itself (a course component) needs no change.

Every rank handles the batches in the order they were sent (each link is
FIFO), so KV blocks written by batch ``n`` (a prefix-cache hit, a
request's earlier chunk) are in place before batch ``n + 1`` reads them.
"""

from __future__ import annotations

import copy
from collections import deque
from dataclasses import dataclass
from typing import Any

from minivllm.metadata import SchedulerOutput
from minivllm.model.llama import op_range
from minivllm.outputs import RequestOutput, StepStats


def schedule_excluding(scheduler: Any, in_flight: set[str]) -> SchedulerOutput:
    """``scheduler.schedule()`` as if the requests in ``in_flight`` were not running.

    They are taken out of ``scheduler.running`` for the call (so they are
    neither scheduled again nor preempted) and put back in their places
    afterwards; ``max_num_seqs`` is lowered by their number meanwhile, so
    admissions still respect it.
    """
    if not in_flight:
        return scheduler.schedule()
    running = list(scheduler.running)
    hidden = {id(r) for r in running if r.request_id in in_flight}
    config = scheduler.scheduler_config
    narrowed = copy.copy(config)  # no __post_init__: 0 rows free is a valid state here
    narrowed.max_num_seqs = config.max_num_seqs - len(hidden)
    scheduler.running = [r for r in running if id(r) not in hidden]
    scheduler.scheduler_config = narrowed
    try:
        return scheduler.schedule()
    finally:
        after = scheduler.running  # the visible ones, minus preempted, plus admitted
        kept = {id(r) for r in after}
        before = {id(r) for r in running}
        scheduler.running = ([r for r in running if id(r) in hidden or id(r) in kept]
                             + [r for r in after if id(r) not in before])
        scheduler.scheduler_config = config


@dataclass
class _InFlight:
    """One micro-batch sent into the pipeline, waiting for its logits."""

    scheduler_output: SchedulerOutput
    sampling_reqs: list
    pending: Any  # the executor's PendingStep


class BatchQueue:
    """The engine's micro-batches in flight; :meth:`step_with_stats` is one engine step.

    Args:
        engine: the :class:`~minivllm.engine.llm_engine.LLMEngine` it steps
            (its scheduler, runner, executor and output helpers).
    """

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.max_concurrent_batches = engine.executor.max_concurrent_batches
        self.queue: deque[_InFlight] = deque()

    @property
    def busy(self) -> bool:
        """Whether a micro-batch is still in flight."""
        return bool(self.queue)

    def in_flight_ids(self) -> set[str]:
        """The requests of every micro-batch in flight."""
        return {r.request_id for item in self.queue
                for r in item.scheduler_output.scheduled_requests}

    def step_with_stats(self) -> tuple[list[RequestOutput], StepStats]:
        """Schedule and send one batch, or finish the oldest (see the module docstring)."""
        try:
            return self._step()
        except BaseException:
            self.queue.clear()  # the pipeline is broken: nothing in it will come back
            raise

    def _step(self) -> tuple[list[RequestOutput], StepStats]:
        engine = self.engine
        outputs: list[RequestOutput] = []
        sent = None
        if len(self.queue) < self.max_concurrent_batches:
            with op_range("schedule"):
                scheduler_output = schedule_excluding(engine.scheduler, self.in_flight_ids())
            decode_ids = engine.decode_ids(scheduler_output)
            if not scheduler_output.is_empty or scheduler_output.removed_req_ids:
                sent = scheduler_output
                outputs += self._send(scheduler_output)
        else:
            scheduler_output, decode_ids = None, frozenset()
        if self.queue and (len(self.queue) >= self.max_concurrent_batches
                           or sent is None or sent.is_empty):
            outputs += self._finish_oldest()
        stats = engine.make_step_stats(scheduler_output, decode_ids, outputs)
        return outputs, stats

    def _send(self, scheduler_output: SchedulerOutput) -> list[RequestOutput]:
        """Build the batch and send it into the pipeline; outputs of requests that failed."""
        engine = self.engine
        outputs, step_input, sampling_reqs = engine.prepare_step(scheduler_output)
        with op_range("forward"):
            pending = engine.executor.execute_model(step_input, non_block=True)
        if pending.done:  # nothing to compute (only block-table changes): done already
            outputs += engine.finish_step(scheduler_output, sampling_reqs, pending.result())
        else:
            self.queue.append(_InFlight(scheduler_output, sampling_reqs, pending))
        return outputs

    def _finish_oldest(self) -> list[RequestOutput]:
        """Wait for the oldest batch's logits; sample, update the scheduler, detokenize."""
        item = self.queue[0]
        with op_range("forward"):
            logits = item.pending.result()
        self.queue.popleft()
        return self.engine.finish_step(item.scheduler_output, item.sampling_reqs, logits)
