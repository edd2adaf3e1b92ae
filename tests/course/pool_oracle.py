"""A plain-Python model of the block pool, written from the rules in docs/host_side.md.

Not a test module: the allocator and prefix-caching course tests drive the
implementation under test and this model side by side, with deterministic
random traffic, and report the first step where they disagree.
"""

from __future__ import annotations


class PoolOracle:
    """Free queue (head recycled first), reference counts, one block per hash."""

    def __init__(self, num_blocks: int, caching: bool = True) -> None:
        self.free = list(range(num_blocks))
        self.count = [0] * num_blocks
        self.hash_of: dict[int, int] = {}  # block -> hash
        self.block_of: dict[int, int] = {}  # hash -> block
        self.caching = caching

    def allocate(self, n: int) -> list[int]:
        got = self.free[:n]
        del self.free[:n]
        for b in got:
            if b in self.hash_of:  # recycling a cached block evicts its hash
                del self.block_of[self.hash_of.pop(b)]
            self.count[b] = 1
        return got

    def free_blocks(self, blocks: list[int]) -> None:
        for b in blocks:
            self.count[b] -= 1
            if self.count[b] == 0:
                self.free.append(b)

    def lookup(self, chain: list[int]) -> list[int]:
        hits = []
        for h in chain if self.caching else []:
            if h not in self.block_of:
                break
            hits.append(self.block_of[h])
        return hits

    def touch(self, blocks: list[int]) -> None:
        for b in blocks:
            if self.count[b] == 0:
                self.free.remove(b)
            self.count[b] += 1

    def cache(self, block: int, h: int) -> None:
        if self.caching and block not in self.hash_of and h not in self.block_of:
            self.hash_of[block] = h
            self.block_of[h] = block


def compare(impl, oracle: PoolOracle, num_blocks: int, step: str) -> None:
    """Assert that ``impl`` holds the oracle's state; the message names the first difference."""
    free = impl.get_free_block_ids()
    for b in range(num_blocks):
        got = impl.ref_count(b)
        assert got == oracle.count[b], (
            f"after {step}: block {b} has ref count {got}, expected {oracle.count[b]}")
        if got > 0:
            assert b not in free, f"after {step}: block {b} is held and also in the free queue"
    assert free == oracle.free, f"after {step}: free queue {free}, expected {oracle.free}"
    for b in range(num_blocks):
        assert impl.get_block_hash(b) == oracle.hash_of.get(b), (
            f"after {step}: block {b} cached under {impl.get_block_hash(b)}, "
            f"expected {oracle.hash_of.get(b)}")
