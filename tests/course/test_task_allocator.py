"""Course task: the block allocator's allocate / free / touch and reference counts.

Deterministic traffic against a plain-Python model of the pool
(``pool_oracle.py``), with blocks shared by up to four owners, so a free that
drops a shared block's count to 0, or a touch that leaves a block in the free
queue, shows in the first few steps.
"""

from __future__ import annotations

import random

import pytest
from pool_oracle import PoolOracle, compare

from minivllm import backend


def _pool(num_blocks: int, caching: bool = True):
    return backend.get("block_allocator").BlockAllocator(num_blocks, 4, caching)


def test_shared_block_freed_by_each_owner_in_turn():
    alloc = _pool(3)
    (a,) = alloc.allocate(1)
    alloc.cache_full_block(a, 77)
    for _ in range(3):  # three more owners of the same cached block
        assert alloc.get_cached_blocks([77]) == [a]
    assert alloc.ref_count(a) == 4
    for owners_left in (3, 2, 1):
        alloc.free([a])
        assert alloc.ref_count(a) == owners_left, f"block {a}: {owners_left} owners left"
        assert a not in alloc.get_free_block_ids(), (
            f"block {a} is held by {owners_left} owners and also in the free queue")
    alloc.free([a])
    assert alloc.get_free_block_ids()[-1] == a, "a freed block goes to the tail of the queue"


def test_allocate_takes_the_head_in_order():
    alloc = _pool(6)
    assert alloc.allocate(2) == [0, 1]
    assert alloc.allocate(0) == []
    assert alloc.num_free_blocks == 4
    alloc.free([1, 0])
    assert alloc.get_free_block_ids() == [2, 3, 4, 5, 1, 0]
    assert alloc.allocate(5) == [2, 3, 4, 5, 1]
    assert [alloc.ref_count(b) for b in range(6)] == [0, 1, 1, 1, 1, 1]


def test_touch_takes_a_free_cached_block_out_of_the_queue():
    alloc = _pool(4)
    a, b = alloc.allocate(2)
    alloc.cache_full_block(b, 5)
    alloc.free([b, a])
    alloc.touch([b])
    assert alloc.ref_count(b) == 1
    assert b not in alloc.get_free_block_ids(), f"block {b} is held and also in the free queue"
    assert alloc.allocate(3) == [2, 3, a]


@pytest.mark.parametrize("seed", range(12))
def test_random_traffic_matches_the_pool_model(seed):
    rng = random.Random(seed)
    num_blocks = rng.randint(2, 10)
    caching = seed % 4 != 3
    alloc, model = _pool(num_blocks, caching), PoolOracle(num_blocks, caching)
    owners: list[list[int]] = []
    for step in range(60):
        op = rng.choice(["alloc", "alloc", "free", "cache", "hit", "hit"])
        if op == "alloc":
            n = rng.randint(0, min(3, len(model.free)))
            got = alloc.allocate(n)
            assert got == model.allocate(n), f"step {step}: allocate({n}) gave {got}"
            owners.append(got)
        elif op == "free" and owners:
            blocks = owners.pop(rng.randrange(len(owners)))
            alloc.free(list(reversed(blocks)))
            model.free_blocks(list(reversed(blocks)))
        elif op == "cache" and owners and owners[-1]:
            block, h = rng.choice(owners[-1]), rng.randint(0, 5)
            alloc.cache_full_block(block, h)
            model.cache(block, h)
        elif op == "hit":
            chain = [rng.randint(0, 5) for _ in range(rng.randint(1, 3))]
            got = alloc.get_cached_blocks(chain)
            want = model.lookup(chain)
            model.touch(want)
            assert got == want, f"step {step}: get_cached_blocks({chain}) gave {got}"
            owners.append(got)
        compare(alloc, model, num_blocks, f"step {step} ({op})")
