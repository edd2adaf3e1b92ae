"""``KVCacheManager``: a request's view of the block pool (used by the ref scheduler).

The scheduler thinks in tokens ("give request r room for 40 more tokens");
the allocator thinks in blocks. This class translates, as vLLM v1's
``KVCacheManager`` does:

- :meth:`get_computed_blocks`: on admission, the longest run of the prompt's
  full blocks already in the prefix cache, always leaving at least the last
  token to compute (the model must run on it to produce the next token's
  logits), so a fully cached prompt gives up its last block hit.
- :meth:`allocate_slots`: make sure a request has blocks for
  ``num_computed_tokens + num_new_tokens`` tokens, or report that the pool
  cannot (the scheduler then preempts or waits). Blocks that this step fills
  completely are entered in the prefix cache under their chained hash.
- :meth:`free`: give all of a request's blocks back, last block first.

The request's blocks are its row in the :class:`BlockTables` (the single
record of who owns which block); the allocator holds the reference counts.
"""

from __future__ import annotations

from collections.abc import Sequence

from minivllm.prefix_hash import hash_block_tokens, hash_request_tokens
from minivllm.request import Request

__all__ = ["KVCacheManager"]


def cdiv(a: int, b: int) -> int:
    """Ceiling division: blocks needed for ``a`` tokens with ``b`` tokens per block."""
    return -(-a // b)


class KVCacheManager:
    """Blocks for requests, in tokens, on top of a block allocator and block tables.

    Args:
        block_allocator: a ``BlockAllocator`` (either twin).
        block_tables: a ``BlockTables`` (either twin).
    """

    def __init__(self, block_allocator, block_tables) -> None:
        self.block_allocator = block_allocator
        self.block_tables = block_tables
        self.block_size = block_allocator.block_size
        self.enable_prefix_caching = block_allocator.enable_prefix_caching
        # request id -> chained hashes of its full blocks computed so far.
        self.req_to_block_hashes: dict[str, list[int]] = {}
        # request id -> how many of its leading blocks are already in the cache.
        self.num_cached_blocks: dict[str, int] = {}

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """Prefix-cache hit for a request being admitted: (block ids, computed tokens).

        Does not take the blocks yet; :meth:`allocate_slots` does, if the
        request is admitted.
        """
        # BEGIN SOLUTION
        if not self.enable_prefix_caching:
            return [], 0
        block_hashes = hash_request_tokens(self.block_size, request.all_token_ids)
        self.req_to_block_hashes[request.request_id] = block_hashes
        # At least one token must be left to compute: use at most this many blocks.
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        hits = self.block_allocator.lookup_cached_blocks(block_hashes[:max_hit_blocks])
        return hits, len(hits) * self.block_size
        # END SOLUTION

    def allocate_slots(
        self, request: Request, num_new_tokens: int, new_computed_blocks: Sequence[int] = ()
    ) -> list[int] | None:
        """Blocks for ``num_new_tokens`` more tokens; None if the pool is too small now.

        Args:
            request: its ``num_computed_tokens`` tokens already have blocks.
            num_new_tokens: tokens to compute this step.
            new_computed_blocks: prefix-cache hits from :meth:`get_computed_blocks`
                (admission only); they come first in the request's table.

        Returns the newly allocated block ids (possibly empty), or None, in
        which case nothing changed.
        """
        # BEGIN SOLUTION
        req_id = request.request_id
        allocator = self.block_allocator
        is_new = not self._has_table(req_id)
        old_blocks = [] if is_new else self.block_tables.get_block_ids(req_id)
        num_computed = request.num_computed_tokens + len(new_computed_blocks) * self.block_size
        num_total_tokens = num_computed + num_new_tokens
        num_blocks_needed = cdiv(num_total_tokens, self.block_size)
        num_new_blocks = max(0, num_blocks_needed - len(old_blocks) - len(new_computed_blocks))
        # A cache hit on a free block takes it out of the free pool too.
        num_evictable_hits = sum(1 for b in new_computed_blocks if allocator.ref_count(b) == 0)
        if num_new_blocks + num_evictable_hits > allocator.num_free_blocks:
            return None

        allocator.touch(new_computed_blocks)
        new_blocks = allocator.allocate(num_new_blocks)
        if is_new:
            self.block_tables.add_request(req_id)
            self.num_cached_blocks[req_id] = len(new_computed_blocks)
        self.block_tables.append_blocks(req_id, list(new_computed_blocks) + new_blocks)
        self._cache_full_blocks(request, num_total_tokens)
        return new_blocks
        # END SOLUTION

    def free(self, request: Request) -> None:
        """Release all of ``request``'s blocks (last first, so they are evicted first)."""
        # BEGIN SOLUTION
        req_id = request.request_id
        if self._has_table(req_id):
            blocks = self.block_tables.get_block_ids(req_id)
            self.block_allocator.free(reversed(blocks))
            self.block_tables.remove_request(req_id)
        self.req_to_block_hashes.pop(req_id, None)
        self.num_cached_blocks.pop(req_id, None)
        # END SOLUTION

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's blocks in logical order ([] if it holds none)."""
        if not self._has_table(request_id):
            return []
        return self.block_tables.get_block_ids(request_id)

    def _cache_full_blocks(self, request: Request, num_total_tokens: int) -> None:
        """Enter the request's newly full blocks (tokens known after this step) in the cache."""
        # BEGIN SOLUTION
        if not self.enable_prefix_caching:
            return
        req_id = request.request_id
        num_full_blocks = num_total_tokens // self.block_size
        num_cached = self.num_cached_blocks[req_id]
        if num_full_blocks <= num_cached:
            return
        block_hashes = self.req_to_block_hashes.setdefault(req_id, [])
        blocks = self.block_tables.get_block_ids(req_id)
        bs = self.block_size
        for i in range(num_cached, num_full_blocks):
            if i == len(block_hashes):  # a block of generated tokens: hash it now
                parent = block_hashes[i - 1] if i > 0 else None
                tokens = request.all_token_ids[i * bs : (i + 1) * bs]
                block_hashes.append(hash_block_tokens(parent, tokens))
            self.block_allocator.cache_full_block(blocks[i], block_hashes[i])
        self.num_cached_blocks[req_id] = num_full_blocks
        # END SOLUTION

    def _has_table(self, req_id: str) -> bool:
        return req_id in self.num_cached_blocks
