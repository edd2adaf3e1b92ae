"""``KVCacheManager``: a request's view of the block pool, readable version.

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

Who records what:

- this class keeps each request's block ids as a plain list (the host-side
  record the scheduler decides with); the allocator holds the reference
  counts;
- the *device-side* block table is not here: the worker owns it and updates
  it from the block ids the scheduler sends each step
  (``SchedulerOutput.new_block_ids``), as in vLLM v1;
- a request's chained block hashes live on the request
  (``Request.block_hashes``), so they survive a preemption: vLLM v1 does the
  same, and a resumed request is not re-hashed from its first token. They
  are computed lazily, one block at a time, when a block is first needed.
"""

from __future__ import annotations

from collections.abc import Sequence

from minivllm.config import cdiv
from minivllm.prefix_hash import hash_block_tokens
from minivllm.request import Request

__all__ = ["KVCacheManager"]


class KVCacheManager:
    """Blocks for requests, in tokens, on top of a block allocator.

    Args:
        block_allocator: a ``BlockAllocator`` (either twin).
    """

    def __init__(self, block_allocator) -> None:
        self.block_allocator = block_allocator
        self.block_size = block_allocator.block_size
        self.enable_prefix_caching = block_allocator.enable_prefix_caching
        # request id -> its block ids, logical block 0 first (only requests holding blocks).
        self.req_to_blocks: dict[str, list[int]] = {}
        # request id -> how many of its leading blocks are already in the prefix cache.
        self.num_cached_blocks: dict[str, int] = {}

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """Prefix-cache hit for a request being admitted: (block ids, computed tokens).

        Does not take the blocks yet; :meth:`allocate_slots` does, if the
        request is admitted.
        """
        # BEGIN SOLUTION
        if not self.enable_prefix_caching:
            return [], 0
        block_hashes = self._block_hashes(request, request.num_tokens // self.block_size)
        # At least one token must be left to compute: use at most this many blocks.
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        hits = self.block_allocator.lookup_cached_blocks(block_hashes[:max_hit_blocks])
        return hits, len(hits) * self.block_size
        # END SOLUTION

    def allocate_slots(
        self, request: Request, num_new_tokens: int, new_computed_blocks: Sequence[int] = (),
        *, num_lookahead_tokens: int = 0,
    ) -> list[int] | None:
        """Blocks for ``num_new_tokens`` more tokens; None if the pool is too small now.

        Args:
            request: its ``num_computed_tokens`` tokens already have blocks.
            num_new_tokens: tokens to compute this step (with speculative
                decoding: its last sampled token plus its drafts).
            new_computed_blocks: prefix-cache hits from :meth:`get_computed_blocks`
                (admission only); they come first in the request's blocks.
            num_lookahead_tokens: (keyword-only, as in vLLM) slots to reserve
                beyond those: where a draft model writes its drafts' K/V after
                the step. The scheduler passes it only when it is above 0, so a
                manager written without it still serves an engine without a
                draft model.

        Only final tokens enter the prefix cache: a block is cached once every
        token in it is in ``request.all_token_ids``, never while it holds a
        draft (which may be rejected) or a lookahead slot.

        Returns the newly allocated block ids (possibly empty; the prefix
        hits are not among them), or None, in which case nothing changed.
        """
        # BEGIN SOLUTION
        req_id = request.request_id
        allocator = self.block_allocator
        held = self.req_to_blocks.get(req_id, [])
        num_computed = request.num_computed_tokens + len(new_computed_blocks) * self.block_size
        num_total_tokens = num_computed + num_new_tokens
        num_blocks_needed = cdiv(num_total_tokens + num_lookahead_tokens, self.block_size)
        num_new_blocks = max(0, num_blocks_needed - len(held) - len(new_computed_blocks))
        # A cache hit on a free block takes it out of the free pool too.
        num_evictable_hits = sum(1 for b in new_computed_blocks if allocator.ref_count(b) == 0)
        if num_new_blocks + num_evictable_hits > allocator.num_free_blocks:
            return None

        allocator.touch(new_computed_blocks)
        new_blocks = allocator.allocate(num_new_blocks)
        if req_id not in self.req_to_blocks:
            self.req_to_blocks[req_id] = []
            self.num_cached_blocks[req_id] = len(new_computed_blocks)
        self.req_to_blocks[req_id].extend([*new_computed_blocks, *new_blocks])
        self._cache_full_blocks(request, min(num_total_tokens, request.num_tokens))
        return new_blocks
        # END SOLUTION

    def free(self, request: Request) -> None:
        """Release all of ``request``'s blocks (last first, so they are evicted first).

        Used for a finished request and for a preempted one alike; the
        request keeps its ``block_hashes`` either way (see the module docstring).
        """
        # BEGIN SOLUTION
        blocks = self.req_to_blocks.pop(request.request_id, None)
        if blocks is not None:
            self.block_allocator.free(reversed(blocks))
            del self.num_cached_blocks[request.request_id]
        # END SOLUTION

    def get_block_ids(self, request_id: str) -> list[int]:
        """A copy of the request's blocks in logical order ([] if it holds none)."""
        return list(self.req_to_blocks.get(request_id, ()))

    def _block_hashes(self, request: Request, num_full_blocks: int) -> list[int]:
        """``request.block_hashes``, extended to cover its first ``num_full_blocks`` blocks."""
        # BEGIN SOLUTION
        hashes = request.block_hashes
        bs, tokens = self.block_size, request.all_token_ids
        for i in range(len(hashes), num_full_blocks):
            parent = hashes[i - 1] if i > 0 else None
            hashes.append(hash_block_tokens(parent, tokens[i * bs : (i + 1) * bs]))
        return hashes
        # END SOLUTION

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
        hashes = self._block_hashes(request, num_full_blocks)
        blocks = self.req_to_blocks[req_id]
        for i in range(num_cached, num_full_blocks):
            self.block_allocator.cache_full_block(blocks[i], hashes[i])
        self.num_cached_blocks[req_id] = num_full_blocks
        # END SOLUTION
