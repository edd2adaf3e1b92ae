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
