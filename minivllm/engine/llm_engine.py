"""``LLMEngine``: one engine step = schedule -> execute -> update, as vLLM v1's ``EngineCore``.

The loop that ties every component together (:meth:`LLMEngine.step`)::

    so = scheduler.schedule()                        # who runs, how many tokens, new blocks
    step_input = StepInput.from_scheduler_output(so) # the flat batch + block-table changes,
    step_input.sampling = planner.plan(so, ...)      # + what the worker must sample
    pending = executor.execute_model(step_input)     # every rank: update its block table,
                                                     # build metadata, run the forward; the
                                                     # sampling worker samples (grammar
                                                     # bitmask, logits processors, sampler or
                                                     # rejection sampler) and proposes drafts
    output = pending.result()                        # ModelRunnerOutput: token ids, not logits
    outputs = updater.update(so, ..., output)        # the scheduler appends them (stop rules,
                                                     # free blocks) and takes the drafts;
                                                     # grammars, forks, beams; detokenized
                                                     # RequestOutputs

The step names no feature: each lives in the scheduler (admission, forks,
drafts), the worker (masks, sampling, verification, proposing: :mod:`.step_plan`
says what to do) or the output side (:mod:`.step_update`: n > 1 merging, beam
ranking, detokenizing).

**One loop, any depth.** Up to ``executor.max_concurrent_batches`` scheduled steps may be in
flight (vLLM v1's batch queue). With one, the step above runs top to bottom: schedule, send, and
at once wait for its tokens and finish it. With ``P`` pipeline stages, a step sends a new micro-
batch while fewer than ``P`` are in flight (the scheduler leaves the requests in flight out:
``schedule(in_flight=...)``), and finishes the oldest one when the queue is full or nothing new
could be sent, so every stage has work.

:class:`minivllm.LLM` drives this loop for offline batches; the server's
:class:`~minivllm.engine.async_llm.AsyncLLM` drives it one step at a time.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from minivllm import backend
from minivllm.config import CacheConfig, SchedulerConfig, cdiv
from minivllm.dtype import resolve_dtype
from minivllm.engine.config import (  # noqa: F401  (EngineConfig: re-exported, callers import it here)
    EngineConfig,
    max_model_len_for,
    num_kv_blocks,
    resolve_device,
)
from minivllm.engine.input_processor import InputProcessor
from minivllm.engine.lora_requests import LoRARequests
from minivllm.engine.output_processor import OutputProcessor
from minivllm.engine.sequence_groups import SequenceGroups
from minivllm.engine.step_plan import PlannedStep, SamplingPlanner
from minivllm.engine.step_update import StepUpdater
from minivllm.engine.structured import StructuredOutputs
from minivllm.executor.abstract import PendingStep
from minivllm.executor.launcher import make_executor
from minivllm.metadata import SchedulerOutput, StepInput
from minivllm.model.generation_config import load_generation_defaults
from minivllm.outputs import RequestOutput, StepStats
from minivllm.profiler import op_range
from minivllm.request import RequestStatus
from minivllm.sampling_params import BeamSearchParams, SamplingParams
from minivllm.spec_decode.metadata import SpecStats
from minivllm.spec_decode.proposer import num_lookahead_tokens

logger = logging.getLogger("minivllm")


@dataclass(frozen=True)
class _InFlight:
    """One step sent to the executor, waiting for its tokens."""

    scheduler_output: SchedulerOutput
    planned: PlannedStep  # what the sampling worker was told to do
    pending: PendingStep


class LLMEngine:
    """The offline inference engine: add requests, then call :meth:`step` until done."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        # The swap layer's choice, resolved ONCE for this engine and passed down:
        # nothing below reads the process-global spec (see backend.Components).
        self.components = backend.Components.resolve(config.backend)
        spec = config.speculative_config
        device = resolve_device(config.device)
        dtype = resolve_dtype(config.dtype, device)
        self.device, self.dtype = device, dtype
        self.executor = make_executor(config.worker_config(dtype, device), self.components,
                                      config.distributed_executor_backend)
        self.tokenizer = self.executor.tokenizer
        self.vocab_size = self.executor.hf_config.vocab_size
        max_model_len = max_model_len_for(config.max_model_len, self.executor.hf_config)
        block_bytes = self.executor.bytes_per_block(config.block_size)
        num_blocks = num_kv_blocks(config, block_bytes, device, max_model_len,
                                   num_lookahead_tokens(spec))  # ValueError if one can't fit
        # The KV cache, the block table and the model runner live on every rank.
        self.executor.init_kv_cache(num_blocks, config.block_size, config.max_num_seqs,
                                    cdiv(max_model_len, config.block_size), max_model_len)
        self.scheduler_config = SchedulerConfig(
            max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=max_model_len,
            enable_chunked_prefill=config.enable_chunked_prefill,
            num_lookahead_tokens=num_lookahead_tokens(spec),
            policy=config.scheduling_policy,
            max_loras=config.max_loras if config.enable_lora else None,
        )
        self.cache_config = CacheConfig(config.block_size, num_blocks,
                                        config.enable_prefix_caching)
        self.scheduler = self.components.scheduler.Scheduler(
            self.scheduler_config, self.cache_config, components=self.components)
        eos_token_id = self.tokenizer.eos_token_id if self.tokenizer is not None else None
        self.generation = load_generation_defaults(config.generation_config, config.model)
        self.input_processor = InputProcessor(self.tokenizer, self.vocab_size, max_model_len,
                                              eos_token_id, config.logits_processors,
                                              self.generation,
                                              config.max_logprobs)
        self.output_processor = OutputProcessor(self.tokenizer)
        # Constrained requests' grammars: compiled at add, masks before sampling.
        self.structured = StructuredOutputs(self.components.structured_output, self.tokenizer,
                                            self.vocab_size, self.eos_token_id,
                                            config.structured_outputs_compile_timeout_s)
        # Parallel sampling (n > 1) and beam search: requests that share blocks by fork.
        self.groups = SequenceGroups(self.scheduler, self.output_processor,
                                     self.input_processor, self.structured)
        self.planner = SamplingPlanner(self.groups, self.structured)
        if spec is not None and not hasattr(self.scheduler, "update_draft_token_ids"):
            raise ValueError("speculative_config needs a scheduler with "
                             f"update_draft_token_ids(); {type(self.scheduler).__module__} "
                             "has none")
        self.lora = LoRARequests(config.lora_config(), self.executor)
        self.updater = StepUpdater(self.scheduler, self.output_processor, self.planner,
                                   self.groups, self.structured, self.tokenizer,
                                   self.executor.config.num_speculative_tokens)
        self._rows_to_rebuild: set[str] = set()  # forked, not scheduled since
        self._forks = hasattr(self.scheduler, "take_block_changes")  # a student's may not
        self.in_flight: deque[_InFlight] = deque()
        self._ids = itertools.count()
        self._step_index = itertools.count()
        self._forward_s = 0.0  # this step's time in the executor (StepStats.forward_seconds)
        logger.info(
            "minivllm: %d KV blocks of %d tokens: at most %d tokens cached at once "
            "(kv_cache_dtype %s, %d bytes a token; max_model_len %d); backends %s; %s",
            num_blocks, config.block_size, num_blocks * config.block_size,
            config.kv_cache_dtype, block_bytes // config.block_size, max_model_len,
            self.components.describe(), self.generation.describe(),
        )

    @property
    def eos_token_id(self) -> int | None:
        """The EOS id new requests stop at (the tokenizer's; kept by the input processor)."""
        return self.input_processor.eos_token_id

    @eos_token_id.setter
    def eos_token_id(self, value: int | None) -> None:
        self.input_processor.eos_token_id = value

    # -- requests -------------------------------------------------------------

    def add_request(self, prompt: str | None, prompt_token_ids: list[int],
                    sampling_params: SamplingParams, request_id: str | None = None,
                    lora_request: Any = None, priority: int = 0) -> str:
        """Validate, build and queue one request; return its id. Atomic.

        ``priority`` (vLLM's): under ``scheduling_policy="priority"``, lower is
        served first; under ``"fcfs"`` it must be 0 (a ``ValueError`` otherwise).

        Everything is checked and built first (:mod:`.input_processor`); the
        scheduler's ``add_request`` is the last check (a request that can never
        fit). So on any error the request is nowhere: not in the scheduler,
        the sampler or the output processor.
        """
        request_id = self._new_id(request_id)
        self.lora.check(lora_request)  # a bad adapter: ValueError, for this request alone
        self.input_processor.check_priority(priority, self.scheduler_config.policy)
        if sampling_params.n > 1:
            return self._add_parallel(prompt, prompt_token_ids, sampling_params, request_id,
                                      lora_request, priority)
        request, state = self.input_processor.process(
            prompt, prompt_token_ids, sampling_params, request_id, lora_request)
        request.priority = priority  # before it is queued: a priority queue orders by it
        grammar = self.structured.compile(sampling_params)  # ValueError naming the field
        self.scheduler.add_request(request)  # raises ValueError if it can never fit
        # Nothing below can fail: the request is now in the engine, whole.
        self.output_processor.states[request_id] = state
        self.structured.add(request_id, grammar)
        return request_id

    def _new_id(self, request_id: str | None) -> str:
        request_id = str(next(self._ids)) if request_id is None else request_id
        if request_id in self.output_processor.states or self.groups.owns(request_id):
            raise ValueError(f"request_id {request_id!r} is already in the engine")
        return request_id

    def _check_group(self, size: int, field_name: str) -> None:
        """What every group needs: a scheduler that forks; a beam search, room to run whole
        (the children of ``n`` need not run together: one without room waits its turn)."""
        if not hasattr(self.scheduler, "fork_request"):
            raise ValueError(f"{field_name} > 1 needs a scheduler with fork_request(); "
                             f"{type(self.scheduler).__module__} has none")
        if field_name == "beam_width" and self.scheduler_config.policy == "priority":
            raise ValueError("beam search needs scheduling_policy='fcfs': its beams requeue "
                             "as one unit, in an order a priority queue would not keep")
        if field_name == "beam_width" and size > self.config.max_num_seqs:
            raise ValueError(f"{field_name}={size} must be <= max_num_seqs="
                             f"{self.config.max_num_seqs}: a group runs as one unit")

    def _add_parallel(self, prompt: str | None, prompt_token_ids: list[int],
                      sampling_params: SamplingParams, request_id: str,
                      lora_request: Any, priority: int = 0) -> str:
        """Parallel sampling: ``n`` children, child 0 queued (see :mod:`.sequence_groups`)."""
        self._check_group(sampling_params.n, "n")
        grammar = self.structured.compile(sampling_params)  # ValueError naming the field
        first = self.groups.add_parallel(
            prompt, prompt_token_ids, sampling_params, request_id, self.config.block_size,
            self.cache_config.num_blocks, self.scheduler_config.max_model_len, lora_request)
        for child in self.groups.parallel[first.request_id].children:
            child.priority = priority
        try:
            self.scheduler.add_request(first)
        except BaseException:
            for cid in self.groups.member_ids(request_id):
                self.updater.forget(cid)
            self.groups.forget(request_id)
            raise
        if grammar is not None:  # each child from the same start state, its own copy
            for i, cid in enumerate(self.groups.member_ids(request_id)):
                self.structured.add(cid, grammar if i == 0 else grammar.fork())
        return request_id

    def add_beam_search(self, prompt_token_ids: list[int], params: BeamSearchParams,
                        request_id: str | None = None, lora_request: Any = None) -> str:
        """Queue one prompt's beam search; its one output comes when it is over.

        The output (a :class:`~minivllm.outputs.RequestOutput`) has one
        completion per finished sequence, best first, whose
        ``cumulative_logprob`` is the length-penalised beam score. Every beam runs
        under ``lora_request`` (None: the base model).
        """
        if not isinstance(params, BeamSearchParams):
            raise TypeError(f"params must be a BeamSearchParams, got {type(params).__name__}")
        request_id = self._new_id(request_id)
        self._check_group(params.beam_width, "beam_width")
        self.lora.check(lora_request)
        first = self.groups.add_beam_search(
            prompt_token_ids, params, request_id, self.eos_token_id, self.config.block_size,
            self.cache_config.num_blocks, lora_request)
        try:
            grammar = self.structured.compile(first.sampling_params)  # ValueError: the field
            self.scheduler.add_request(first)
        except BaseException:
            self.groups.forget(request_id)
            raise
        self.structured.add(first.request_id, grammar)  # each beam forks its parent's
        return request_id

    def abort_request(self, request_ids: str | list[str]) -> None:
        """Stop requests now and free their KV blocks (a group's: all its members')."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        members = []
        for rid in ids:
            if self.groups.owns(rid):
                members += self.groups.member_ids(rid)
                self.groups.forget(rid)
            else:
                members.append(rid)
        self.scheduler.finish_requests(members, RequestStatus.FINISHED_ABORTED)
        for rid in members:
            self.updater.forget(rid)

    def has_unfinished_requests(self) -> bool:
        """True while a request waits, runs, or has a step in flight."""
        return bool(self.in_flight) or self.scheduler.has_unfinished_requests()

    # -- the step ---------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one engine step; return an output for every request that made progress."""
        return self.step_with_stats()[0]

    def step_with_stats(self) -> tuple[list[RequestOutput], StepStats]:
        """:meth:`step`, plus a :class:`~minivllm.outputs.StepStats` record of what it did.

        Sends a newly scheduled step while fewer than ``max_concurrent_batches``
        are in flight, and finishes the oldest one when the queue is full or
        nothing new was sent (see the module docstring).
        """
        step = next(self._step_index)
        start, self._forward_s = time.perf_counter(), 0.0
        outputs: list[RequestOutput] = []
        spec_stats = SpecStats()
        so = None
        if len(self.in_flight) < self.executor.max_concurrent_batches:
            with op_range("schedule"):
                in_flight = {r.request_id for item in self.in_flight
                             for r in item.scheduler_output.scheduled}
                so = (self.scheduler.schedule(in_flight=in_flight) if in_flight
                      else self.scheduler.schedule())
            # A step without tokens still carries block-table changes (aborts,
            # preemptions) that every worker's table must see before the next one.
            if not so.is_empty or so.removed_req_ids:
                outputs += self._send(so)  # execute: the workers run it, and sample
            else:
                self.updater.when_idle(bool(self.in_flight))
        if self.in_flight and (len(self.in_flight) >= self.executor.max_concurrent_batches
                               or so is None or so.is_empty):
            more, spec_stats = self._finish_oldest()  # update: the scheduler, the outputs
            outputs += more
        outputs = self.updater.merge(outputs)  # a group's members: one output
        stats = StepStats.of(step, so, outputs, spec_stats, self.scheduler,
                             self.cache_config.num_blocks)
        return outputs, dataclasses.replace(stats, step_seconds=time.perf_counter() - start,
                                            forward_seconds=self._forward_s)

    def _send(self, so: SchedulerOutput) -> list[RequestOutput]:
        """Build the step's batch and send it to the executor; outputs of requests that failed.

        A request whose tokens cannot be laid out (it does not have them) is
        failed alone and left out of the batch.
        """
        outputs = []
        with op_range("prepare_inputs"):
            failed = set()
            for live, r in zip(so.scheduled_requests, so.scheduled):
                try:
                    r.check_tokens()
                except Exception as e:  # noqa: BLE001 -- it belongs to this request alone
                    failed.add(r.request_id)
                    outputs.append(self.updater.fail(live, e))
            rows, copies = self._block_changes(so)
            step_input = StepInput.from_scheduler_output(so, failed, rows, copies)
            planned = self.planner.plan(so, step_input, failed, len(self.scheduler.running))
            step_input = dataclasses.replace(step_input, sampling=planned.plan)
        sent = time.perf_counter()
        with op_range("forward"):
            pending = self.executor.execute_model(step_input)
        self._forward_s += time.perf_counter() - sent
        if step_input.num_tokens:  # else only block-table changes: nothing to sample
            self.in_flight.append(_InFlight(so, planned, pending))
        return outputs

    def _block_changes(self, so: SchedulerOutput):
        """Forks since the last step: the copy-on-write copies, and the full block lists of
        the scheduled requests whose block-table row must be rebuilt."""
        if not self._forks:
            return None, ()
        copies, row_ids = self.scheduler.take_block_changes()
        self._rows_to_rebuild.update(row_ids)
        rows = {r.request_id: self.scheduler.get_block_ids(r.request_id)
                for r in so.scheduled if r.request_id in self._rows_to_rebuild}
        self._rows_to_rebuild.difference_update(rows)
        self._rows_to_rebuild.intersection_update(self.scheduler.requests)
        return rows, copies

    def _finish_oldest(self) -> tuple[list[RequestOutput], SpecStats]:
        """Wait for the oldest step's tokens, then :meth:`StepUpdater.update
        <minivllm.engine.step_update.StepUpdater.update>`.

        A failure that belongs to one request ends it alone (see there). Only
        the forward pass (every rank together) is fatal: it raises out of the
        step, and nothing in flight comes back.
        """
        item = self.in_flight[0]
        waited = time.perf_counter()
        try:
            with op_range("forward"):
                out = item.pending.result()
            self._forward_s += time.perf_counter() - waited
        except BaseException:
            self.in_flight.clear()  # the pipeline is broken: nothing in it will come back
            raise
        self.in_flight.popleft()
        return self.updater.update(item.scheduler_output, item.planned, out)

    def shutdown(self) -> None:
        """Stop every rank the executor runs, if any."""
        self.executor.shutdown()

