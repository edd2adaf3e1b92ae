"""``scheduling_policy="priority"``: vLLM's rule, and the two scheduler twins agreeing.

vLLM's rule (``vllm/v1/core/sched``), written here as the oracle: waiting requests
are admitted in ``(priority, arrival_time)`` order, lower first (requests with
equal keys in the order they were queued); when the KV pool runs short, the
running request with the largest ``(priority, arrival_time)`` is preempted (it may
be one scheduled earlier in the same step, which is then taken back); a waiting
request never preempts a running one. Under ``"fcfs"`` a priority other than 0
is refused.

A hypothesis state machine drives the ref scheduler (a sorted list) and the fast
one (a heap) with the same random adds (random priorities, ties in arrival
time), aborts and steps on tiny pools, checks they make the same decisions and
holds every step to the oracle above.
"""

from __future__ import annotations

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from test_engine import greedy, make_llm, random_prompts

from minivllm import BeamSearchParams, SamplingParams, backend
from minivllm.config import CacheConfig, SchedulerConfig
from minivllm.fast import scheduler as fast_scheduler
from minivllm.ref import scheduler as ref_scheduler
from minivllm.request import Request, RequestStatus
from minivllm.testing.strategies import stateful_settings

EOS = 0


def _request(req_id: str, prompt: list[int], max_tokens: int, priority: int,
             arrival: float) -> Request:
    return Request(req_id, prompt, SamplingParams(max_tokens=max_tokens), eos_token_id=EOS,
                   arrival_time=arrival, priority=priority)


def _make(cls, scheduler_config, cache_config):
    with backend.use_backend("ref" if cls is ref_scheduler.Scheduler else "fast"):
        return cls(scheduler_config, cache_config)


def _key(r: Request) -> tuple:
    return r.priority, r.arrival_time


class PriorityMachine(RuleBasedStateMachine):
    """Random traffic on the ref and the fast scheduler under the priority policy."""

    @initialize(block_size=st.sampled_from([1, 2, 4]), extra_blocks=st.integers(0, 4),
                max_num_seqs=st.integers(1, 4), budget=st.integers(1, 12),
                max_model_len=st.integers(6, 24), caching=st.booleans())
    def make(self, block_size, extra_blocks, max_num_seqs, budget, max_model_len, caching):
        self.scheduler_config = SchedulerConfig(max_num_seqs=max_num_seqs,
                                                max_num_batched_tokens=budget,
                                                max_model_len=max_model_len, policy="priority")
        self.num_blocks = -(-max_model_len // block_size) + extra_blocks
        cache = CacheConfig(block_size, self.num_blocks, caching)
        self.ref = _make(ref_scheduler.Scheduler, self.scheduler_config, cache)
        self.fast = _make(fast_scheduler.Scheduler, self.scheduler_config, cache)
        self.clock = 0.0
        self.next_id = 0
        self.queued: dict[str, int] = {}  # request id -> the order it was (re)queued in
        self.num_queued = 0

    def _ready(self) -> bool:
        return hasattr(self, "ref")

    @precondition(_ready)
    @rule(priority=st.integers(-2, 3), length=st.integers(1, 14), max_tokens=st.integers(1, 8),
          same_time=st.booleans())
    def add(self, priority, length, max_tokens, same_time):
        if not same_time:  # else a tie in arrival_time: the queue order decides
            self.clock += 1.0
        rid = f"r{self.next_id}"
        self.next_id += 1
        prompt = [1 + (self.next_id * 7 + i) % 50 for i in range(length)]
        results = []
        for sched in (self.ref, self.fast):
            try:
                sched.add_request(_request(rid, prompt, max_tokens, priority, self.clock))
                results.append(None)
            except ValueError as e:
                results.append(str(e))
        assert results[0] == results[1]
        if results[0] is None:
            self.queued[rid] = self.num_queued
            self.num_queued += 1

    @precondition(lambda self: hasattr(self, "ref") and self.ref.requests)
    @rule(data=st.data())
    def abort(self, data):
        rid = data.draw(st.sampled_from(sorted(self.ref.requests)))
        for sched in (self.ref, self.fast):
            sched.finish_requests(rid, RequestStatus.FINISHED_ABORTED)

    @precondition(_ready)
    @rule(token=st.integers(1, 60))
    def step(self, token):
        waiting_before = list(self.ref.waiting)
        outs = [sched.schedule() for sched in (self.ref, self.fast)]
        summaries = [([r.request_id for r in o.scheduled_requests],
                      dict(o.num_scheduled_tokens), list(o.preempted_req_ids),
                      list(o.new_req_ids)) for o in outs]
        assert summaries[0] == summaries[1]
        out = outs[0]
        # The oracle: admitted in (priority, arrival, queue order) order, from the front.
        order = sorted(waiting_before, key=lambda r: (*_key(r), self.queued[r.request_id]))
        assert list(out.new_req_ids) == [r.request_id for r in order[:len(out.new_req_ids)]]
        if out.preempted_req_ids:
            assert not out.new_req_ids  # a step that preempts admits nobody
            victims = [self.ref.requests[rid] for rid in out.preempted_req_ids]
            for r in self.ref.running:  # every victim was the largest key when chosen
                assert _key(r) <= min(_key(v) for v in victims)
            for rid in out.preempted_req_ids:  # back in the queue, by key
                self.queued[rid] = self.num_queued
                self.num_queued += 1
        for sched, o in zip((self.ref, self.fast), outs):
            sampled = {r.request_id: token for r in o.scheduled_requests
                       if r.num_computed_tokens + o.num_scheduled_tokens[r.request_id]
                       == r.num_tokens}
            sched.update_from_output(o, sampled)

    @invariant()
    def same_queues(self):
        if not self._ready():
            return
        for attr in ("waiting", "running"):
            ids = [[r.request_id for r in getattr(s, attr)] for s in (self.ref, self.fast)]
            assert ids[0] == ids[1], attr
        keys = [(*_key(r), self.queued[r.request_id]) for r in self.ref.waiting]
        assert keys == sorted(keys)
        assert self.ref.num_free_blocks == self.fast.num_free_blocks

    def teardown(self):
        if not self._ready():
            return
        # Bounded by the work left: a budget of 1 token a step drains ~40 requests of up to
        # 14 + 8 tokens in more than 400 steps.
        for _ in range(400 + 50 * self.next_id):
            if not self.ref.has_unfinished_requests():
                break
            self.step(7)
        assert not self.ref.has_unfinished_requests() and not self.fast.has_unfinished_requests()
        assert self.fast.num_free_blocks == self.num_blocks


TestPriorityMachine = PriorityMachine.TestCase
TestPriorityMachine.settings = stateful_settings(max_examples=150, step_count=40)


@pytest.mark.parametrize("cls", [ref_scheduler.Scheduler, fast_scheduler.Scheduler])
def test_lower_priority_value_is_admitted_first_then_arrival(cls):
    sched = _make(cls, SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=64,
                                       max_model_len=32, policy="priority"),
                  CacheConfig(4, 32, False))
    for rid, prio, t in (("a", 2, 0.0), ("b", 0, 1.0), ("c", 1, 2.0), ("d", 0, 3.0)):
        sched.add_request(_request(rid, [1, 2, 3], 1, prio, t))
    order = []
    while sched.has_unfinished_requests():
        out = sched.schedule()
        order += out.new_req_ids
        sched.update_from_output(out, {r.request_id: 5 for r in out.scheduled_requests})
    assert order == ["b", "d", "c", "a"]


