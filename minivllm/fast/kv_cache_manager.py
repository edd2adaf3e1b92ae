"""``KVCacheManager`` with a fast path for decodes (twin of the ref).

Same decisions as :mod:`minivllm.ref.kv_cache_manager` (read it first); this
twin subclasses it and changes one thing:

- :meth:`allocate_slots` returns at once, without allocating, when the
  request's last block still has room for the new tokens, no block becomes
  full (so nothing is entered in the prefix cache) and no block it writes is
  shared by a fork (so nothing is copied; for a request that never forked
  that is one set look-up). That is 15 decode steps in 16 with
  ``block_size=16``; the ref works out the block arithmetic, counts
  evictable hits and calls the allocator every time.

Everything else (the host-side block lists, the prefix-cache look-up, the
lazily extended ``Request.block_hashes``, freeing, fork and copy-on-write)
is the ref's code.
"""

from __future__ import annotations

from collections.abc import Sequence

from minivllm.ref import kv_cache_manager as _ref
from minivllm.request import Request

__all__ = ["KVCacheManager"]


class KVCacheManager(_ref.KVCacheManager):
    """Blocks for requests, in tokens, on top of a block allocator.

    Args:
        block_allocator: a ``BlockAllocator`` (either twin).
    """

    def allocate_slots(
        self, request: Request, num_new_tokens: int, new_computed_blocks: Sequence[int] = (),
        *, num_lookahead_tokens: int = 0,
    ) -> list[int] | None:
        """Blocks for ``num_new_tokens`` more tokens; None if the pool is too small now."""
        blocks = self.req_to_blocks.get(request.request_id)
        if blocks is not None and not new_computed_blocks:
            num_computed = request.num_computed_tokens
            num_total_tokens = num_computed + num_new_tokens
            num_final = min(num_total_tokens, request.num_tokens)  # what may be cached
            end = num_total_tokens + num_lookahead_tokens  # the last slot written, plus one
            # Fast path (most decodes): room left in the last block, no block fills up,
            # and no block written is shared (only possible after a fork: the set look-up
            # spares every other request the method call).
            if end <= len(blocks) * self.block_size and (
                not self.enable_prefix_caching
                or num_final // self.block_size <= self.num_cached_blocks[request.request_id]
            ) and (request.request_id not in self.forked_req_ids
                   or not self._shared_blocks_written(request, num_computed, end)):
                return []
        return super().allocate_slots(request, num_new_tokens, new_computed_blocks,
                                      num_lookahead_tokens=num_lookahead_tokens)
