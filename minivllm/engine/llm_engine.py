"""``LLMEngine``: one engine step = schedule -> run the model -> sample -> outputs.

The loop that ties every component together (:meth:`LLMEngine.step`)::

    so = scheduler.schedule()                        # who runs, how many tokens, new blocks
    step_input = StepInput.from_scheduler_output(so) # the flat batch + block-table changes
    pending = executor.execute_model(step_input)     # every rank: update its block table,
                                                     # build metadata, run the forward
    logits = pending.result()                        # (num_sampled, vocab), on rank 0
    structured.mask_logits(logits, reqs, drafts)     # constrained rows: -inf where forbidden
    rows = sampler.sample(logits, reqs, drafts)      # logits processors, then one token each
    finished = scheduler.update_from_output(so, ...) # append tokens, check stops, free blocks
    structured.advance(rows, ...)                    # grammars accept; terminated: "stop"
    outputs = output_processor.process(rows, ...)    # text, stop strings, RequestOutputs
    speculator.propose(running)                      # drafts for the next step (if any)

**One loop, any depth.** Up to ``executor.max_concurrent_batches`` scheduled steps may be in
flight (vLLM v1's batch queue). With one, the step above runs top to bottom: schedule, send, and
at once wait for its logits and finish it. With ``P`` pipeline stages, a step sends a new micro-
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
from minivllm.engine.sampling import StepSampler
from minivllm.engine.sequence_groups import SequenceGroups
from minivllm.engine.structured import StructuredOutputs
from minivllm.executor.abstract import PendingStep
from minivllm.executor.launcher import make_executor
from minivllm.executor.ranks import simulates_all_ranks
from minivllm.metadata import SchedulerOutput, StepInput
from minivllm.model.generation_config import load_generation_defaults
from minivllm.outputs import RequestOutput, StepStats
from minivllm.profiler import op_range
from minivllm.request import Request, RequestStatus
from minivllm.sampling_params import BeamSearchParams, SamplingParams
from minivllm.spec_decode.metadata import SpecStats
from minivllm.spec_decode.proposer import Speculator, make_proposer, num_lookahead_tokens

logger = logging.getLogger("minivllm")


@dataclass(frozen=True)
class _InFlight:
    """One step sent to the executor, waiting for its logits."""

    scheduler_output: SchedulerOutput
    sampling_reqs: tuple[Request, ...]  # the requests it samples, in logits order
    pending: PendingStep
    prompt_rows: tuple[tuple[str, int, int, int], ...]  # StepInput.prompt_logprob_rows


class LLMEngine:
    """The offline inference engine: add requests, then call :meth:`step` until done."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        # The swap layer's choice, resolved ONCE for this engine and passed down:
        # nothing below reads the process-global spec (see backend.Components).
        self.components = backend.Components.resolve(config.backend)
        spec = config.speculative_config
        if spec is not None:
            spec.check_placement(config.tensor_parallel_size,
                                 simulates_all_ranks(self.components))
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
                                    cdiv(max_model_len, config.block_size))
        self.scheduler_config = SchedulerConfig(
            max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=max_model_len,
            enable_chunked_prefill=config.enable_chunked_prefill,
            num_lookahead_tokens=num_lookahead_tokens(spec),
            policy=config.scheduling_policy,
        )
        self.cache_config = CacheConfig(config.block_size, num_blocks,
                                        config.enable_prefix_caching)
        self.scheduler = self.components.scheduler.Scheduler(
            self.scheduler_config, self.cache_config, components=self.components)
        self.sampler = StepSampler(self.components, self.vocab_size, device, config.seed,
                                   0 if spec is None else spec.num_speculative_tokens,
                                   config.logits_processors, config.max_num_seqs)
        self.speculator = None if spec is None else Speculator(
            spec, make_proposer(spec, self.components, self.executor), max_model_len)
        eos_token_id = self.tokenizer.eos_token_id if self.tokenizer is not None else None
        self.generation = load_generation_defaults(config.generation_config, config.model)
        self.input_processor = InputProcessor(self.tokenizer, self.vocab_size, max_model_len,
                                              eos_token_id, self.sampler, self.generation,
                                              config.max_logprobs)
        self.output_processor = OutputProcessor(self.tokenizer)
        # Constrained requests' grammars: compiled at add, masks before sampling.
        self.structured = StructuredOutputs(self.components.structured_output, self.tokenizer,
                                            self.vocab_size, self.eos_token_id,
                                            config.structured_outputs_compile_timeout_s)
        # Parallel sampling (n > 1) and beam search: requests that share blocks by fork.
        self.groups = SequenceGroups(self.scheduler, self.sampler, self.output_processor,
                                     self.input_processor)
        self.lora = LoRARequests(config.lora_config(), self.executor)
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
        request, state, generator = self.input_processor.process(
            prompt, prompt_token_ids, sampling_params, request_id, lora_request)
        request.priority = priority  # before it is queued: a priority queue orders by it
        grammar = self.structured.compile(sampling_params)  # ValueError naming the field
        self.scheduler.add_request(request)  # raises ValueError if it can never fit
        # Nothing below can fail: the request is now in the engine, whole.
        self.lora.hold_if_needed(request, self.scheduler)  # its adapter needs a free slot
        self.sampler.add_request(request, generator)
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
                self._forget(cid)
            self.groups.forget(request_id)
            raise
        self.lora.hold_if_needed(first, self.scheduler)
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
        if self.speculator is not None:
            raise ValueError("beam search does not run with speculative_config: "
                             "a beam ranks its candidates, it samples no drafts")
        if self.executor.max_concurrent_batches > 1:
            raise ValueError("beam search needs pipeline_parallel_size=1: a group's beams "
                             "rank together, one step at a time")
        first = self.groups.add_beam_search(
            prompt_token_ids, params, request_id, self.eos_token_id, self.config.block_size,
            self.cache_config.num_blocks, lora_request)
        try:
            self.scheduler.add_request(first)
        except BaseException:
            self.groups.forget(request_id)
            raise
        self.lora.hold_if_needed(first, self.scheduler)
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
        if self.lora.held:
            self.lora.abort(set(members))
        for rid in members:
            self._forget(rid)

    def _forget(self, request_id: str) -> None:
        self.output_processor.states.pop(request_id, None)
        self.sampler.remove_request(request_id)
        self.structured.forget(request_id)
        if self.speculator is not None:
            self.speculator.forget(request_id)

    def _fail(self, request: Request, error: Exception) -> RequestOutput:
        """End ``request`` alone after a failure of its own (its blocks are freed)."""
        output = self.output_processor.fail(request, error, self.scheduler)
        self._forget(request.request_id)
        return output

    def has_unfinished_requests(self) -> bool:
        """True while a request waits, runs, or has a step in flight."""
        return (bool(self.in_flight) or self.scheduler.has_unfinished_requests()
                or bool(self.lora.held))

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
            if self.lora.held:  # requests whose adapter waited for a slot
                self.lora.release(self.scheduler)
            with op_range("schedule"):
                in_flight = {r.request_id for item in self.in_flight
                             for r in item.scheduler_output.scheduled}
                so = (self.scheduler.schedule(in_flight=in_flight) if in_flight
                      else self.scheduler.schedule())
            # A step without tokens still carries block-table changes (aborts,
            # preemptions) that every worker's table must see before the next one.
            if not so.is_empty or so.removed_req_ids:
                outputs += self._send(so)
            elif self.groups and not self.in_flight and self.scheduler.waiting:
                self.groups.break_stall()  # idle beams that wait for a member step aside
        if self.in_flight and (len(self.in_flight) >= self.executor.max_concurrent_batches
                               or so is None or so.is_empty):
            more, spec_stats = self._finish_oldest(step)
            outputs += more
        if self.groups:  # the members' outputs become their groups' outputs
            outputs = self.groups.merge_outputs(outputs)
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
                    outputs.append(self._fail(live, e))
            rows, copies = self._block_changes(so)
            step_input = StepInput.from_scheduler_output(so, failed, rows, copies)
        sent = time.perf_counter()
        with op_range("forward"):
            pending = self.executor.execute_model(step_input)
        self._forward_s += time.perf_counter() - sent
        if step_input.num_tokens:  # else only block-table changes: nothing to sample
            sampling = tuple(live for live, r in zip(so.scheduled_requests, so.scheduled)
                             if r.samples and r.request_id not in failed)
            self.in_flight.append(_InFlight(so, sampling, pending,
                                            step_input.prompt_logprob_rows))
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

    def _finish_oldest(self, step: int) -> tuple[list[RequestOutput], SpecStats]:
        """Wait for the oldest step's logits; sample, update the scheduler, build outputs.

        Isolation: a failure that belongs to one request (sampling it,
        detokenizing it, matching its stop strings) ends that request alone
        with ``finish_reason="error"``; its blocks are freed and the step goes
        on for the others. Only the forward pass (every rank together) is
        fatal: it raises out of the step, and nothing in flight comes back.
        """
        item = self.in_flight[0]
        waited = time.perf_counter()
        try:
            with op_range("forward"):
                logits = item.pending.result()
            self._forward_s += time.perf_counter() - waited
        except BaseException:
            self.in_flight.clear()  # the pipeline is broken: nothing in it will come back
            raise
        self.in_flight.popleft()
        so, reqs = item.scheduler_output, list(item.sampling_reqs)
        if item.prompt_rows:  # prompt positions' rows: prompt logprobs, then out of the batch
            logits = self.output_processor.add_prompt_logprobs(
                item.prompt_rows, logits, {r.request_id: r for r in so.scheduled_requests},
                self.components.sampler.gather_logprobs)
        drafts = [so.scheduled_spec_decode_tokens.get(r.request_id, ()) for r in reqs]
        if self.groups:  # siblings sample from child 0's row; beams rank, not sample
            reqs, logits, drafts = self.groups.with_siblings(reqs, logits, drafts)
            reqs, logits, drafts = self.groups.take_beams(reqs, logits, drafts)
        with op_range("sample"):
            # Constrained rows: -inf where the grammar forbids (dead ends leave the batch).
            logits, reqs, drafts, dead = self.structured.mask_logits(logits, reqs, drafts)
            rows, failures, spec_stats = self.sampler.sample(logits, reqs, drafts)
        outputs = [self._fail(req, e) for req, e in dead + failures]
        if self.speculator is not None:  # each verification feeds the request's back-off
            for req, tokens, _ in rows:
                d = so.scheduled_spec_decode_tokens.get(req.request_id, ())
                if d:
                    self.speculator.record(req.request_id, len(tokens) - 1, len(d), step)
        num_before = {r.request_id: r.num_output_tokens for r, _, _ in rows}
        finished = self.scheduler.update_from_output(
            so, {r.request_id: tokens for r, tokens, _ in rows})
        finished_ids = {r.request_id for r in finished}
        if self.groups:  # siblings sampled their first token: now they fork child 0
            finished_ids |= self.groups.fork_siblings(rows)
        # What the scheduler kept: a stop inside an accepted run drops the rest.
        rows = [(r, r.output_token_ids[num_before[r.request_id]:], lp) for r, _, lp in rows]
        # The grammars take the kept tokens; a terminated one finishes its request ("stop").
        failed, stopped = self.structured.advance(rows, finished_ids, self.scheduler)
        outputs += [self._fail(req, e) for req, e in failed]
        finished_ids |= stopped
        with op_range("detokenize"):
            outputs += self.output_processor.process(rows, finished_ids, self.scheduler)
        # Finished, stopped by a stop string, or failed while detokenizing: forgotten.
        for rid in finished_ids | {o.request_id for o in outputs if o.finished}:
            self._forget(rid)
        if self.groups:  # a preempted beam takes its group along; full groups rank
            self.groups.requeue_preempted(so.preempted_req_ids)
            outputs += self.groups.step_beams(self.tokenizer)
        if self.speculator is not None:
            with op_range("propose"):
                # Constrained requests get no drafts (speculation is off for them).
                self.sampler.draft_probs = self.speculator.propose(
                    self.structured.unconstrained(self.scheduler.running), step + 1)
        return outputs, spec_stats

    def shutdown(self) -> None:
        """Stop every rank the executor runs, if any."""
        self.executor.shutdown()

