"""Course task: the KV cache manager (prefix hits on admission, slots, hashing new blocks).

The manager under test runs inside the ref scheduler, on the ref block allocator
(``ref_scheduler_with_kv_manager``): this task does not depend on Tasks 1, 2 and 5.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from sched_oracle import make_scheduler, ref_scheduler_with_kv_manager, request, run_traffic

from minivllm import backend
from minivllm.prefix_hash import hash_request_tokens
from minivllm.ref.block_allocator import BlockAllocator as RefAllocator
from minivllm.testing.strategies import stateful_settings

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the scheduler machine
from test_scheduler import SchedulerMachine, check_pool  # noqa: E402


def _step(sched, token: int = 5):
    out = sched.schedule()
    sampled = {r.request_id: token for r in out.scheduled_requests
               if r.num_computed_tokens + out.num_scheduled_tokens[r.request_id] == r.num_tokens}
    sched.update_from_output(out, sampled)
    return out


def test_generated_block_is_cached_under_its_parent():
    # "a" generates a whole block of tokens [5, 5, 5, 5] after its prompt block. Its hash
    # must chain from the prompt block: a prompt that *starts* with [5, 5, 5, 5] has the
    # same tokens under another parent and must not hit it; a prompt with a's whole
    # history must hit both blocks.
    sched = make_scheduler(4, 16, 4, 64, 32, kv_manager_only=True)
    sched.add_request(request("a", [1, 2, 3, 4], 5))
    while "a" in sched.requests:
        _step(sched)
    sched.add_request(request("other_parent", [5, 5, 5, 5, 6], 1))
    sched.add_request(request("same_history", [1, 2, 3, 4, 5, 5, 5, 5, 6], 1))
    sched.schedule()
    assert sched.requests["other_parent"].num_cached_tokens == 0, (
        "a block of generated tokens was cached without its parent's hash: equal tokens "
        "under another parent hit it")
    assert sched.requests["same_history"].num_cached_tokens == 8, (
        "the generated block was not cached (or not under its chained hash)")


def test_a_full_hit_still_computes_the_last_token():
    sched = make_scheduler(4, 16, 4, 64, 32, kv_manager_only=True)
    sched.add_request(request("a", list(range(1, 9)), 1))
    _step(sched)
    sched.add_request(request("b", list(range(1, 9)), 1))
    out = sched.schedule()
    assert sched.requests["b"].num_cached_tokens == 4
    assert out.num_scheduled_tokens["b"] == 4, "the last block is recomputed for its logits"


def test_allocate_slots_refuses_without_side_effects():
    alloc = RefAllocator(3, 2, True)  # the ref pool: this task grades the manager alone
    kv = backend.get("kv_cache_manager").KVCacheManager(alloc)
    r = request("r", [1, 2, 3, 4, 5], 3)
    assert kv.get_computed_blocks(r) == ([], 0)
    assert kv.allocate_slots(r, 5) == [0, 1, 2]
    r.num_computed_tokens = 5
    assert kv.allocate_slots(r, 2) is None, "7 tokens need 4 blocks of 2; the pool has 3"
    assert kv.get_block_ids("r") == [0, 1, 2] and alloc.num_free_blocks == 0
    expected = hash_request_tokens(2, [1, 2, 3, 4, 5])
    assert [alloc.get_block_hash(b) for b in (0, 1)] == expected, "full blocks are cached"
    kv.free(r)
    assert alloc.get_free_block_ids() == [2, 1, 0], "freed last block first"


@pytest.mark.parametrize("seed", range(100, 112))
def test_prefix_hits_only_reuse_identical_prefixes(seed):
    run_traffic(seed, caching=True, kv_manager_only=True)


def test_prefix_hit_leaves_one_token_to_compute():
    sched = make_scheduler(4, 16, 4, 64, 32, kv_manager_only=True)
    prompt = list(range(1, 9))  # exactly two full blocks
    sched.add_request(request("first", prompt, 1))
    _step(sched)  # computes both blocks and caches them; then finishes
    sched.add_request(request("again", prompt, 1))
    sched.add_request(request("longer", prompt + [50], 1))
    out = sched.schedule()
    again, longer = sched.requests["again"], sched.requests["longer"]
    assert again.num_cached_tokens == 4 and out.num_scheduled_tokens["again"] == 4, (
        "a fully cached prompt recomputes its last block (to get logits)")
    assert longer.num_cached_tokens == 8 and out.num_scheduled_tokens["longer"] == 1
    shared = sched.get_block_ids("longer")[0]
    assert shared == sched.get_block_ids("again")[0]
    assert sched.block_allocator.ref_count(shared) == 2
    check_pool(sched, 16)


class KVManagerMachine(SchedulerMachine):
    """tests/test_scheduler.py's random traffic, against the ref, with only the KV manager
    under test (the ref scheduler and allocator around it)."""

    impl_class = staticmethod(ref_scheduler_with_kv_manager)


TestKVManagerMachine = KVManagerMachine.TestCase
TestKVManagerMachine.settings = stateful_settings(max_examples=200, step_count=50)
