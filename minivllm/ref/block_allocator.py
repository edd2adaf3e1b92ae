"""The paged KV cache's block pool, with reference counts and prefix caching.

The KV cache is cut into ``num_blocks`` fixed-size blocks of ``block_size``
token slots each. A request owns a list of blocks (its block table) instead
of one contiguous max-length region, so memory is handed out a block at a
time, as the sequence grows. This module only does the bookkeeping: which
block ids are free, who holds which, and which full blocks hold a known
token prefix. The tensors themselves live in the worker on every rank
(:mod:`minivllm.worker.worker`); this pool is the scheduler's, on rank 0.

Three ideas, all from vLLM v1's ``BlockPool``:

1. **Reference counts.** A block may be shared by several requests (a common
   system prompt); ``ref_count(b)`` is the number of requests holding ``b``.
   It returns to the free queue when the count drops to 0.
2. **Prefix caching.** A full block can be *cached* under the chained hash of
   its tokens (:mod:`minivllm.prefix_hash`). A new request whose prompt starts
   with the same tokens looks its block hashes up and reuses the longest
   matching run of blocks instead of recomputing them.
3. **LRU eviction.** A freed block *keeps* its hash: its K/V are still valid,
   and a later request may hit it. Freed blocks go to the *tail* of the free
   queue and allocation pops from the *head*, so the block unused for the
   longest time is recycled first; recycling a cached block evicts its hash.

This reference twin keeps the free queue as a plain Python list: popping the
head and removing a block from the middle (a cache hit on a free block) both
cost O(num_blocks). :mod:`minivllm.fast.block_allocator` subclasses this class
and replaces only the four free-queue methods at the bottom, making them O(1).
"""

from __future__ import annotations

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
        # ref_counts[b]: how many requests hold block b (0 = free).
        self.ref_counts: list[int] = [0] * num_blocks
        # block_hashes[b]: the hash block b is cached under, or None.
        self.block_hashes: list[int | None] = [None] * num_blocks
        # hash -> the block that holds those tokens (one block per hash).
        self.cached_block_hash_to_block: dict[int, int] = {}
        # Free blocks in eviction order: the head is recycled first.
        self._init_free_queue(range(num_blocks))

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

        Raises ``ValueError`` if fewer than ``num_blocks`` are free (callers
        check :attr:`num_free_blocks` first).
        """
        # BEGIN SOLUTION
        if num_blocks < 0 or num_blocks > len(self.free_block_queue):
            raise ValueError(
                f"num_blocks must be in [0, {len(self.free_block_queue)}] (free blocks), "
                f"got {num_blocks!r}"
            )
        block_ids = []
        for _ in range(num_blocks):
            block_id = self._pop_free_head()
            self._evict(block_id)  # its old K/V are about to be overwritten
            self.ref_counts[block_id] = 1
            block_ids.append(block_id)
        return block_ids
        # END SOLUTION

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference to each block; blocks reaching 0 go to the free queue's tail.

        Blocks are appended in the order given. Callers free a request's
        blocks in *reverse* order, so its last blocks (the least likely to be
        shared with a later prompt) are evicted first.
        """
        # BEGIN SOLUTION
        for block_id in block_ids:
            self._check_id(block_id)
            if self.ref_counts[block_id] == 0:
                raise ValueError(f"block {block_id} is already free (double free)")
            self.ref_counts[block_id] -= 1
            if self.ref_counts[block_id] == 0:
                self._push_free_tail(block_id)
        # END SOLUTION

    # -- prefix caching --------------------------------------------------------

    def lookup_cached_blocks(self, block_hashes: Sequence[int]) -> list[int]:
        """The blocks of the longest cached prefix of ``block_hashes``, without touching them."""
        # BEGIN SOLUTION
        if not self.enable_prefix_caching:
            return []
        hits = []
        for block_hash in block_hashes:
            block_id = self.cached_block_hash_to_block.get(block_hash)
            if block_id is None:
                break  # chained hashes: nothing after a miss can be a valid prefix
            hits.append(block_id)
        return hits
        # END SOLUTION

    def touch(self, block_ids: Iterable[int]) -> None:
        """Take one more reference to each (cached) block; a free one leaves the free queue."""
        # BEGIN SOLUTION
        for block_id in block_ids:
            self._check_id(block_id)
            if self.ref_counts[block_id] == 0:
                self._remove_free(block_id)  # a hit on a free block: out of the middle
            self.ref_counts[block_id] += 1
        # END SOLUTION

    def get_cached_blocks(self, block_hashes: Sequence[int]) -> list[int]:
        """Longest cached prefix of ``block_hashes``, touched (ref count + 1 each)."""
        hits = self.lookup_cached_blocks(block_hashes)
        self.touch(hits)
        return hits

    def cache_full_block(self, block_id: int, block_hash: int) -> None:
        """Record that the full block ``block_id`` holds the tokens named ``block_hash``.

        Does nothing if caching is off, if the block is already cached, or if
        another block already holds that hash (two requests computed the same
        tokens at once: the first one stays the cached copy).
        """
        # BEGIN SOLUTION
        self._check_id(block_id)
        if not self.enable_prefix_caching or self.block_hashes[block_id] is not None:
            return
        if block_hash in self.cached_block_hash_to_block:
            return
        self.block_hashes[block_id] = block_hash
        self.cached_block_hash_to_block[block_hash] = block_id
        # END SOLUTION

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash. Only allowed when no block is held; returns success."""
        # BEGIN SOLUTION
        if len(self.free_block_queue) != self.num_blocks:
            return False
        self.cached_block_hash_to_block.clear()
        self.block_hashes = [None] * self.num_blocks
        return True
        # END SOLUTION

    # -- the free queue (the fast twin overrides exactly these four) ---------------

    def _init_free_queue(self, block_ids: Iterable[int]) -> None:
        self.free_block_queue: list[int] = list(block_ids)  # index 0 is the head

    def _pop_free_head(self) -> int:
        return self.free_block_queue.pop(0)  # O(num_blocks): shifts the whole list

    def _push_free_tail(self, block_id: int) -> None:
        self.free_block_queue.append(block_id)

    def _remove_free(self, block_id: int) -> None:
        self.free_block_queue.remove(block_id)  # O(num_blocks) scan

    # -- helpers ---------------------------------------------------------------

    def _evict(self, block_id: int) -> None:
        # BEGIN SOLUTION
        block_hash = self.block_hashes[block_id]
        if block_hash is not None:
            del self.cached_block_hash_to_block[block_hash]
            self.block_hashes[block_id] = None
        # END SOLUTION

    def _check_id(self, block_id: int) -> None:
        if not 0 <= block_id < self.num_blocks:
            raise ValueError(f"block_id must be in [0, {self.num_blocks}), got {block_id!r}")
