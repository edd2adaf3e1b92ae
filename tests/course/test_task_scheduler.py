"""Course task: the scheduler's rules, checked step by step without the ref (``sched_oracle``)."""

from __future__ import annotations

import pytest
from sched_oracle import make_scheduler, request, run_traffic


def test_no_admission_in_a_step_that_preempted():
    # block_size 2, a pool of 3 blocks, a budget of 3 tokens. Step 1: b's prompt (2
    # tokens, one block) and the first token of a's prompt (a second block). Step 2: b's
    # decode takes the last block, so a, the tail, cannot grow and preempts itself,
    # freeing its block. A chunk of a would fit in that block again, but a step that
    # preempted admits nobody (or the pool thrashes).
    sched = make_scheduler(2, 3, 4, 3, 12, caching=True)
    sched.add_request(request("b", [20, 21], 2))
    sched.add_request(request("a", [1, 2, 3], 1))
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"b": 2, "a": 1}
    sched.update_from_output(out, {"b": 7})
    out = sched.schedule()
    assert list(out.preempted_req_ids) == ["a"], "b's decode needs the last block: a is preempted"
    scheduled = [r.request_id for r in out.scheduled_requests]
    assert scheduled == ["b"], f"scheduled {scheduled} in a step that preempted a"
    assert [r.request_id for r in sched.waiting] == ["a"]


@pytest.mark.parametrize("seed", range(40))
def test_rules_hold_under_random_traffic(seed):
    run_traffic(seed, caching=seed % 4 != 0)


def test_the_traffic_reaches_the_rare_paths():
    """The seeds above must really preempt and hit the cache, or they prove little."""
    seen = [run_traffic(seed, caching=seed % 4 != 0) for seed in range(40)]
    assert sum(s.get("preemptions", 0) for s in seen) >= 10
    assert sum(s.get("prefix_hits", 0) for s in seen) >= 10


@pytest.mark.parametrize("seed", range(20))
def test_lora_slots_hold_under_random_traffic(seed):
    """Requests under three adapters or none, ``max_loras`` 1 or 2: the running requests
    never hold more adapters than that, and a waiting request is passed over only when
    its adapter has no slot (vLLM's rule; docs/course/05_scheduler.md)."""
    run_traffic(seed, caching=seed % 3 != 0, loras=True)


def test_lora_slots_keep_a_passed_over_request_first_in_line():
    # max_loras = 1, a budget of 3 tokens. a (adapter 1) runs; b (adapter 2) has no slot
    # and is passed over; c (no adapter) and d (adapter 1) behind it start, which spends
    # the budget, so e waits too, behind b. Once a, c and d finish, b starts first.
    sched = make_scheduler(4, 16, 8, 3, 32, max_loras=1)
    for rid, adapter in (("a", 1), ("b", 2), ("c", 0), ("d", 1), ("e", 3)):
        sched.add_request(request(rid, [ord(rid)], 1, adapter=adapter))
    out = sched.schedule()
    assert [r.request_id for r in out.scheduled_requests] == ["a", "c", "d"]
    assert [r.request_id for r in sched.waiting] == ["b", "e"], "b keeps its place in line"
    sched.update_from_output(out, {"a": 7, "c": 7, "d": 7})  # max_tokens 1: all finish
    out = sched.schedule()
    assert [r.request_id for r in out.scheduled_requests] == ["b"]
    assert [r.request_id for r in sched.waiting] == ["e"]


def test_the_lora_traffic_passes_requests_over():
    seen = [run_traffic(seed, caching=seed % 3 != 0, loras=True) for seed in range(20)]
    assert sum(s.get("lora_skips", 0) for s in seen) >= 10
