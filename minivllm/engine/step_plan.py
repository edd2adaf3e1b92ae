"""A step's sampling plan: what the sampling worker must do with the logits it computes.

The worker turns logits into tokens (:mod:`minivllm.worker.sampling`); the
engine, which holds the requests, the grammars and the groups, tells it what
to do in a :class:`~minivllm.step_sampling.SamplingPlan` sent with the step.
:class:`SamplingPlanner` builds it from the scheduler's output:

- the requests that sample, in logits-row order, with the drafts each verifies;
- what the worker has not heard yet: a request sampling for the first time
  (:class:`~minivllm.step_sampling.NewRequestData`), the outputs appended since
  it last sampled (by the sampler, a beam search's choice or a fork), and the
  requests the engine forgot;
- the features' shares: siblings of ``n > 1`` that sample from child 0's row,
  beams that rank instead of sampling (:mod:`.sequence_groups`), the grammar
  bitmask of the constrained rows (:mod:`.structured`), which requests may get
  drafts, and the prompt-logprob rows.

It is built when the step is sent: a request in flight is never scheduled
again before its tokens come back, so the grammars and the outputs it reads
are those the step's tokens continue.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from minivllm.metadata import SchedulerOutput, StepInput
from minivllm.request import Request
from minivllm.step_sampling import NewRequestData, SamplingPlan


@dataclass(frozen=True)
class PlannedStep:
    """A plan, and what the engine needs to read the step's output against it."""

    plan: SamplingPlan
    requests: dict[str, Request]  # every request the plan names, by id
    dead: list[tuple[Request, Exception]]  # not sampled: they end with this error


class SamplingPlanner:
    """Builds each step's :class:`~minivllm.step_sampling.SamplingPlan` (see the module
    docstring); keeps what the sampling worker has heard of each request.

    Args:
        groups: the engine's :class:`~minivllm.engine.sequence_groups.SequenceGroups`.
        structured: the engine's :class:`~minivllm.engine.structured.StructuredOutputs`.
    """

    def __init__(self, groups: Any, structured: Any) -> None:
        self.groups, self.structured = groups, structured
        self.seen: dict[str, int] = {}  # request id -> output tokens the worker has
        self.forgotten: list[str] = []  # forgotten since the last plan

    def forget(self, request_id: str) -> None:
        """The engine forgot ``request_id``: the worker hears it with the next plan."""
        if self.seen.pop(request_id, None) is not None:
            self.forgotten.append(request_id)

    def heard(self, rows: list[tuple[Request, list[int], Any]]) -> None:
        """The worker appended the tokens it emitted to its copies (``rows``: each
        sampled request and those tokens)."""
        for r, tokens, _ in rows:
            if r.request_id in self.seen:
                self.seen[r.request_id] += len(tokens)

    def plan(self, so: SchedulerOutput, step_input: StepInput, failed: set[str],
             num_running: int = 0) -> PlannedStep:
        """The plan of the step ``step_input`` lays out (``failed``: left out of it;
        ``num_running``: the scheduler's running requests)."""
        live = {r.request_id: r for r in so.scheduled_requests}
        scheduled = [r for r in so.scheduled if r.samples and r.request_id not in failed]
        sampling = [live[r.request_id] for r in scheduled]
        ranked = self.groups.ranked(sampling) if self.groups else []
        beams = {rid for rid, _, _ in ranked}
        fan_out = self.groups.fan_out(sampling) if self.groups else []
        sampled = [r for r in sampling if r.request_id not in beams] + [s for s, _ in fan_out]
        bitmask, bitmask_ids, dead = self.structured.bitmask(
            sampled + [r for r in sampling if r.request_id in beams])  # constrained beams
        skipped = frozenset(r.request_id for r, _ in dead)
        dead = [(r, e) for r, e in dead if r.request_id not in beams]  # a beam: no candidates
        prompt_k = {rid: live[rid].sampling_params.prompt_logprobs
                    for rid, *_ in step_input.prompt_logprob_rows}
        new, tails = [], []
        for r in [r for r in sampled if r.request_id not in skipped] \
                + [live[rid] for rid in prompt_k]:
            self._sync(r, new, tails)
        plan = SamplingPlan(
            req_ids=tuple(r.request_id for r in scheduled),
            drafts=tuple(tuple(r.spec_token_ids) for r in scheduled),
            new_requests=tuple(new), new_token_ids=tuple(tails),
            finished_req_ids=tuple(self.forgotten),
            fan_out=tuple((s.request_id, source) for s, source in fan_out),
            ranked=tuple(ranked), skipped=skipped,
            grammar_bitmask=bitmask, bitmask_req_ids=bitmask_ids,
            prompt_logprob_rows=step_input.prompt_logprob_rows, prompt_logprobs=prompt_k,
            no_drafts=frozenset(self.structured.constrained(sampled)), num_running=num_running)
        self.forgotten = []
        return PlannedStep(plan, {**live, **{s.request_id: s for s, _ in fan_out}}, dead)

    def _sync(self, r: Request, new: list[NewRequestData],
              tails: list[tuple[str, tuple[int, ...]]]) -> None:
        """What the worker lacks of ``r``: all of it, or the outputs since it last heard."""
        have = self.seen.get(r.request_id)
        if have is None:
            new.append(NewRequestData(r.request_id, tuple(r.prompt_token_ids),
                                      tuple(r.output_token_ids), r.sampling_params,
                                      r.eos_token_id, r.max_tokens))
        elif r.num_output_tokens > have:
            tails.append((r.request_id, tuple(r.output_token_ids[have:])))
        self.seen[r.request_id] = r.num_output_tokens
