"""The KV cache manager under test (``backend.get("kv_cache_manager")``), directly.

Fixed vectors pin the token -> block rules (blocks appear exactly when a token
needs one, full blocks are cached under their chained hash, a prefix hit
always leaves a token to compute, a refusal changes nothing). Preemption
keeps the request's block hashes (``Request.block_hashes``, as in vLLM v1):
re-admitted, it finds its old blocks without hashing its tokens again. A
hypothesis test runs the twin in lockstep with the ref.
"""

from __future__ import annotations

import sys

from hypothesis import given
from hypothesis import strategies as st

from minivllm import SamplingParams, backend
from minivllm.prefix_hash import hash_request_tokens
from minivllm.ref import kv_cache_manager as ref_kv_cache_manager
from minivllm.ref.block_allocator import BlockAllocator as RefAllocator
from minivllm.request import Request, RequestStatus

BS = 4


def _manager(num_blocks: int, caching: bool = True):
    # The ref allocator: these tests grade the manager alone (course task 4), not Task 1's pool.
    alloc = RefAllocator(num_blocks, BS, caching)
    return backend.get("kv_cache_manager").KVCacheManager(alloc), alloc


def _request(req_id: str, prompt: list[int]) -> Request:
    return Request(req_id, prompt, SamplingParams(max_tokens=20))


def _compute(request: Request, n: int) -> None:
    """What the scheduler does after a step: those tokens are now in the cache."""
    request.num_computed_tokens += n


def test_blocks_appear_when_a_token_needs_one() -> None:
    kv, alloc = _manager(8)
    r = _request("r", [11, 12, 13, 14, 15])  # 5 tokens: 2 blocks of 4
    assert kv.get_computed_blocks(r) == ([], 0)
    first = kv.allocate_slots(r, 5)
    assert len(first) == 2 and kv.get_block_ids("r") == first
    _compute(r, 5)
    # Decodes of positions 5, 6, 7 fit in the second block: nothing new.
    for token in (16, 17, 18):
        r.append_output_token_ids(token)
        assert kv.allocate_slots(r, 1) == []
        _compute(r, 1)
    r.append_output_token_ids(19)  # position 8: a third block
    third = kv.allocate_slots(r, 1)
    assert len(third) == 1 and kv.get_block_ids("r") == first + third
    assert alloc.num_free_blocks == 5
    # Both full blocks (positions 0..7) are cached under the chain of their tokens.
    hashes = hash_request_tokens(BS, r.all_token_ids[:8])
    assert [alloc.get_block_hash(b) for b in first] == hashes
    assert alloc.get_block_hash(third[0]) is None  # not full yet
    assert r.block_hashes == hashes


def test_prefix_hit_leaves_a_token_to_compute() -> None:
    kv, alloc = _manager(8)
    a = _request("a", list(range(1, 9)) + [50])  # 2 full blocks + 1 token
    blocks_a = kv.allocate_slots(a, 9)
    _compute(a, 9)
    a.status = RequestStatus.FINISHED_STOPPED
    kv.free(a)
    assert kv.get_block_ids("a") == [] and alloc.num_free_blocks == 8
    # Same 8-token prompt: both blocks are cached, but the last token must run.
    b = _request("b", list(range(1, 9)))
    assert kv.get_computed_blocks(b) == (blocks_a[:1], 4)
    # One more token: the whole 2-block prefix hits.
    c = _request("c", list(range(1, 9)) + [60])
    hits, num_hit_tokens = kv.get_computed_blocks(c)
    assert (hits, num_hit_tokens) == (blocks_a[:2], 8)
    new = kv.allocate_slots(c, 1, hits)
    assert kv.get_block_ids("c") == blocks_a[:2] + new and len(new) == 1
    assert [alloc.ref_count(blk) for blk in blocks_a[:2]] == [1, 1]


def test_refusal_changes_nothing() -> None:
    kv, alloc = _manager(2)
    a = _request("a", list(range(1, 9)))
    kv.allocate_slots(a, 8)  # the whole pool
    _compute(a, 8)
    b = _request("b", [1, 2, 3, 4, 9, 9])
    hits, num_hit = kv.get_computed_blocks(b)
    assert (hits, num_hit) == (kv.get_block_ids("a")[:1], 4)  # shares a's first block
    free_before = alloc.get_free_block_ids()
    assert kv.allocate_slots(b, 2, hits) is None  # its second block: none free
    assert alloc.get_free_block_ids() == free_before and kv.get_block_ids("b") == []
    assert [alloc.ref_count(blk) for blk in kv.get_block_ids("a")] == [1, 1]  # hit not taken


