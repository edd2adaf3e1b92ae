"""What the engine asks of a scheduler beyond the textbook loop: forks, requeues, drafts.

:class:`GroupScheduling` is a mixin of :class:`minivllm.ref.scheduler.Scheduler`
(and so of its fast twin): none of it is part of the course's scheduler task.
The engine calls these between steps for the requests of a parallel-sampling
group (``SamplingParams.n > 1``) and of a beam search
(:mod:`minivllm.engine.sequence_groups`), to hand over the drafts the worker
proposed (speculative decoding). (LoRA's ``max_loras`` is the textbook
loop's own admission rule.) It uses the
scheduler's ``running``, ``waiting``, ``requests``, ``finished_req_ids``,
``kv_cache_manager``, ``max_model_len``, ``scheduler_config`` and its
``_free_request`` / ``_remove_from_running`` hooks.
"""

from __future__ import annotations

from collections.abc import Iterable

from minivllm.request import Request, RequestStatus, check_stop


class GroupScheduling:
    """Forks (shared blocks), extensions, requeues, drafts and holds (see the module docstring)."""

    _new_rows: list[str]  # children forked since the last take_block_changes()

    def has_room(self, num_requests: int = 1) -> bool:
        """Whether ``num_requests`` more requests may run now (``max_num_seqs``)."""
        return len(self.running) + num_requests <= self.scheduler_config.max_num_seqs

    def fork_request(self, parent: Request, child: Request, token_ids: list[int]) -> bool:
        """Start ``child`` from ``parent``'s computed tokens, sharing its KV blocks.

        ``child`` holds the parent's tokens up to ``parent.num_computed_tokens``
        (what the shared blocks hold); it joins ``running`` at once, with no
        admission (its blocks are the parent's, one more reference each:
        ``KVCacheManager.fork``), and ``token_ids`` are appended to it. Its
        first step copies the shared block it writes (copy-on-write), and the
        workers rebuild its block-table row (:meth:`take_block_changes`).
        The caller checks :meth:`has_room` first. Returns True if a token ended
        it at once (its blocks are then freed).
        """
        child.num_computed_tokens = parent.num_computed_tokens
        self.kv_cache_manager.fork(parent, child)
        child.status = RequestStatus.RUNNING
        child.num_cached_tokens = max(parent.num_cached_tokens, 0)
        self.requests[child.request_id] = child
        self.running.append(child)
        self._new_rows = [*getattr(self, "_new_rows", ()), child.request_id]
        return self.extend_request(child, token_ids)

    def extend_request(self, request: Request, token_ids: list[int]) -> bool:
        """Append tokens chosen outside the sampler (a beam's next token, a forked child's
        first one), the stop rules after each; True if it finished (its blocks freed)."""
        if not self._append_until_stop(request, token_ids):
            return False
        self._free_request(request)
        self._remove_from_running([request])
        return True

    def add_continued(self, request: Request, token_ids: list[int]) -> bool:
        """Queue a group member the scheduler does not hold yet at the front of the queue,
        once ``token_ids`` (tokens chosen for it outside its own step: a sibling's first
        token, sampled from child 0's row) are appended, the stop rules after each. True if
        a token ended it: it is then never queued."""
        if self._append_until_stop(request, token_ids):
            return True
        self.requeue((), new_requests=[request])
        return False

    def _append_until_stop(self, request: Request, token_ids: list[int]) -> bool:
        """Append ``token_ids`` one at a time, the stop rules after each (what
        ``update_from_output`` does with sampled tokens); True if one ended it."""
        for token_id in token_ids:
            request.append_output_token_ids(token_id)
            if check_stop(request, self.max_model_len):
                return True
        return False

    def update_draft_token_ids(self, draft_token_ids: dict[str, list[int]]) -> None:
        """Speculative decoding: the drafts the worker proposed, for each request's next
        step (vLLM v1's name). A request that finished or left ``running`` meanwhile
        gets none (a resumed request recomputes first)."""
        for request_id, drafts in draft_token_ids.items():
            request = self.requests.get(request_id)
            if request is not None and request.status == RequestStatus.RUNNING:
                request.spec_token_ids = list(drafts)

    def requeue(self, request_ids: Iterable[str], *, to_front: bool = True,
                new_requests: Iterable[Request] = ()) -> None:
        """Send running requests back to the waiting queue, together and in their order.

        Each frees its blocks and will recompute everything, as a preempted
        request does: the engine requeues a beam search's running beams when
        one of them was preempted, or when its next beams find no room, so
        that a group is preempted as one unit and never holds blocks while it
        waits for a member. ``new_requests`` (members not in the scheduler
        yet) join them, after them. ``to_front``: at the head of the queue (a
        preemption), else at its tail (a group stepping aside for the others).
        Their workers' rows go away with the next step, as finished requests' do.
        """
        ids = set(request_ids)
        group = [r for r in self.running if r.request_id in ids]
        self.running = [r for r in self.running if r.request_id not in ids]
        for request in group:
            self.kv_cache_manager.free(request)
            request.status = RequestStatus.PREEMPTED
            request.num_computed_tokens = 0
            request.spec_token_ids = []
            request.num_preemptions += 1
            self.finished_req_ids.append(request.request_id)  # the workers drop the row
        for request in new_requests:
            request.num_computed_tokens = 0
            request.status = RequestStatus.WAITING
            self.requests[request.request_id] = request
            group.append(request)
        if to_front:
            self.waiting.extendleft(reversed(group))
        else:
            self.waiting.extend(group)

    def take_block_changes(self) -> tuple[list[tuple[int, int]], list[str]]:
        """What forks changed since the last call: the copies and the rows to rebuild.

        Call it once per step, right after :meth:`schedule`: the ``(src, dst)``
        copy-on-write copies the workers make before the forward, and the
        requests whose block-table row must be rebuilt whole (children forked
        since the last step, requests whose shared block was replaced by its
        copy). Both are empty unless a request forked.
        """
        copies = self.kv_cache_manager.take_blocks_to_copy()
        rows = [*getattr(self, "_new_rows", ()),
                *self.kv_cache_manager.take_req_ids_to_refresh()]
        self._new_rows = []
        return copies, list(dict.fromkeys(rows))
