"""The block allocator under test (``backend.get("block_allocator")``) against the ref twin.

A hypothesis state machine drives both allocators in lockstep with random
allocations, frees, cache fills, cache look-ups and resets, and checks after
every step that they made the same decisions and that the pool is consistent
with an explicit list of owners (an oracle independent of the ref). Rules that
cache a request's whole chain and share it with another request make blocks
with ref counts above 1 common; ``test_mutants.py`` runs the machine against a
planted bug to prove it finds what it should. Example tests pin the
prefix-cache rules.
"""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    multiple,
    precondition,
    rule,
)

from minivllm import backend
from minivllm.ref import block_allocator as ref_block_allocator
from minivllm.testing.strategies import stateful_settings


def _impl():
    return backend.get("block_allocator").BlockAllocator


# Hashes come from a tiny universe so that look-ups hit often.
hashes = st.integers(0, 7)


class AllocatorMachine(RuleBasedStateMachine):
    """Random alloc/free/cache/lookup/reset traffic on the implementation and the ref."""

    owners = Bundle("owners")

    def __init__(self) -> None:
        super().__init__()
        # owner id -> the blocks it holds (an owner plays the part of a request).
        self.holdings: dict[int, list[int]] = {}
        self.next_owner = 0

    # Prefix caching on in 3 of 4 runs: that is where sharing, and its bugs, live.
    @initialize(num_blocks=st.integers(1, 12), caching=st.sampled_from([True, True, True, False]))
    def make(self, num_blocks: int, caching: bool) -> None:
        self.impl = _impl()(num_blocks, 4, enable_prefix_caching=caching)
        self.ref = ref_block_allocator.BlockAllocator(num_blocks, 4, caching)
        self.num_blocks = num_blocks

    def _new_owner(self, blocks: list[int]) -> int:
        owner = self.next_owner
        self.next_owner += 1
        self.holdings[owner] = blocks
        return owner

    @rule(target=owners, n=st.integers(0, 6))
    def allocate(self, n: int) -> int:
        if n > self.ref.num_free_blocks:
            with pytest.raises(ValueError):
                self.ref.allocate(n)
            with pytest.raises(ValueError):
                self.impl.allocate(n)
            return self._new_owner([])
        held = {b for blocks in self.holdings.values() for b in blocks}
        got = self.impl.allocate(n)
        assert got == self.ref.allocate(n), "different blocks (LRU order differs)"
        assert len(set(got)) == n and not set(got) & held, "a block handed out twice"
        return self._new_owner(got)

    @rule(owner=consumes(owners))
    def free(self, owner: int) -> None:
        blocks = self.holdings.pop(owner)
        # As a request does: release its blocks last-first.
        self.impl.free(reversed(blocks))
        self.ref.free(reversed(blocks))

    @rule(owner=owners, index=st.integers(0, 5), block_hash=hashes)
    def cache_full_block(self, owner: int, index: int, block_hash: int) -> None:
        blocks = self.holdings.get(owner, [])
        if index < len(blocks):
            self.impl.cache_full_block(blocks[index], block_hash)
            self.ref.cache_full_block(blocks[index], block_hash)

    @rule(owner=owners, first_hash=hashes)
    def cache_chain(self, owner: int, first_hash: int) -> None:
        """Cache all of an owner's blocks, as a request does once its prompt is computed."""
        for i, block in enumerate(self.holdings.get(owner, [])):
            self.impl.cache_full_block(block, first_hash + i)
            self.ref.cache_full_block(block, first_hash + i)

    @rule(target=owners, owner=owners)
    def share_prefix(self, owner: int) -> int:
        """A second request with the same prefix hits the owner's cached, held blocks."""
        chain = []
        for block in self.holdings.get(owner, []):
            block_hash = self.ref.get_block_hash(block)
            if block_hash is None:
                break
            chain.append(block_hash)
        got = self.impl.get_cached_blocks(chain)
        assert got == self.ref.get_cached_blocks(chain)
        # Each hash in the chain names exactly the owner's block: all of them must hit.
        assert got == self.holdings[owner][: len(chain)]
        return self._new_owner(got)

    @rule(target=owners, n=st.integers(1, 4), first_hash=hashes, copies=st.integers(1, 3))
    def system_prompt(self, n: int, first_hash: int, copies: int):
        """One request computes a prefix of ``n`` blocks; ``copies`` more requests share it."""
        if n > self.ref.num_free_blocks:
            return multiple()
        first = self._new_owner(self.impl.allocate(n))
        assert self.holdings[first] == self.ref.allocate(n)
        self.cache_chain(first, first_hash)
        return multiple(first, *(self.share_prefix(first) for _ in range(copies)))

    @rule(target=owners, chain=st.lists(hashes, max_size=4))
    def get_cached_blocks(self, chain: list[int]) -> int:
        got = self.impl.get_cached_blocks(chain)
        assert got == self.ref.get_cached_blocks(chain)
        return self._new_owner(got)

    @rule(chain=st.lists(hashes, max_size=4))
    def lookup_does_not_touch(self, chain: list[int]) -> None:
        before = self.impl.get_free_block_ids()
        assert self.impl.lookup_cached_blocks(chain) == self.ref.lookup_cached_blocks(chain)
        assert self.impl.get_free_block_ids() == before

    @precondition(lambda self: hasattr(self, "ref"))
    @rule()
    def reset_prefix_cache(self) -> None:
        ok = self.impl.reset_prefix_cache()
        assert ok == self.ref.reset_prefix_cache()
        assert ok == (not any(self.holdings.values()))

    @invariant()
    def same_state_as_ref(self) -> None:
        if not hasattr(self, "ref"):
            return
        assert self.impl.num_free_blocks == self.ref.num_free_blocks
        # Same free queue, in the same order: the same blocks will be evicted next.
        assert self.impl.get_free_block_ids() == self.ref.get_free_block_ids()
        for b in range(self.num_blocks):
            assert self.impl.get_block_hash(b) == self.ref.get_block_hash(b)

    @invariant()
    def pool_is_consistent(self) -> None:
        if not hasattr(self, "ref"):
            return
        owned = Counter(b for blocks in self.holdings.values() for b in blocks)
        free = self.impl.get_free_block_ids()
        assert len(set(free)) == len(free), "a block is twice in the free queue"
        assert not set(free) & set(owned), "a held block is in the free queue"
        assert len(free) + len(owned) == self.num_blocks, "a block leaked"
        for b in range(self.num_blocks):
            assert self.impl.ref_count(b) == owned[b], f"ref count of block {b}"
        # A hash names at most one block.
        cached = [self.impl.get_block_hash(b) for b in range(self.num_blocks)]
        cached = [h for h in cached if h is not None]
        assert len(cached) == len(set(cached))