@pytest.mark.parametrize("cls", [ref_scheduler.Scheduler, fast_scheduler.Scheduler])
def test_the_largest_priority_value_is_preempted_even_if_scheduled_this_step(cls):
    """Three running decodes fill a 6-block pool: "low" (priority 5) was admitted first
    and is scheduled first, but when "mid" needs a block it is "low" that gives way (fcfs
    would preempt the tail, "high"); its scheduled token goes back to the budget."""
    config = SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=64, max_model_len=16,
                             policy="priority")
    sched = _make(cls, config, CacheConfig(2, 6, False))
    for rid, prio, t in (("low", 5, 0.0), ("mid", 1, 1.0), ("high", 0, 2.0)):
        sched.add_request(_request(rid, [1, 2, 3, 4], 8, prio, t))
    first = sched.schedule()  # admits the three, by priority: 2 blocks each, pool full
    assert list(first.new_req_ids) == ["high", "mid", "low"]
    sched.update_from_output(first, {r.request_id: 5 for r in first.scheduled_requests})
    sched.running.sort(key=lambda r: r.arrival_time)  # admission order "low" first
    out = sched.schedule()  # each decode needs a 3rd block; none free
    assert out.preempted_req_ids[0] == "low"
    assert "low" not in out.num_scheduled_tokens
    assert out.total_num_scheduled_tokens == sum(out.num_scheduled_tokens.values())
    assert sched.waiting[0].request_id == "low"


def test_fcfs_refuses_a_priority_and_priority_serves_by_it(tiny_model_dir):
    path = tiny_model_dir("llama")
    prompts = random_prompts(3, [5, 6, 7], seed=2)
    fcfs = make_llm(path)
    with pytest.raises(ValueError, match="priority must be 0 under scheduling_policy='fcfs'"):
        fcfs.generate([{"prompt_token_ids": p} for p in prompts], greedy(2),
                      priority=[0, 1, 0], use_tqdm=False)
    with pytest.raises(ValueError, match="priority must be a list of one int per prompt"):
        fcfs.generate([{"prompt_token_ids": p} for p in prompts], greedy(2), priority=[0],
                      use_tqdm=False)
    assert not fcfs.llm_engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="scheduling_policy must be one of"):
        make_llm(path, scheduling_policy="lifo")
    llm = make_llm(path, scheduling_policy="priority", max_num_seqs=1)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(3),
                        priority=[3, -1, 0], use_tqdm=False)
    plain = fcfs.generate([{"prompt_token_ids": p} for p in prompts], greedy(3), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    engine = llm.llm_engine
    ids = [engine.add_request(None, p, greedy(2), priority=prio)
           for p, prio in zip(prompts, (2, 0, 1))]
    first_output = []
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.request_id not in first_output:
                first_output.append(o.request_id)
    assert first_output == [ids[1], ids[2], ids[0]]
    with pytest.raises(ValueError, match="scheduling_policy='fcfs'"):
        llm.beam_search([{"prompt_token_ids": prompts[0]}],
                        BeamSearchParams(beam_width=2, max_tokens=2))
