"""``KVCacheManager`` with O(1) bookkeeping per step (used by the fast scheduler).

Same decisions as :mod:`minivllm.ref.kv_cache_manager` (read it first). What
is different, and why it is faster:

- Each request's block list is kept here as a Python list that is appended
  to in place. The ref asks the block tables for a fresh copy of it on every
  call, which costs O(blocks per request) per request per step.
- :meth:`allocate_slots` has a fast path for the common decode step: when the
  request's last block still has room and no block becomes full, it returns
  straight away without touching the allocator or the block tables.
- Chained block hashes are kept for the whole life of a request (across
  preemptions) and extended one block at a time, so a preempted request is
  not re-hashed from its first token when it is re-admitted.
"""

from __future__ import annotations

from collections.abc import Sequence

from minivllm.prefix_hash import hash_block_tokens
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
        self.req_to_blocks: dict[str, list[int]] = {}  # only requests holding blocks
        self.num_cached_blocks: dict[str, int] = {}
        # Kept until the request finishes, not just until it is preempted.
        self.req_to_block_hashes: dict[str, list[int]] = {}

    def _block_hashes(self, request: Request, num_full_blocks: int) -> list[int]:
        """The request's chained hashes, extended to cover ``num_full_blocks`` blocks."""
        hashes = self.req_to_block_hashes.setdefault(request.request_id, [])
        bs, tokens = self.block_size, request.all_token_ids
        for i in range(len(hashes), num_full_blocks):
            hashes.append(
                hash_block_tokens(hashes[i - 1] if i else None, tokens[i * bs : (i + 1) * bs])
            )
        return hashes

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """Prefix-cache hit for a request being admitted: (block ids, computed tokens)."""
        if not self.enable_prefix_caching:
            return [], 0
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        hashes = self._block_hashes(request, request.num_tokens // self.block_size)
        hits = self.block_allocator.lookup_cached_blocks(hashes[:max_hit_blocks])
        return hits, len(hits) * self.block_size

    def allocate_slots(
        self, request: Request, num_new_tokens: int, new_computed_blocks: Sequence[int] = ()
    ) -> list[int] | None:
        """Blocks for ``num_new_tokens`` more tokens; None if the pool is too small now."""
        req_id = request.request_id
        bs = self.block_size
        blocks = self.req_to_blocks.get(req_id)
        num_total_tokens = (
            request.num_computed_tokens + len(new_computed_blocks) * bs + num_new_tokens
        )
        if blocks is not None and not new_computed_blocks:
            # Fast path (most decodes): room left in the last block, no block fills up.
            if num_total_tokens <= len(blocks) * bs and (
                num_total_tokens // bs <= self.num_cached_blocks[req_id]
                or not self.enable_prefix_caching
            ):
                return []
        num_held = 0 if blocks is None else len(blocks)
        num_new_blocks = max(0, cdiv(num_total_tokens, bs) - num_held - len(new_computed_blocks))
        allocator = self.block_allocator
        num_evictable_hits = 0
        for b in new_computed_blocks:
            num_evictable_hits += allocator.ref_count(b) == 0
        if num_new_blocks + num_evictable_hits > allocator.num_free_blocks:
            return None

        allocator.touch(new_computed_blocks)
        new_blocks = allocator.allocate(num_new_blocks)
        if blocks is None:
            blocks = self.req_to_blocks[req_id] = []
            self.num_cached_blocks[req_id] = len(new_computed_blocks)
            self.block_tables.add_request(req_id)
        appended = [*new_computed_blocks, *new_blocks]
        blocks.extend(appended)
        self.block_tables.append_blocks(req_id, appended)
        self._cache_full_blocks(request, blocks, num_total_tokens)
        return new_blocks

    def free(self, request: Request) -> None:
        """Release all of ``request``'s blocks (last first, so they are evicted first)."""
        req_id = request.request_id
        blocks = self.req_to_blocks.pop(req_id, None)
        if blocks is not None:
            self.block_allocator.free(reversed(blocks))
            self.block_tables.remove_request(req_id)
            del self.num_cached_blocks[req_id]
        if request.is_finished():  # a preempted request keeps its hashes for later
            self.req_to_block_hashes.pop(req_id, None)

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's blocks in logical order ([] if it holds none)."""
        return list(self.req_to_blocks.get(request_id, ()))

    def _cache_full_blocks(self, request: Request, blocks: list[int], num_total_tokens: int):
        if not self.enable_prefix_caching:
            return
        req_id = request.request_id
        num_full_blocks = num_total_tokens // self.block_size
        num_cached = self.num_cached_blocks[req_id]
        if num_full_blocks <= num_cached:
            return
        hashes = self._block_hashes(request, num_full_blocks)
        for i in range(num_cached, num_full_blocks):
            self.block_allocator.cache_full_block(blocks[i], hashes[i])
        self.num_cached_blocks[req_id] = num_full_blocks
