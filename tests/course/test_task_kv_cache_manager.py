"""Course task: the KV cache manager (prefix hits on admission, slots, hashing new blocks)."""

from __future__ import annotations

import pytest
from sched_oracle import make_scheduler, request, run_traffic

from minivllm import backend
from minivllm.prefix_hash import hash_request_tokens


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
    sched = make_scheduler(4, 16, 4, 64, 32)
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
    sched = make_scheduler(4, 16, 4, 64, 32)
    sched.add_request(request("a", list(range(1, 9)), 1))
    _step(sched)
    sched.add_request(request("b", list(range(1, 9)), 1))
    out = sched.schedule()
    assert sched.requests["b"].num_cached_tokens == 4
    assert out.num_scheduled_tokens["b"] == 4, "the last block is recomputed for its logits"


def test_allocate_slots_refuses_without_side_effects():
    alloc = backend.get("block_allocator").BlockAllocator(3, 2, True)
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
    run_traffic(seed, caching=True)
