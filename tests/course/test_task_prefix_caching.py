"""Course task: prefix caching in the block allocator (look-up, caching, LRU eviction)."""

from __future__ import annotations

import random

import pytest
from pool_oracle import PoolOracle, compare

from minivllm import backend


def _pool(num_blocks: int, caching: bool = True):
    return backend.get("block_allocator").BlockAllocator(num_blocks, 4, caching)


def test_lookup_stops_at_the_first_miss_and_touches_nothing():
    alloc = _pool(4)
    blocks = alloc.allocate(3)
    for b, h in zip(blocks, (10, 11, 12)):
        alloc.cache_full_block(b, h)
    alloc.free(list(reversed(blocks)))
    before = alloc.get_free_block_ids()
    assert alloc.lookup_cached_blocks([10, 99, 12]) == [blocks[0]], (
        "a hit after a miss is not a prefix: the look-up must stop at the miss")
    assert alloc.lookup_cached_blocks([10, 11, 12]) == blocks
    assert alloc.get_free_block_ids() == before, "lookup_cached_blocks must not take blocks"


def test_recycling_evicts_only_the_recycled_block():
    alloc = _pool(3)
    blocks = alloc.allocate(3)
    for b, h in zip(blocks, (1, 2, 3)):
        alloc.cache_full_block(b, h)
    alloc.free(blocks)
    (new,) = alloc.allocate(1)
    assert new == blocks[0]
    assert alloc.get_block_hash(new) is None, f"block {new} was recycled but keeps its hash"
    assert alloc.lookup_cached_blocks([1]) == [], "hash 1 still names a recycled block"
    alloc.cache_full_block(new, 1)  # the same tokens computed again: cached again
    assert alloc.lookup_cached_blocks([1, 2, 3]) == blocks


def test_first_copy_of_a_hash_wins_and_a_cached_block_keeps_its_hash():
    alloc = _pool(3)
    a, b = alloc.allocate(2)
    alloc.cache_full_block(a, 8)
    alloc.cache_full_block(b, 8)
    alloc.cache_full_block(a, 9)  # already cached: no change
    assert (alloc.get_block_hash(a), alloc.get_block_hash(b)) == (8, None)
    assert alloc.lookup_cached_blocks([9]) == []


@pytest.mark.parametrize("seed", range(12))
def test_random_cache_traffic_matches_the_pool_model(seed):
    rng = random.Random(1000 + seed)
    num_blocks = rng.randint(2, 8)
    alloc, model = _pool(num_blocks), PoolOracle(num_blocks)
    owners: list[list[int]] = []
    for step in range(60):
        op = rng.choice(["alloc", "free", "cache", "cache", "hit", "lookup", "reset"])
        if op == "alloc":
            n = rng.randint(0, min(2, len(model.free)))
            got = alloc.allocate(n)
            assert got == model.allocate(n), f"step {step}: allocate({n}) gave {got}"
            owners.append(got)
        elif op == "free" and owners:
            blocks = owners.pop(0)
            alloc.free(blocks)
            model.free_blocks(blocks)
        elif op == "cache" and owners and owners[-1]:
            block, h = rng.choice(owners[-1]), rng.randint(0, 4)
            alloc.cache_full_block(block, h)
            model.cache(block, h)
        elif op in ("hit", "lookup"):
            chain = [rng.randint(0, 4) for _ in range(rng.randint(1, 4))]
            want = model.lookup(chain)
            if op == "hit":
                got = alloc.get_cached_blocks(chain)
                model.touch(want)
                owners.append(got)
            else:
                got = alloc.lookup_cached_blocks(chain)
            assert got == want, f"step {step}: {op} {chain} gave {got}, expected {want}"
        elif op == "reset":
            idle = not any(owners)
            assert alloc.reset_prefix_cache() == idle, f"step {step}: reset_prefix_cache"
            if idle:
                model.hash_of.clear()
                model.block_of.clear()
        compare(alloc, model, num_blocks, f"step {step} ({op})")
