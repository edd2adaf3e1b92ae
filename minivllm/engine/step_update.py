"""The output side of a step: the scheduler takes the worker's tokens, and outputs are built.

:meth:`~minivllm.engine.llm_engine.LLMEngine.step` is three calls, as vLLM v1's
``EngineCore.step``: the scheduler's ``schedule``, the executor's
``execute_model`` (the sampling worker returns token ids), and
:meth:`StepUpdater.update`, which hands a step's
:class:`~minivllm.step_sampling.ModelRunnerOutput` to whoever owns each part:

- the scheduler: the emitted tokens (``update_from_output``: append, stop
  rules, free blocks) and the next drafts (``update_draft_token_ids``);
- the features' output side: a grammar accepts the kept tokens and may end
  its request (:mod:`.structured`), siblings of ``n > 1`` fork their parent
  and beams rank (:mod:`.sequence_groups`);
- the output processor: prompt logprobs, detokenizing, stop strings, the
  ``RequestOutput`` objects; a group's members' outputs merged into one.

It also holds what a request leaving the engine touches (:meth:`forget`,
:meth:`fail`) and the one hook that still sits beside the scheduler: a beam
group that steps aside when nothing could be scheduled.
"""

from __future__ import annotations

from typing import Any

from minivllm.engine.step_plan import PlannedStep
from minivllm.metadata import SchedulerOutput
from minivllm.outputs import RequestOutput
from minivllm.profiler import op_range
from minivllm.request import Request
from minivllm.spec_decode.metadata import SpecStats, count_verified
from minivllm.step_sampling import ModelRunnerOutput


class StepUpdater:
    """A step's output side (see the module docstring).

    Args:
        scheduler: the engine's scheduler.
        output_processor: builds the ``RequestOutput`` objects.
        planner: the :class:`~minivllm.engine.step_plan.SamplingPlanner` (what
            the worker has heard of each request).
        groups: parallel sampling and beam search groups.
        structured: the constrained requests' grammars.
        tokenizer: detokenizes a beam search's finished sequences.
        num_speculative_tokens: ``k`` (the verification counts' length).
    """

    def __init__(self, scheduler: Any, output_processor: Any, planner: Any, groups: Any,
                 structured: Any, tokenizer: Any,
                 num_speculative_tokens: int) -> None:
        self.scheduler, self.output_processor, self.planner = scheduler, output_processor, planner
        self.groups, self.structured = groups, structured
        self.tokenizer = tokenizer
        self.num_speculative_tokens = num_speculative_tokens

    # -- requests that leave -------------------------------------------------------------

    def forget(self, request_id: str) -> None:
        """Drop what the engine keeps of a request that left (the worker hears it next step)."""
        self.output_processor.states.pop(request_id, None)
        self.planner.forget(request_id)
        self.structured.forget(request_id)

    def fail(self, request: Request, error: Exception) -> RequestOutput:
        """End ``request`` alone after a failure of its own (its blocks are freed)."""
        output = self.output_processor.fail(request, error, self.scheduler)
        self.forget(request.request_id)
        return output

    # -- around the scheduler ------------------------------------------------------------

    def when_idle(self, in_flight: bool) -> None:
        """Nothing could be scheduled: idle beams that wait for a member step aside."""
        if self.groups and not in_flight and self.scheduler.waiting:
            self.groups.break_stall()

    # -- the update ----------------------------------------------------------------------

    def update(self, so: SchedulerOutput, planned: PlannedStep, out: ModelRunnerOutput
               ) -> tuple[list[RequestOutput], SpecStats]:
        """Hand the step's tokens on; the outputs of the requests that made progress.

        Isolation: a failure that belongs to one request (sampling it, in the
        worker; its grammar; detokenizing it, its stop strings) ends that
        request alone with ``finish_reason="error"``; its blocks are freed and
        the step goes on for the others.
        """
        self.output_processor.add_prompt_logprobs(out.prompt_logprobs)
        if out.ranked:  # beams rank their candidates as a group
            self.groups.take_ranked(out.ranked)
        live = planned.requests
        rows = [(live[rid], list(tokens), lp) for rid, tokens, lp
                in zip(out.req_ids, out.sampled_token_ids, out.logprobs)]
        failures = planned.dead + [(live[rid], e) for rid, e in out.failures]
        outputs = [self.fail(req, e) for req, e in failures]
        drafts = [so.scheduled_spec_decode_tokens.get(r.request_id, ()) for r, _, _ in rows]
        spec_stats = count_verified(drafts, [t for _, t, _ in rows],
                                    self.num_speculative_tokens)
        num_before = {r.request_id: r.num_output_tokens for r, _, _ in rows}
        finished = self.scheduler.update_from_output(
            so, {r.request_id: tokens for r, tokens, _ in rows})
        finished_ids = {r.request_id for r in finished}
        self.planner.heard(rows)  # the worker's copies took the tokens it emitted
        if out.draft_token_ids:  # the next step's drafts, proposed in the worker
            self.scheduler.update_draft_token_ids(out.draft_token_ids)
        if self.groups:  # siblings sampled their first token: now they fork child 0
            finished_ids |= self.groups.fork_siblings(rows)
        # What the scheduler kept: a stop inside an accepted run drops the rest.
        rows = [(r, r.output_token_ids[num_before[r.request_id]:], lp) for r, _, lp in rows]
        # The grammars take the kept tokens; a terminated one finishes its request ("stop").
        failed, stopped = self.structured.advance(rows, finished_ids, self.scheduler)
        outputs += [self.fail(req, e) for req, e in failed]
        finished_ids |= stopped
        with op_range("detokenize"):
            outputs += self.output_processor.process(rows, finished_ids, self.scheduler)
        # Finished, stopped by a stop string, or failed while detokenizing: forgotten.
        for rid in finished_ids | {o.request_id for o in outputs if o.finished}:
            self.forget(rid)
        if self.groups:  # a preempted beam takes its group along; full groups rank
            self.groups.requeue_preempted(so.preempted_req_ids)
            outputs += self.groups.step_beams(self.tokenizer)
        return outputs, spec_stats

    def merge(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """The members' outputs become their groups' outputs (``n > 1``)."""
        return self.groups.merge_outputs(outputs) if self.groups else outputs
