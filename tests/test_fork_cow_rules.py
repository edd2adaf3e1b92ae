"""Fork and copy-on-write, one rule at a time: the KV cache manager under test on a ref pool.

Fixed vectors for what ``tests/test_fork_cow.py``'s state machine checks on
random traffic: a fork shares every block (reference counts + 1); the first
write into the shared partial block copies it, the last holder writes in
place (``h`` holders, ``h - 1`` copies); a prompt ending on a block boundary
needs no copy; a refusal for want of a block changes nothing; a sibling freed
in the step keeps its blocks until the copies are taken; prefix-cache hits
and forks share the same full blocks; bad forks are ``ValueError``.
"""

from __future__ import annotations

import pytest

from minivllm import SamplingParams, backend
from minivllm.ref.block_allocator import BlockAllocator as RefAllocator
from minivllm.request import Request

BS = 4


def _setup(num_blocks: int = 10, caching: bool = False):
    alloc = RefAllocator(num_blocks, BS, caching)  # the ref pool: the manager is graded alone
    return backend.get("kv_cache_manager").KVCacheManager(alloc), alloc


def _req(req_id: str, tokens: list[int], computed: int = 0) -> Request:
    r = Request(req_id, tokens, SamplingParams(max_tokens=20))
    r.num_computed_tokens = computed
    return r


def _prefilled(kv, tokens: list[int], req_id: str = "p") -> Request:
    parent = _req(req_id, tokens)
    assert kv.allocate_slots(parent, len(tokens)) is not None
    parent.num_computed_tokens = len(tokens)
    return parent


def _child(parent: Request, req_id: str, token: int) -> Request:
    child = _req(req_id, parent.all_token_ids[: parent.num_computed_tokens],
                 parent.num_computed_tokens)
    child.append_output_token_ids(token)
    return child


@pytest.mark.parametrize("caching", [False, True])
def test_fork_shares_and_the_first_write_copies_the_partial_block(caching):
    kv, alloc = _setup(caching=caching)
    parent = _prefilled(kv, [1, 2, 3, 4, 5, 6])  # blocks: [1..4] full, [5, 6] partial
    full, partial = kv.get_block_ids("p")
    parent.append_output_token_ids(50)
    child = _child(parent, "c", 60)
    kv.fork(parent, child)
    assert kv.get_block_ids("c") == [full, partial]
    assert alloc.ref_count(full) == alloc.ref_count(partial) == 2
    assert kv.take_blocks_to_copy() == [] and kv.take_req_ids_to_refresh() == []
    # The child writes position 6 first: the partial block is shared, so it gets a copy.
    assert kv.allocate_slots(child, 1) == []
    (fresh,) = set(kv.get_block_ids("c")) - {full, partial}
    assert kv.get_block_ids("c") == [full, fresh]
    assert kv.take_blocks_to_copy() == [(partial, fresh)]
    assert kv.take_req_ids_to_refresh() == ["c"]
    assert (alloc.ref_count(full), alloc.ref_count(partial), alloc.ref_count(fresh)) == (2, 1, 1)
    # The parent is now the partial block's only holder: it writes in place, no copy.
    assert kv.allocate_slots(parent, 1) == []
    assert kv.get_block_ids("p") == [full, partial]
    assert kv.take_blocks_to_copy() == [] and kv.take_req_ids_to_refresh() == []
    # Freeing the child leaves the shared full block with the parent.
    kv.free(child)
    assert alloc.ref_count(full) == 1 and alloc.ref_count(fresh) == 0


def test_a_prompt_on_a_block_boundary_needs_no_copy():
    kv, alloc = _setup()
    parent = _prefilled(kv, [1, 2, 3, 4, 5, 6, 7, 8])  # two full blocks
    parent.append_output_token_ids(50)
    children = [_child(parent, f"c{i}", 60 + i) for i in range(3)]
    for c in children:
        kv.fork(parent, c)
    for r in [parent, *children]:
        assert len(kv.allocate_slots(r, 1)) == 1  # position 8: a new block of its own
    assert kv.take_blocks_to_copy() == []
    assert [alloc.ref_count(b) for b in kv.get_block_ids("p")[:2]] == [4, 4]
    assert alloc.num_free_blocks == 10 - 2 - 4