TestAllocatorMachine = AllocatorMachine.TestCase
TestAllocatorMachine.settings = stateful_settings(max_examples=100, step_count=50)


# -- example tests: the prefix-cache rules -------------------------------------------------


def test_freed_blocks_stay_cached_and_hit():
    alloc = _impl()(4, 16)
    a, b = alloc.allocate(2)
    alloc.cache_full_block(a, 111)
    alloc.cache_full_block(b, 222)
    alloc.free([b, a])
    assert alloc.num_free_blocks == 4  # cached-but-unreferenced blocks count as free
    assert alloc.get_cached_blocks([111, 222, 333]) == [a, b]
    assert (alloc.ref_count(a), alloc.ref_count(b)) == (1, 1)
    assert alloc.num_free_blocks == 2


def test_hit_stops_at_first_miss():
    alloc = _impl()(4, 16)
    a, b = alloc.allocate(2)
    alloc.cache_full_block(a, 1)
    alloc.cache_full_block(b, 2)
    # Block 2 is cached, but without block 1 in front of it the chain is broken.
    assert alloc.get_cached_blocks([9, 2]) == []
    assert alloc.get_cached_blocks([1, 9, 2]) == [a]
    assert alloc.ref_count(a) == 2


def test_shared_block_needs_every_owner_to_free_it():
    alloc = _impl()(2, 16)
    (a,) = alloc.allocate(1)
    alloc.cache_full_block(a, 5)
    assert alloc.get_cached_blocks([5]) == [a]
    alloc.free([a])
    assert alloc.ref_count(a) == 1 and a not in alloc.get_free_block_ids()
    alloc.free([a])
    assert alloc.get_free_block_ids()[-1] == a


def test_lru_eviction_order():
    alloc = _impl()(4, 16)
    blocks = alloc.allocate(4)
    for i, b in enumerate(blocks):
        alloc.cache_full_block(b, 100 + i)
    # Free in the order 2, 0, 3, 1: that is the order they will be recycled.
    order = [blocks[2], blocks[0], blocks[3], blocks[1]]
    alloc.free(order)
    assert alloc.allocate(1) == [order[0]]
    assert alloc.get_block_hash(order[0]) is None  # evicted: its hash is gone
    assert alloc.lookup_cached_blocks([102]) == []
    assert alloc.lookup_cached_blocks([100, 103]) == [blocks[0], blocks[3]]  # still cached
    # A hit moves a block out of the queue; the rest keep their order.
    assert alloc.get_cached_blocks([100]) == [blocks[0]]
    assert alloc.allocate(2) == [order[2], order[3]]


def test_caching_disabled_never_hits():
    alloc = _impl()(2, 16, enable_prefix_caching=False)
    (a,) = alloc.allocate(1)
    alloc.cache_full_block(a, 7)
    alloc.free([a])
    assert alloc.get_block_hash(a) is None
    assert alloc.get_cached_blocks([7]) == []


def test_duplicate_hash_keeps_first_copy():
    alloc = _impl()(3, 16)
    a, b = alloc.allocate(2)
    alloc.cache_full_block(a, 42)
    alloc.cache_full_block(b, 42)
    assert alloc.get_block_hash(a) == 42 and alloc.get_block_hash(b) is None
    assert alloc.lookup_cached_blocks([42]) == [a]


def test_reset_prefix_cache_only_when_idle():
    alloc = _impl()(2, 16)
    (a,) = alloc.allocate(1)
    alloc.cache_full_block(a, 3)
    assert alloc.reset_prefix_cache() is False
    alloc.free([a])
    assert alloc.reset_prefix_cache() is True
    assert alloc.lookup_cached_blocks([3]) == []


def test_bad_input():
    alloc = _impl()(2, 16)
    with pytest.raises(ValueError, match="num_blocks"):
        alloc.allocate(3)
    with pytest.raises(ValueError, match="num_blocks"):
        alloc.allocate(-1)
    (a,) = alloc.allocate(1)
    alloc.free([a])
    # A double free is a ValueError naming the block (any wording: docs/course/01_allocator.md).
    with pytest.raises(ValueError, match=rf"block\w*\W+{a}\b"):
        alloc.free([a])
    with pytest.raises(ValueError, match="block_id"):
        alloc.ref_count(5)
    with pytest.raises(ValueError, match="block_size"):
        _impl()(2, 0)
