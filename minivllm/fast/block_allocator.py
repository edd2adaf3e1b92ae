"""The block pool with an O(1) free queue (twin of :mod:`minivllm.ref.block_allocator`).

Same decisions as the reference, block for block; read that file first for
the ideas (reference counts, chained-hash prefix caching, LRU eviction). This
twin subclasses it and replaces only the free queue:

- an ``OrderedDict`` (a hash map threaded on a doubly linked list,
  implemented in C) instead of a ``list``. Popping the head
  (``popitem(last=False)``), appending at the tail and *removing a block from
  the middle* (a prefix-cache hit on a freed block) are all O(1); the list
  costs O(num_blocks) for the first and the last. vLLM's
  ``FreeKVCacheBlockQueue`` is the same structure written by hand over the
  block objects.

Hash look-ups are dicts in both twins (O(1)).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from minivllm.ref import block_allocator as _ref

__all__ = ["BlockAllocator"]


class BlockAllocator(_ref.BlockAllocator):
    """A fixed pool of KV blocks with reference counts and an LRU prefix cache.

    Args:
        num_blocks: blocks in the pool (ids ``0 .. num_blocks - 1``).
        block_size: tokens per block (only recorded; hashes come from callers).
        enable_prefix_caching: if False, :meth:`cache_full_block` does nothing
            and :meth:`get_cached_blocks` never hits.
    """

    def _init_free_queue(self, block_ids: Iterable[int]) -> None:
        # Keys are the free block ids in eviction order (first = head); values unused.
        self.free_block_queue: OrderedDict[int, None] = OrderedDict.fromkeys(block_ids)

    def _pop_free_head(self) -> int:
        return self.free_block_queue.popitem(last=False)[0]  # O(1)

    def _push_free_tail(self, block_id: int) -> None:
        self.free_block_queue[block_id] = None  # O(1)

    def _remove_free(self, block_id: int) -> None:
        del self.free_block_queue[block_id]  # O(1) unlink from the middle