def test_n_holders_make_n_minus_1_copies():
    kv, alloc = _setup()
    parent = _prefilled(kv, [1, 2, 3, 4, 5])
    parent.append_output_token_ids(50)
    children = [_child(parent, f"c{i}", 60 + i) for i in range(3)]
    for c in children:
        kv.fork(parent, c)
    partial = kv.get_block_ids("p")[1]
    for r in [*children, parent]:
        kv.allocate_slots(r, 1)
    copies = kv.take_blocks_to_copy()
    assert [src for src, _ in copies] == [partial] * 3, "the last writer keeps the original"
    assert kv.get_block_ids("p")[1] == partial and alloc.ref_count(partial) == 1
    assert kv.take_req_ids_to_refresh() == ["c0", "c1", "c2"]


def test_no_room_for_the_copy_changes_nothing():
    kv, alloc = _setup(num_blocks=2)
    parent = _prefilled(kv, [1, 2, 3, 4, 5])  # the whole pool
    parent.append_output_token_ids(50)
    child = _child(parent, "c", 60)
    kv.fork(parent, child)
    free_before = alloc.get_free_block_ids()
    assert kv.allocate_slots(child, 1) is None
    assert kv.get_block_ids("c") == kv.get_block_ids("p")
    assert alloc.get_free_block_ids() == free_before
    assert kv.take_blocks_to_copy() == [] and kv.take_req_ids_to_refresh() == []


def test_a_freed_sibling_keeps_its_blocks_until_the_copies_are_taken():
    kv, alloc = _setup(num_blocks=4)
    parent = _prefilled(kv, [1, 2, 3, 4, 5])
    parent.append_output_token_ids(50)
    child = _child(parent, "c", 60)
    kv.fork(parent, child)
    full, partial = kv.get_block_ids("p")
    kv.allocate_slots(parent, 1)  # the parent copies the partial block ...
    kv.free(child)  # ... then the child is preempted in the same step
    # The copy still has to read `partial`: it must not be handed out before it has run.
    assert partial not in alloc.get_free_block_ids() and alloc.ref_count(partial) == 1
    assert kv.take_blocks_to_copy() == [(partial, kv.get_block_ids("p")[1])]
    assert partial in alloc.get_free_block_ids() and alloc.ref_count(full) == 1


def test_prefix_cache_hits_and_forks_share_the_same_full_blocks():
    kv, alloc = _setup(caching=True)
    parent = _prefilled(kv, [1, 2, 3, 4, 5, 6, 7, 8, 9])
    parent.append_output_token_ids(50)
    child = _child(parent, "c", 60)
    kv.fork(parent, child)
    assert child.block_hashes == parent.block_hashes[:2]  # not hashed again
    first, second = kv.get_block_ids("p")[:2]
    other = _req("o", [1, 2, 3, 4, 5, 6, 7, 8, 70])
    hits, num_hit = kv.get_computed_blocks(other)
    assert (hits, num_hit) == ([first, second], 8)
    kv.allocate_slots(other, 1, hits)
    assert alloc.ref_count(first) == alloc.ref_count(second) == 3
    assert alloc.get_block_hash(first) is not None  # a shared full block stays cached


def test_fork_rejects_bad_requests():
    kv, _ = _setup()
    parent = _prefilled(kv, [1, 2, 3, 4, 5])
    with pytest.raises(ValueError, match="parent 'x'"):
        kv.fork(_req("x", [1]), _req("y", [1]))
    with pytest.raises(ValueError, match="child 'p'"):
        kv.fork(parent, parent)
    with pytest.raises(ValueError, match="num_computed_tokens"):
        kv.fork(parent, _req("c", [1, 2, 3, 4, 5], computed=3))
    with pytest.raises(ValueError, match="num_computed_tokens"):
        kv.fork(parent, _req("c", [1, 2, 3, 9, 5], computed=5))  # other tokens