def test_preemption_keeps_the_block_hashes(monkeypatch) -> None:
    kv, alloc = _manager(6)
    r = _request("r", list(range(1, 11)))  # 2 full blocks + 2 tokens
    kv.allocate_slots(r, 10)
    _compute(r, 10)
    blocks = kv.get_block_ids("r")
    hashes = list(r.block_hashes)
    assert hashes == hash_request_tokens(BS, r.all_token_ids)
    # Preempted as the scheduler does it: blocks freed, progress reset.
    r.status, r.num_computed_tokens = RequestStatus.PREEMPTED, 0
    kv.free(r)
    assert kv.get_block_ids("r") == [] and alloc.num_free_blocks == 6
    assert r.block_hashes == hashes, "a preempted request keeps its hashes"

    # Re-admitted: its cached blocks are found again, and nothing is re-hashed.
    def no_rehash(*args, **kwargs):
        raise AssertionError("a preempted request's prompt was hashed again")

    # Wherever the implementation hashes: the ref's module, or its own (a course package).
    for module in {ref_kv_cache_manager, sys.modules[type(kv).__module__]}:
        if hasattr(module, "hash_block_tokens"):
            monkeypatch.setattr(module, "hash_block_tokens", no_rehash)
    assert kv.get_computed_blocks(r) == (blocks[:2], 8)
    # Finished, the request goes away, and with it its hashes; the manager keeps nothing,
    # under whatever names it keeps its records (the ref: req_to_blocks, num_cached_blocks).
    r.status = RequestStatus.FINISHED_ABORTED
    kv.free(r)
    assert kv.get_block_ids("r") == []
    kept = [name for name, record in vars(kv).items()
            if isinstance(record, (dict, set, list)) and "r" in record]
    assert not kept, f"the manager still keeps request 'r' in {kept} after freeing it"


def test_caching_off_hashes_nothing() -> None:
    kv, alloc = _manager(4, caching=False)
    r = _request("r", list(range(1, 9)))
    assert kv.get_computed_blocks(r) == ([], 0)
    blocks = kv.allocate_slots(r, 8)
    assert r.block_hashes == [] and all(alloc.get_block_hash(b) is None for b in blocks)


# -- the twin against the ref, on random traffic --------------------------------------------

ops = st.lists(st.tuples(st.sampled_from(["step", "step", "admit", "preempt", "finish"]),
                         st.integers(0, 3), st.integers(1, 9)), max_size=30)


@given(ops=ops, num_blocks=st.integers(2, 10), caching=st.booleans())
def test_same_decisions_as_the_ref(ops, num_blocks: int, caching: bool) -> None:
    impl, impl_alloc = _manager(num_blocks, caching)
    ref_alloc = RefAllocator(num_blocks, BS, caching)
    ref = ref_kv_cache_manager.KVCacheManager(ref_alloc)
    prompts = [[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 9], [7] * 9, [1, 2, 3, 4, 5, 6, 8, 8]]
    reqs: dict[int, tuple[Request, Request]] = {}
    for op, i, n in ops:
        if op == "admit" and i not in reqs:
            pair = (_request(f"r{i}", prompts[i]), _request(f"r{i}", prompts[i]))
            hits = [kv.get_computed_blocks(r) for kv, r in zip((impl, ref), pair)]
            assert hits[0] == hits[1]
            (blocks, num_hit), todo = hits[0], pair[0].num_tokens - hits[0][1]
            got = [kv.allocate_slots(r, todo, blocks) for kv, r in zip((impl, ref), pair)]
            assert got[0] == got[1]
            if got[0] is not None:
                for r in pair:
                    _compute(r, num_hit + todo)
                reqs[i] = pair
        elif op == "step" and i in reqs:
            for r in reqs[i]:
                r.append_output_token_ids(n)
            got = [kv.allocate_slots(r, 1) for kv, r in zip((impl, ref), reqs[i])]
            assert got[0] == got[1]
            if got[0] is not None:
                for r in reqs[i]:
                    _compute(r, 1)
        elif op in ("preempt", "finish") and i in reqs:
            for kv, r in zip((impl, ref), reqs.pop(i)):
                r.status = (RequestStatus.PREEMPTED if op == "preempt"
                            else RequestStatus.FINISHED_STOPPED)
                kv.free(r)
        for j in range(4):
            assert impl.get_block_ids(f"r{j}") == ref.get_block_ids(f"r{j}")
        assert impl_alloc.get_free_block_ids() == ref_alloc.get_free_block_ids()
        assert [impl_alloc.get_block_hash(b) for b in range(num_blocks)] == [
            ref_alloc.get_block_hash(b) for b in range(num_blocks)]

