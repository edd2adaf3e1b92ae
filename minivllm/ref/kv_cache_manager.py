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

Sharing by fork (parallel sampling, beam search; PagedAttention section 4.4),
which needs nothing from a request that never forks:

- :meth:`fork`: a child request takes the parent's blocks by reference (each
  block's reference count + 1), so a prompt prefilled once serves ``n``
  completions, and a surviving beam branches without copying its history.
- **Copy-on-write** in :meth:`allocate_slots`: a step never writes into a
  block that another request holds. If a block the step writes is shared
  (reference count > 1), the request gets a fresh block in its place and the
  copy ``(src, dst)`` is recorded; the worker must copy those blocks (every
  layer's K and V, ``copy_blocks`` of the ``cache_write`` component) before the
  step's forward writes the cache. Only the partial last block is ever
  shared *and* written: full blocks hold final tokens and are never written
  again, which is also why prefix caching (sharing by hash) needs no copies.
- :meth:`take_blocks_to_copy` and :meth:`take_req_ids_to_refresh`: what the
  scheduler drains once per step, after its allocations: the step's copies,
  and the requests whose block list changed other than by appending (a block
  replaced by its copy), whose row in the worker's block table must be
  rebuilt from :meth:`get_block_ids`.

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
        # Sharing by fork: the requests that took part in a fork (only they can hold a
        # shared block that a step writes), this step's copies (src, dst), the blocks
        # those copies keep from the free queue until they are taken, and the requests
        # whose block list changed other than by appending (a dict: an ordered set).
        self.forked_req_ids: set[str] = set()
        self.blocks_to_copy: list[tuple[int, int]] = []
        self.blocks_held_for_copies: list[int] = []
        self.req_ids_to_refresh: dict[str, None] = {}

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """Prefix-cache hit for a request being admitted: (block ids, computed tokens).

        Does not take the blocks yet; :meth:`allocate_slots` does, if the
        request is admitted. A request with ``skip_reading_prefix_cache`` (it
        wants prompt logprobs: logits at every prompt position) gets no hit.
        """
        if getattr(request, "skip_reading_prefix_cache", False):
            return [], 0
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

        Copy-on-write: a block this step writes (a token or lookahead slot of
        positions ``num_computed_tokens ..``) that another request also holds
        (:meth:`_shared_blocks_written`, after a :meth:`fork`) needs a fresh
        block of its own too, and :meth:`_copy_on_write` swaps it in. Nothing
        is shared, and so nothing copied, unless some request was forked.

        Returns the newly allocated block ids appended to the request's list
        (possibly empty; neither the prefix hits nor copy-on-write blocks are
        among them), or None, in which case nothing changed.
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
        # Shared blocks this step would write need a block each for their copy.
        shared = self._shared_blocks_written(request, num_computed,
                                             num_total_tokens + num_lookahead_tokens)
        if num_new_blocks + num_evictable_hits + len(shared) > allocator.num_free_blocks:
            return None

        allocator.touch(new_computed_blocks)
        self._copy_on_write(request, shared)
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
        A block shared with another request (a fork, a prefix-cache hit) stays
        with it: only its reference count drops.
        """
        self._hold_blocks_for_copies(request)
        self.forked_req_ids.discard(request.request_id)
        self.req_ids_to_refresh.pop(request.request_id, None)
        # BEGIN SOLUTION
        blocks = self.req_to_blocks.pop(request.request_id, None)
        if blocks is not None:
            self.block_allocator.free(reversed(blocks))
            del self.num_cached_blocks[request.request_id]
        # END SOLUTION

    def get_block_ids(self, request_id: str) -> list[int]:
        """A copy of the request's blocks in logical order ([] if it holds none)."""
        return list(self.req_to_blocks.get(request_id, ()))

    # -- sharing by fork: parallel sampling and beam search -------------------------

    def fork(self, parent: Request, child: Request) -> None:
        """Give ``child`` all of ``parent``'s blocks, shared: each block's reference count + 1.

        Nothing is copied now: the first step that writes into a shared block
        copies it (copy-on-write, :meth:`allocate_slots`). Sharing is by
        reference, not by hash, so it works with prefix caching on or off.

        The child holds no blocks yet, has the parent's ``num_computed_tokens``
        and the parent's tokens up to there (what the shared blocks hold); its
        later tokens may differ (its own sampled token). Call it between
        steps, e.g. after the step that computed the parent's prompt (parallel
        sampling) or its last token (a beam that branches), never between
        ``schedule()`` and that step's forward. ``ValueError`` otherwise.
        """
        parent_id, child_id = parent.request_id, child.request_id
        if parent_id not in self.req_to_blocks:
            raise ValueError(f"parent {parent_id!r} holds no blocks to fork")
        if child_id in self.req_to_blocks:
            raise ValueError(f"child {child_id!r} already holds blocks")
        n = parent.num_computed_tokens
        if child.num_computed_tokens != n or child.all_token_ids[:n] != parent.all_token_ids[:n]:
            raise ValueError(
                f"child {child_id!r} must have the parent's num_computed_tokens ({n}) and its "
                f"tokens up to there, got num_computed_tokens={child.num_computed_tokens}")
        self.forked_req_ids.update((parent_id, child_id))
        # BEGIN SOLUTION
        blocks = self.req_to_blocks[parent_id]
        self.block_allocator.touch(blocks)  # one more holder each: the child
        self.req_to_blocks[child_id] = list(blocks)  # its own list: it will diverge
        self.num_cached_blocks[child_id] = self.num_cached_blocks[parent_id]
        # The hashes of the full blocks both hold are the same: no need to hash them again.
        hashes = child.block_hashes
        hashes.extend(parent.block_hashes[len(hashes) : n // self.block_size])
        # END SOLUTION

    def take_blocks_to_copy(self) -> list[tuple[int, int]]:
        """This step's copy-on-write copies, ``(src, dst)`` block pairs; then forget them.

        The scheduler calls it once per step, after its last
        :meth:`allocate_slots`, and sends the pairs to every worker, which
        copies each layer's K and V block ``src`` -> ``dst``
        (``cache_write.copy_blocks``) *before* the step's
        forward writes the cache. Each ``dst`` is a fresh block, distinct, and
        never a ``src`` of the same step; a ``src`` may repeat (siblings copying
        one shared block). Blocks kept for the copies when their request was
        freed in this step (:meth:`free`) go back to the pool now. Always empty
        unless a request was forked.
        """
        copies, self.blocks_to_copy = self.blocks_to_copy, []
        held, self.blocks_held_for_copies = self.blocks_held_for_copies, []
        self.block_allocator.free(reversed(held))
        return copies

    def take_req_ids_to_refresh(self) -> list[str]:
        """Requests whose block list changed other than by appending, since the last call.

        A copy-on-write replaces a block in the middle of a request's list, so
        the blocks :meth:`allocate_slots` returns (appended at the end: what
        ``SchedulerOutput.new_block_ids`` carries) do not describe it. For each
        id here the scheduler sends the whole list (:meth:`get_block_ids`) and
        the worker rebuilds the request's block-table row from it, as for a new
        request. Then forgets them; always empty unless a request was forked.
        """
        req_ids = list(self.req_ids_to_refresh)
        self.req_ids_to_refresh.clear()
        return req_ids

    def _shared_blocks_written(self, request: Request, start: int, end: int) -> list[int]:
        """Indices (in ``request``'s block list) of the shared blocks that positions
        ``start .. end - 1`` lie in: held blocks that another request holds too
        (reference count > 1). A step that writes those positions copies them first.
        """
        blocks = self.req_to_blocks.get(request.request_id)
        if blocks is None or request.request_id not in self.forked_req_ids:
            return []  # without a fork only full (prefix-cache) blocks are shared: never written
        # BEGIN SOLUTION
        if start >= end:
            return []
        first, last = start // self.block_size, min(len(blocks), cdiv(end, self.block_size))
        return [i for i in range(first, last) if self.block_allocator.ref_count(blocks[i]) > 1]
        # END SOLUTION

    def _copy_on_write(self, request: Request, indices: list[int]) -> None:
        """Give ``request`` a fresh block in place of each shared block at ``indices``.

        The caller has checked that the pool has a free block for each. The
        shared block loses this request's reference (its other holders keep
        it, unchanged); the fresh one must receive its K/V before the step
        writes into it, so the pair ``(shared, fresh)`` joins
        :attr:`blocks_to_copy`, and the request joins
        :attr:`req_ids_to_refresh` (its list changed in the middle).
        """
        if not indices:
            return
        # BEGIN SOLUTION
        blocks = self.req_to_blocks[request.request_id]
        fresh = self.block_allocator.allocate(len(indices))
        for i, new in zip(indices, fresh):
            old = blocks[i]
            blocks[i] = new
            self.block_allocator.free([old])  # its other holders keep it
            self.blocks_to_copy.append((old, new))
        self.req_ids_to_refresh[request.request_id] = None
        # END SOLUTION

    def _hold_blocks_for_copies(self, request: Request) -> None:
        """Before ``request`` frees its blocks: keep one reference on each of them that
        a copy not yet taken reads or writes, until :meth:`take_blocks_to_copy`.

        Without it a block freed here could be handed out again in the same step
        (the pool is short: a sibling's copy was recorded, then this request was
        preempted), as another copy's destination or a block someone writes,
        before its copy has run.
        """
        if not self.blocks_to_copy:
            return
        in_copies = {b for pair in self.blocks_to_copy for b in pair}
        held = [b for b in self.req_to_blocks.get(request.request_id, ()) if b in in_copies]
        self.block_allocator.touch(held)
        self.blocks_held_for_copies.extend(held)

    def _block_hashes(self, request: Request, num_full_blocks: int) -> list[int]:
        """``request.block_hashes``, extended to cover its first ``num_full_blocks`` blocks."""
        # BEGIN SOLUTION
        hashes = request.block_hashes
        bs, tokens = self.block_size, request.all_token_ids
        for i in range(len(hashes), num_full_blocks):
            parent = hashes[i - 1] if i > 0 else request.root_block_hash
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
