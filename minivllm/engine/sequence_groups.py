"""Requests that share KV blocks by fork: parallel sampling (``n > 1``) and beam search.

The PagedAttention paper's second promise: several sequences grown from one
prompt share its blocks, by reference count, and a block is copied only when
two of them would write into it (copy-on-write; ``KVCacheManager.fork`` and
``allocate_slots``, docs/sharing.md). The engine's step calls
:class:`SequenceGroups` at fixed points; every member is an ordinary
:class:`~minivllm.request.Request` to the scheduler and the workers.

**Parallel sampling** (:class:`ParallelSampling`). Child 0 prefills the
prompt alone. In the step that samples its first token, the ``n - 1`` other
children sample theirs from the same logits row, each with its own generator
(``seed + i``), and then fork child 0's blocks (``Scheduler.fork_request``):
the full prompt blocks are shared, the last partial block is copied when a
child first writes into it. From then on each child is a request of its own
(preempted alone, it recomputes alone). Its outputs are gathered into one
``RequestOutput`` of ``n`` completions with their ``index``.

**Beam search** (:class:`BeamSearch`), as transformers' ``generate(num_beams=W,
do_sample=False)``: each step every running beam gives the top ``2W`` of its
log-probabilities (nothing is sampled); once every beam of the group has, the
best ``2W`` candidates (beam score + token log-probability) are ranked; those
among the first ``W`` that end (EOS, or ``max_tokens``) become finished
hypotheses, scored ``cum_logprob / generated_tokens ** length_penalty``; the
best ``W`` others are the next beams. A beam chosen once continues as itself,
one chosen again forks (sharing its blocks, copy-on-write on the last one), a
beam not chosen is freed at once. The search stops when every candidate ends
or when no running beam can beat the worst of ``W`` finished hypotheses
(transformers' early-stop heuristic). A beam preempted by the scheduler
takes its whole group with it (``Scheduler.requeue``): the group recomputes
as one unit, and never holds blocks while it waits for a member.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from minivllm.config import cdiv
from minivllm.outputs import CompletionOutput, RequestOutput
from minivllm.request import Request, RequestStatus
from minivllm.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams


def child_id(request_id: str, index: int) -> str:
    """The scheduler's id of completion ``index`` of ``request_id`` (vLLM's form)."""
    return f"{index}_{request_id}"


def check_group_fits(num_sequences: int, prompt_len: int, max_tokens: int, block_size: int,
                     num_blocks: int, field_name: str) -> None:
    """Refuse a group that can never fit: ``n x (prompt + max_tokens)`` tokens of blocks.

    A member preempted alone recomputes without sharing, so only a pool that
    holds every member at full length unshared never thrashes.
    """
    need = num_sequences * cdiv(prompt_len + max_tokens, block_size)
    if need > num_blocks:
        raise ValueError(
            f"{field_name}={num_sequences} sequences of prompt ({prompt_len} tokens) + "
            f"max_tokens ({max_tokens}) need {need} KV blocks of {block_size}, but the whole "
            f"pool has num_blocks={num_blocks}; lower {field_name} or max_tokens")


@dataclass
class ParallelSampling:
    """One request of ``n`` completions (vLLM's ``ParentRequest``)."""

    request_id: str
    n: int
    output_kind: RequestOutputKind
    children: list[Request]  # child 0 is scheduled at once; the others fork from it
    forked: bool = False
    completions: dict[int, CompletionOutput] = field(default_factory=dict)
    done: set[int] = field(default_factory=set)
    error: BaseException | None = None
    prompt_logprobs: list | None = None  # child 0's, once whole
    prompt_logprobs_sent: bool = False

    def index(self, child_request_id: str) -> int:
        return int(child_request_id.split("_", 1)[0])


@dataclass
class _Beam:
    request: Request
    score: float  # the summed log-probabilities of its generated tokens


@dataclass
class BeamSearch:
    """One prompt's beam search (see the module docstring)."""

    request_id: str
    params: BeamSearchParams
    sampling_params: SamplingParams  # what every beam request carries
    prompt_token_ids: list[int]
    eos_token_id: int | None
    beams: list[_Beam]
    finished: list[tuple[float, float, list[int], str]] = field(default_factory=list)
    candidates: dict[str, tuple[list[float], list[int]]] = field(default_factory=dict)
    num_generated: int = 0
    improvable: bool = True  # transformers' "early stop heuristic unsatisfied"
    next_beam: int = 1

    def new_beam_id(self) -> str:
        self.next_beam += 1
        return f"{self.request_id}/beam{self.next_beam - 1}"


class SequenceGroups:
    """The engine's parallel-sampling groups and beam searches, by member request id.

    Args:
        scheduler: the engine's scheduler (forks, extensions, requeues go through it).
        output_processor: the engine's output processor (the members' states).
        input_processor: builds the members' requests, states and generators.
        structured: the engine's grammars: a constrained beam's child forks its
            parent's, and each accepts the token its beam took.
    """

    def __init__(self, scheduler: Any, output_processor: Any, input_processor: Any,
                 structured: Any = None) -> None:
        self.scheduler = scheduler
        self.structured = structured  # constrained beams' grammars (BeamSearchParams)
        self.output_processor = output_processor
        self.input_processor = input_processor
        self.parallel: dict[str, ParallelSampling] = {}  # by child id
        self.beams: dict[str, BeamSearch] = {}  # by beam id
        self.searches: dict[str, BeamSearch] = {}  # by request id

    def __bool__(self) -> bool:
        return bool(self.parallel or self.beams)

    def owns(self, request_id: str) -> bool:
        """Whether ``request_id`` is a group (user-facing id) this holds."""
        return any(g.request_id == request_id for g in self.parallel.values()) \
            or request_id in self.searches

    # -- adding ---------------------------------------------------------------------

    def add_parallel(self, prompt: str | None, prompt_token_ids: list[int],
                     params: SamplingParams, request_id: str, block_size: int,
                     num_blocks: int, max_model_len: int, lora_request: Any = None) -> Request:
        """Build the ``n`` children (checked, with their states); return child 0 to schedule."""
        max_tokens = params.max_tokens or max_model_len - len(prompt_token_ids)
        check_group_fits(params.n, len(prompt_token_ids), max_tokens, block_size, num_blocks, "n")
        kind = params.output_kind
        children, states = [], []
        for i in range(params.n):
            # seed + i, wrapped as torch wraps seeds (mod 2**64): one generator per child.
            seed = None if params.seed is None else (params.seed + i) % 2**64
            child_params = dataclasses.replace(params, n=1, seed=seed)
            request, state = self.input_processor.process(
                prompt, prompt_token_ids, child_params, child_id(request_id, i), lora_request)
            children.append(request)
            states.append(state)
        group = ParallelSampling(request_id, params.n, kind, children)
        for request, state in zip(children, states):
            self.output_processor.states[request.request_id] = state
            self.parallel[request.request_id] = group
        return children[0]

    def add_beam_search(self, prompt_token_ids: list[int], params: BeamSearchParams,
                        request_id: str, eos_token_id: int | None, block_size: int,
                        num_blocks: int, lora_request: Any = None) -> Request:
        """The first beam of a new search (the prompt); return it to schedule. Every beam
        runs under ``lora_request`` (its children inherit it when they branch)."""
        check_group_fits(params.beam_width, len(prompt_token_ids), params.max_tokens, block_size,
                         num_blocks, "beam_width")
        sp = SamplingParams(max_tokens=params.max_tokens, ignore_eos=True, temperature=0.0,
                            output_kind=RequestOutputKind.FINAL_ONLY,
                            structured_outputs=params.structured_outputs)
        self.input_processor.validate_prompt(prompt_token_ids, sp)
        search = BeamSearch(request_id, params, sp, list(prompt_token_ids),
                            None if params.ignore_eos else eos_token_id, beams=[])
        first = Request(f"{request_id}/beam0", prompt_token_ids, sp, eos_token_id,
                        lora_request=lora_request)
        search.beams.append(_Beam(first, 0.0))
        self.searches[request_id] = search
        self.beams[first.request_id] = search
        return first

    def member_ids(self, request_id: str) -> list[str]:
        """The scheduler ids of a group's live members (for an abort)."""
        if request_id in self.searches:
            return [b.request.request_id for b in self.searches[request_id].beams]
        for group in self.parallel.values():
            if group.request_id == request_id:
                return [c.request_id for c in group.children]
        return []

    def forget(self, request_id: str) -> None:
        """Drop a group (its members are aborted or finished)."""
        search = self.searches.pop(request_id, None)
        if search is not None:
            for beam_id in [k for k, v in self.beams.items() if v is search]:
                del self.beams[beam_id]
                self._grammars_take(beam_id, None, None)
        for cid in [k for k, g in self.parallel.items() if g.request_id == request_id]:
            del self.parallel[cid]

    # -- the step ---------------------------------------------------------------------

    def fan_out(self, reqs: list[Request]) -> list[tuple[Request, str]]:
        """Child 0 samples its first token this step: its siblings sample theirs from the
        same logits row. Returns ``(sibling, child 0's id)`` for each."""
        out = []
        for req in reqs:
            group = self.parallel.get(req.request_id)
            if group is not None and not group.forked and req is group.children[0]:
                group.forked = True
                out += [(sibling, req.request_id) for sibling in group.children[1:]]
        return out

    def fork_siblings(self, rows: list[tuple[Request, list[int], Any]]) -> set[str]:
        """After ``update_from_output``: the siblings sampled this step fork child 0's
        blocks and take their first token; the ids of those that finished at once."""
        finished = set()
        for request, tokens, _ in rows:
            group = self.parallel.get(request.request_id)
            if group is None or request is group.children[0] or request.num_output_tokens:
                continue
            parent = group.children[0]
            if not parent.is_finished() and self.scheduler.has_room():
                if self.scheduler.fork_request(parent, request, tokens):
                    finished.add(request.request_id)
                continue
            # Child 0 ended at its first token (no blocks to share), or no room to run
            # another request now: the sibling waits as a request of its own (prompt +
            # its first token), at the front of the queue, unless it ended too.
            if self.scheduler.add_continued(request, tokens):
                finished.add(request.request_id)
        return finished

    def ranked(self, reqs: list[Request]) -> list[tuple[str, int, float]]:
        """The beams among ``reqs``: ``(id, 2W, temperature)``; the sampling worker gives
        each its top ``2W`` log-probabilities instead of a token."""
        out = []
        for req in reqs:
            search = self.beams.get(req.request_id)
            if search is not None:
                out.append((req.request_id, 2 * search.params.beam_width,
                            search.params.temperature))
        return out

    def take_ranked(self, ranked: dict[str, tuple[list[float], list[int]]]) -> None:
        """Each beam keeps its candidates for its group's selection (a beam requeued since
        its step was scheduled recomputes, then ranks)."""
        for rid, candidates in ranked.items():
            search = self.beams.get(rid)
            if search is not None and search.beams and any(
                    b.request.request_id == rid and b.request.status == RequestStatus.RUNNING
                    for b in search.beams):
                search.candidates[rid] = candidates

    def requeue_preempted(self, preempted_req_ids) -> None:
        """A beam the scheduler preempted takes its group with it: every running beam
        goes back to the waiting queue, beside it, and the group recomputes."""
        for beam_id in preempted_req_ids:
            search = self.beams.get(beam_id)
            if search is not None:
                self._requeue(search, to_front=True)

    def break_stall(self) -> bool:
        """When nothing could be scheduled: a beam group partly running (its running beams
        idle, waiting for the others' ranks) steps aside to the back of the queue, so the
        group at the front can be admitted whole. True if any did."""
        stalled = False
        for search in list(self.searches.values()):
            states = {b.request.status == RequestStatus.RUNNING for b in search.beams}
            if states == {True, False}:
                self._requeue(search, to_front=False)
                stalled = True
        return stalled

    def _requeue(self, search: BeamSearch, to_front: bool,
                 new_requests: list[Request] = ()) -> None:
        running = [b.request.request_id for b in search.beams
                   if b.request.status == RequestStatus.RUNNING]
        self.scheduler.requeue(running, to_front=to_front, new_requests=new_requests)
        search.candidates.clear()

    def step_beams(self, tokenizer: Any) -> list[RequestOutput]:
        """Advance every search whose running beams all have their candidates."""
        outputs = []
        for search in list(self.searches.values()):
            live = [b.request.request_id for b in search.beams]
            if live and all(i in search.candidates for i in live):
                done = self._select(search)
                if done:
                    outputs.append(self._finish(search, tokenizer))
        return outputs

    def _select(self, search: BeamSearch) -> bool:
        """One step of the search (transformers' ``_beam_search``); True when it is over."""
        width, lp = search.params.beam_width, search.params.length_penalty
        ranked = []  # (summed log-prob, beam index, token)
        for b, beam in enumerate(search.beams):
            values, ids = search.candidates[beam.request.request_id]
            ranked += [(beam.score + v, b, t) for v, t in zip(values, ids)]
        ranked.sort(key=lambda c: (-c[0], c[1], c[2]))
        top = ranked[: 2 * width]
        search.candidates.clear()
        generated = search.num_generated + 1
        ends = [(t == search.eos_token_id, generated >= search.params.max_tokens)
                for _, _, t in top]
        if search.improvable:  # only the first W may join the finished ones
            for (score, b, t), (eos, length) in zip(top[:width], ends[:width]):
                if eos or length:
                    tokens = search.beams[b].request.output_token_ids + [t]
                    search.finished.append((score / generated ** lp, score, tokens,
                                            "stop" if eos else "length"))
            search.finished.sort(key=lambda h: -h[0])
            del search.finished[width:]
        running = [c for c, (eos, length) in zip(top, ends) if not (eos or length)][:width]
        search.num_generated = generated
        if len(search.finished) == width and running:
            best_possible = running[0][0] / generated ** lp
            search.improvable = best_possible > search.finished[-1][0]
        over = not running or not search.improvable
        self._branch(search, [] if over else running)
        return over

    def _branch(self, search: BeamSearch, running: list[tuple[float, int, int]]) -> None:
        """Make the next beams: a parent chosen once continues as itself, chosen again it
        forks (shared blocks), not chosen it is freed at once. Without room for the
        forks (``max_num_seqs``), the whole group goes back to the queue to recompute."""
        chosen: dict[int, list[tuple[float, int]]] = {}
        for score, b, t in running:
            chosen.setdefault(b, []).append((score, t))
        for b, beam in enumerate(search.beams):  # dropped beams free their blocks first
            if b not in chosen:
                self.scheduler.finish_requests([beam.request.request_id],
                                               RequestStatus.FINISHED_ABORTED)
                self.beams.pop(beam.request.request_id, None)
                self._grammars_take(beam.request.request_id, None, None)
        num_forks = sum(len(picks) - 1 for picks in chosen.values())
        fork = self.scheduler.has_room(num_forks)
        beams, children = [], []
        for b, beam in enumerate(search.beams):
            parent = beam.request
            picks = chosen.get(b, [])
            for score, t in picks[1:]:  # fork before the parent takes its own token
                child = parent.branch(search.new_beam_id(), [] if fork else [t])
                self.beams[child.request_id] = search
                self._grammars_take(parent.request_id, t, child.request_id)
                if fork:
                    self.scheduler.fork_request(parent, child, [t])
                else:
                    children.append(child)
                beams.append((score, b, _Beam(child, score)))
            if picks:
                self._grammars_take(parent.request_id, picks[0][1], parent.request_id)
                self.scheduler.extend_request(parent, [picks[0][1]])
                beams.append((picks[0][0], b, _Beam(parent, picks[0][0])))
        beams.sort(key=lambda x: (-x[0], x[1]))
        search.beams = [beam for _, _, beam in beams]
        if not fork:
            self._requeue(search, to_front=True, new_requests=children)

    def _grammars_take(self, beam_id: str, token: int | None, new_id: str | None) -> None:
        """A constrained beam's grammar: ``new_id`` (the beam itself, or a child) takes
        ``token`` from ``beam_id``'s state (a child from a fork of it); ``new_id`` None:
        the beam was dropped, its grammar goes."""
        grammars = {} if self.structured is None else self.structured.grammars
        grammar = grammars.get(beam_id)
        if grammar is None:
            return
        if new_id is None:
            self.structured.forget(beam_id)
            return
        if new_id != beam_id:
            grammar = grammar.fork()
            self.structured.add(new_id, grammar)
        if not grammar.accept_tokens([token]):  # the mask allowed it: never refused
            raise ValueError(f"structured_outputs: beam {new_id!r} took token {token} "
                             "that its grammar refuses")

    def _finish(self, search: BeamSearch, tokenizer: Any) -> RequestOutput:
        """The search's output: its finished sequences, best first (one completion each)."""
        self.forget(search.request_id)
        completions = [
            CompletionOutput(index=i, text=tokenizer.decode(tokens, skip_special_tokens=True)
                             if tokenizer is not None else "",
                             token_ids=tokens, cumulative_logprob=score, logprobs=None,
                             finish_reason=reason)
            for i, (_, score, tokens, reason) in enumerate(search.finished)]
        return RequestOutput(search.request_id, None, search.prompt_token_ids, completions,
                             finished=True)

    def merge_outputs(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """Turn the children's outputs into their groups' (``n`` completions, by index)."""
        merged: list[RequestOutput] = []
        by_group: dict[str, list[RequestOutput]] = {}
        groups: dict[str, ParallelSampling] = {}
        for out in outputs:
            group = self.parallel.get(out.request_id)
            if group is None:
                merged.append(out)
                continue
            by_group.setdefault(group.request_id, []).append(out)
            groups[group.request_id] = group
        for rid, outs in by_group.items():
            group = groups[rid]
            fresh = []
            for out in outs:
                i = group.index(out.request_id)
                comp = dataclasses.replace(out.outputs[0], index=i)
                group.completions[i] = comp
                fresh.append(comp)
                if out.finished:
                    group.done.add(i)
                if out.error is not None and group.error is None:
                    group.error = out.error
                if out.prompt_logprobs is not None:  # the prefill's (child 0, or a requeued one)
                    group.prompt_logprobs = out.prompt_logprobs
            finished = len(group.done) == group.n
            if group.output_kind == RequestOutputKind.DELTA:
                completions = sorted(fresh, key=lambda c: c.index)
            elif group.output_kind == RequestOutputKind.FINAL_ONLY and not finished:
                continue
            else:
                completions = [group.completions[i] for i in sorted(group.completions)]
            first = outs[0]
            prompt_logprobs = group.prompt_logprobs  # a delta stream gets them once
            if group.output_kind == RequestOutputKind.DELTA and group.prompt_logprobs_sent:
                prompt_logprobs = None
            group.prompt_logprobs_sent |= prompt_logprobs is not None
            merged.append(RequestOutput(rid, first.prompt, first.prompt_token_ids, completions,
                                        finished=finished,
                                        num_cached_tokens=first.num_cached_tokens,
                                        prompt_logprobs=prompt_logprobs,
                                        error=group.error if finished else None,
                                        lora_request=first.lora_request))
            if finished:
                self.forget(rid)
        return merged
