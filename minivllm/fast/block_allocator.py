"""The block pool with an O(1) free queue (twin of :mod:`minivllm.ref.block_allocator`).

Same decisions as the reference, block for block; read that file first for
the ideas (reference counts, chained-hash prefix caching, LRU eviction).

What is different, and why it is faster:

- The free queue is an ``OrderedDict`` (a hash map threaded on a doubly
  linked list, implemented in C) instead of a ``list``. Popping the head
  (``popitem(last=False)``), appending at the tail and *removing a block from
  the middle* (a prefix-cache hit on a freed block) are all O(1); the list
  costs O(num_blocks) for the first and the last. vLLM's
  ``FreeKVCacheBlockQueue`` is the same structure written by hand over the
  block objects.
- :meth:`allocate` / :meth:`free` hoist attribute look-ups out of their loops
  and skip per-id range checks on the hot path of ``allocate``.

Hash look-ups are dicts in both twins (O(1)).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

__all__ = ["BlockAllocator"]


class BlockAllocator:
    """A fixed pool of KV blocks with reference counts and an LRU prefix cache.

    Args:
        num_blocks: blocks in the pool (ids ``0 .. num_blocks - 1``).
        block_size: tokens per block (only recorded; hashes come from callers).
        enable_prefix_caching: if False, :meth:`cache_full_block` does nothing
            and :meth:`get_cached_blocks` never hits.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks!r}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size!r}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts: list[int] = [0] * num_blocks
        self.block_hashes: list[int | None] = [None] * num_blocks
        self.cached_block_hash_to_block: dict[int, int] = {}
        # Keys are the free block ids in eviction order; values are unused.
        self.free_block_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))

    # -- queries ---------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks nobody holds, including cached ones (they can be evicted)."""
        return len(self.free_block_queue)

    def ref_count(self, block_id: int) -> int:
        """How many requests hold ``block_id``."""
        self._check_id(block_id)
        return self.ref_counts[block_id]

    def get_block_hash(self, block_id: int) -> int | None:
        """The hash ``block_id`` is cached under, or None if it is not cached."""
        self._check_id(block_id)
        return self.block_hashes[block_id]

    def get_free_block_ids(self) -> list[int]:
        """The free queue in eviction order (head first). For tests and pictures."""
        return list(self.free_block_queue)

    # -- allocation ------------------------------------------------------------

    def allocate(self, num_blocks: int) -> list[int]:
        """Take ``num_blocks`` blocks from the head of the free queue (ref count 1 each).

        Raises ``ValueError`` if fewer than ``num_blocks`` are free.
        """
        queue = self.free_block_queue
        if num_blocks < 0 or num_blocks > len(queue):
            raise ValueError(
                f"num_blocks must be in [0, {len(queue)}] (free blocks), got {num_blocks!r}"
            )
        ref_counts, block_hashes = self.ref_counts, self.block_hashes
        block_ids = []
        for _ in range(num_blocks):
            block_id = queue.popitem(last=False)[0]  # O(1) pop of the head
            block_hash = block_hashes[block_id]
            if block_hash is not None:  # evict: its K/V are about to be overwritten
                del self.cached_block_hash_to_block[block_hash]
                block_hashes[block_id] = None
            ref_counts[block_id] = 1
            block_ids.append(block_id)
        return block_ids

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference to each block; blocks reaching 0 go to the free queue's tail.

        Blocks are appended in the order given (callers pass a request's
        blocks in reverse, so its tail blocks are evicted first).
        """
        ref_counts, queue = self.ref_counts, self.free_block_queue
        for block_id in block_ids:
            self._check_id(block_id)
            count = ref_counts[block_id]
            if count == 0:
                raise ValueError(f"block {block_id} is already free (double free)")
            ref_counts[block_id] = count - 1
            if count == 1:
                queue[block_id] = None  # O(1) append at the tail

    # -- prefix caching --------------------------------------------------------

    def lookup_cached_blocks(self, block_hashes: Sequence[int]) -> list[int]:
        """The blocks of the longest cached prefix of ``block_hashes``, without touching them."""
        if not self.enable_prefix_caching:
            return []
        table = self.cached_block_hash_to_block
        hits = []
        for block_hash in block_hashes:
            block_id = table.get(block_hash)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def touch(self, block_ids: Iterable[int]) -> None:
        """Take one more reference to each (cached) block; a free one leaves the free queue."""
        ref_counts, queue = self.ref_counts, self.free_block_queue
        for block_id in block_ids:
            self._check_id(block_id)
            if ref_counts[block_id] == 0:
                del queue[block_id]  # O(1) unlink from the middle
            ref_counts[block_id] += 1

    def get_cached_blocks(self, block_hashes: Sequence[int]) -> list[int]:
        """Longest cached prefix of ``block_hashes``, touched (ref count + 1 each)."""
        hits = self.lookup_cached_blocks(block_hashes)
        self.touch(hits)
        return hits

    def cache_full_block(self, block_id: int, block_hash: int) -> None:
        """Record that the full block ``block_id`` holds the tokens named ``block_hash``.

        Does nothing if caching is off, if the block is already cached, or if
        another block already holds that hash (the first copy stays cached).
        """
        self._check_id(block_id)
        if not self.enable_prefix_caching or self.block_hashes[block_id] is not None:
            return
        if block_hash in self.cached_block_hash_to_block:
            return
        self.block_hashes[block_id] = block_hash
        self.cached_block_hash_to_block[block_hash] = block_id

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash. Only allowed when no block is held; returns success."""
        if len(self.free_block_queue) != self.num_blocks:
            return False
        self.cached_block_hash_to_block.clear()
        self.block_hashes = [None] * self.num_blocks
        return True

    # -- helpers ---------------------------------------------------------------

    def _check_id(self, block_id: int) -> None:
        if not 0 <= block_id < self.num_blocks:
            raise ValueError(f"block_id must be in [0, {self.num_blocks}), got {block_id!r}")
