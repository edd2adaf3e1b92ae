"""The continuous-batching scheduler (vLLM v1 style), readable version.

Each engine step the scheduler decides which requests run and how many of
their tokens are computed, under two limits: a *token budget*
(``max_num_batched_tokens``: prefill chunks and decodes together) and a cap on
running requests (``max_num_seqs``). There is no separate "prefill phase" and
"decode phase": a request just has ``num_tokens - num_computed_tokens`` tokens
left to compute, which is its whole prompt when it arrives and 1 when it is
decoding. One step (:meth:`Scheduler.schedule`):

1. **Running requests first**, in order. Each gets
   ``min(tokens left, budget left)`` tokens: a decode gets 1, a long prompt
   continues its chunk. If the pool has no block for it, the most recently
   admitted running request (the tail of ``running``) is **preempted**: its
   blocks are freed, it will recompute everything later, and it goes to the
   *front* of the waiting queue. If the tail is the request itself, it
   preempts itself and the step stops scheduling running requests.
2. **Then waiting requests**, first come first served, unless something was
   preempted this step (the pool is short; admitting more would just thrash).
   On admission the prefix cache is consulted; a prompt longer than the budget
   left is split (**chunked prefill**); the first request that does not fit
   stops admission (no skipping ahead, so nobody starves).

**LoRA slots** (``SchedulerConfig.max_loras``, vLLM's rule). A step can serve
only the adapters in the device's ``max_loras`` slots, so the running requests
hold at most that many distinct adapters. A waiting request whose adapter would
be one too many (:meth:`Scheduler._has_lora_slot`) is skipped: it keeps its
place at the head of the queue, the requests behind it may be admitted, and it
is admitted once a running request's finish or preemption frees a slot.

**Scheduling policy** (``SchedulerConfig.policy``, vLLM's ``--scheduling-policy``).
Under ``"fcfs"`` (the default) ``waiting`` is a deque and the victim of a
preemption is the tail of ``running``, as above. Under ``"priority"`` ``waiting``
is a :class:`~minivllm.request_queue.PriorityWaitingQueue`, which keeps requests ordered by
``(priority, arrival_time)`` (lower first): where the deque would put a request
at its front or its back, it puts it in its place, so :meth:`Scheduler.schedule`
reads the same. The victim is then the running request with the largest
``(priority, arrival_time)`` (:meth:`Scheduler._priority_victim`); if it was
scheduled earlier in this step, that is undone (its tokens go back to the
budget). As in vLLM v1, a waiting request never preempts a running one: priority
orders admission, and decides who gives way when the pool runs short.

After the forward pass, :meth:`Scheduler.update_from_output` advances
``num_computed_tokens``, appends sampled tokens, applies stop rules and frees
finished requests' blocks (their full blocks stay in the prefix cache).

**Speculative decoding** adds one thing to a running decode: its draft tokens
(``request.spec_token_ids``, proposed after the last step) are scheduled with
its last sampled token, ``1 + d`` query tokens against the same budget (drafts
that do not fit are dropped), and become the step's
``scheduled_spec_decode_tokens``. Afterwards ``num_computed_tokens`` moves back
over the drafts that were rejected: their K/V slots stay allocated and are
simply overwritten by a later step. A preempted request loses its drafts.

**Requests in flight** (pipeline parallelism keeps up to
``pipeline_parallel_size`` steps in flight): :meth:`Scheduler.schedule` takes
the ids of the requests whose step has not come back yet (``in_flight``,
keyword-only). They are left out: neither scheduled again (their next token
is not known yet) nor preempted (a step in flight is using their blocks);
they still count against ``max_num_seqs``. The engine passes it only with a
pipeline, so a scheduler written without it still serves every other engine.

A request that could never fit (longer than ``max_model_len``, or needing
more blocks than the whole pool) is rejected by :meth:`add_request`, so the
loop above always makes progress: alone, any request fits.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection, Iterable

from minivllm import backend
from minivllm.config import CacheConfig, SchedulerConfig, cdiv
from minivllm.metadata import SchedulerOutput
from minivllm.request import Request, RequestStatus, check_stop
from minivllm.request_queue import PriorityWaitingQueue
from minivllm.scheduler_groups import GroupScheduling

__all__ = ["Scheduler"]


class Scheduler(GroupScheduling):
    """Continuous batching with chunked prefill, prefix caching and preemption.

    Args:
        scheduler_config: budget, ``max_num_seqs``, ``max_model_len``, chunking.
        cache_config: ``num_blocks`` (the pool), ``block_size``, prefix caching.
        kv_cache_manager_cls: the ``KVCacheManager`` class to build on the
            block allocator; None takes ``components.kv_cache_manager``'s.
        components: the engine's :class:`~minivllm.backend.Components`, which
            provide the block allocator and the KV cache manager; None
            resolves the global backend spec once, here (tests build
            schedulers directly).

    The scheduler holds no block *table*: each step it reports the block ids it
    handed out (``SchedulerOutput.new_block_ids``), and the worker that owns
    the table on the model's device applies them.
    """

    #: The ``priority`` policy's waiting queue (the fast twin's is a heap).
    priority_queue_cls = PriorityWaitingQueue

    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        kv_cache_manager_cls: type | None = None,
        components: backend.Components | None = None,
    ) -> None:
        if cache_config.num_blocks < 1:
            raise ValueError(f"cache_config.num_blocks must be >= 1, got {cache_config.num_blocks}")
        self.scheduler_config = scheduler_config
        self.cache_config = cache_config
        self.max_model_len = scheduler_config.max_model_len
        self.block_size = cache_config.block_size
        components = backend.as_components(components)
        self.block_allocator = components.block_allocator.BlockAllocator(
            cache_config.num_blocks, cache_config.block_size, cache_config.enable_prefix_caching
        )
        if kv_cache_manager_cls is None:
            kv_cache_manager_cls = components.kv_cache_manager.KVCacheManager
        self.kv_cache_manager = kv_cache_manager_cls(self.block_allocator)
        self.requests: dict[str, Request] = {}  # every unfinished request, by id
        # fcfs: a deque; priority: ordered by (priority, arrival_time) (see the module docstring)
        self.waiting: deque[Request] = deque() if scheduler_config.policy == "fcfs" \
            else self.priority_queue_cls()
        self.running: list[Request] = []  # in admission order: the tail is preempted first
        self.finished_req_ids: list[str] = []  # finished since the last schedule()

    # -- adding and removing requests ---------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue ``request`` (first come, first served), or raise ``ValueError`` if it can't run.

        Fills in ``request.max_tokens`` when it is None (up to ``max_model_len``).
        """
        req_id = request.request_id
        prompt_len = request.num_prompt_tokens
        if req_id in self.requests:
            raise ValueError(f"request_id {req_id!r} is already in the scheduler")
        if prompt_len == 0:
            raise ValueError(f"request {req_id!r}: the prompt must have at least 1 token")
        max_tokens = request.max_tokens
        if max_tokens is None:
            max_tokens = self.max_model_len - prompt_len
            if max_tokens < 1:
                raise ValueError(
                    f"request {req_id!r}: prompt of {prompt_len} tokens leaves no room to "
                    f"generate within max_model_len={self.max_model_len}"
                )
        if prompt_len + max_tokens > self.max_model_len:
            raise ValueError(
                f"request {req_id!r}: prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) "
                f"must be <= max_model_len={self.max_model_len}"
            )
        num_blocks_needed = cdiv(prompt_len + max_tokens
                                 + self.scheduler_config.num_lookahead_tokens, self.block_size)
        if num_blocks_needed > self.cache_config.num_blocks:
            raise ValueError(
                f"request {req_id!r}: prompt + max_tokens = {prompt_len + max_tokens} tokens "
                f"need {num_blocks_needed} KV blocks of {self.block_size}, but the whole pool "
                f"has num_blocks={self.cache_config.num_blocks}"
            )
        request.max_tokens = max_tokens
        request.status = RequestStatus.WAITING
        self.requests[req_id] = request
        self.waiting.append(request)

    def finish_requests(
        self, request_ids: str | Iterable[str], finished_status: RequestStatus
    ) -> None:
        """End requests now (an abort, or a stop string the engine found); ignore unknown ids."""
        if not RequestStatus.is_finished(finished_status):
            raise ValueError(
                f"finished_status must be a FINISHED_* status, got {finished_status!r}"
            )
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        for req_id in request_ids:
            request = self.requests.get(req_id)
            if request is None:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            request.status = finished_status
            self._free_request(request)

    def _free_request(self, request: Request) -> None:
        """Forget a finished request: its blocks go back to the pool (cached ones stay cached)."""
        self.kv_cache_manager.free(request)
        del self.requests[request.request_id]
        self.finished_req_ids.append(request.request_id)

    # -- one step -----------------------------------------------------------------------

    def schedule(self, *, in_flight: Collection[str] = frozenset()) -> SchedulerOutput:
        """Decide this step's batch; see the module docstring for the rules.

        ``in_flight``: ids of running requests whose previous step has not come
        back yet; they are neither scheduled nor preempted.

        Returns a new :class:`SchedulerOutput`, built in one call with every
        field as a keyword: it is frozen (its containers are made immutable and
        each scheduled request is snapshotted), so it cannot be filled in after.
        """
        # BEGIN SOLUTION
        token_budget = self.scheduler_config.max_num_batched_tokens
        scheduled_running: list[Request] = []
        scheduled_new: list[Request] = []
        num_scheduled_tokens: dict[str, int] = {}
        new_block_ids: dict[str, list[int]] = {}  # what each scheduled request's table gains
        preempted_req_ids: list[str] = []
        scheduled_spec_decode_tokens: dict[str, list[int]] = {}
        num_cache_queries = num_cache_hits = 0

        # 1. Running requests, in order.
        req_index = 0
        while req_index < len(self.running) and token_budget > 0:
            request = self.running[req_index]
            if request.request_id in in_flight:  # its step is still in the pipeline
                req_index += 1
                continue
            # A decode with drafts computes its last token plus the drafts that fit.
            num_new_tokens = min(request.num_tokens_with_spec - request.num_computed_tokens,
                                 token_budget)
            if num_new_tokens == 0:  # nothing to compute until a token is sampled
                req_index += 1
                continue
            num_lookahead = min(self.scheduler_config.num_lookahead_tokens, self.max_model_len
                                - request.num_computed_tokens - num_new_tokens)
            # Keyword-only, and passed only when used (a draft model): a KV cache manager
            # written without num_lookahead_tokens still serves every other engine.
            lookahead = {"num_lookahead_tokens": num_lookahead} if num_lookahead > 0 else {}
            while True:
                new_blocks = self.kv_cache_manager.allocate_slots(
                    request, num_new_tokens, **lookahead)
                if new_blocks is not None:
                    break
                # The most recently admitted request that is not in flight (at worst
                # the request itself).
                victim = next(r for r in reversed(self.running)
                              if r.request_id not in in_flight)
                if self.scheduler_config.policy == "priority":
                    victim = self._priority_victim(in_flight)
                    if victim in scheduled_running:  # scheduled earlier this step: undo
                        scheduled_running.remove(victim)
                        token_budget += num_scheduled_tokens.pop(victim.request_id)
                        new_block_ids.pop(victim.request_id)
                        scheduled_spec_decode_tokens.pop(victim.request_id, None)
                        req_index -= 1
                self.running.remove(victim)
                self._preempt(victim)
                preempted_req_ids.append(victim.request_id)
                if victim is request:
                    break
            if request.status == RequestStatus.PREEMPTED:
                break  # it preempted itself: no blocks left for anyone behind it
            num_drafts = request.num_computed_tokens + num_new_tokens - request.num_tokens
            if num_drafts > 0:
                scheduled_spec_decode_tokens[request.request_id] = \
                    request.spec_token_ids[:num_drafts]
            request.spec_token_ids = []  # scheduled (or dropped): the next step proposes anew
            scheduled_running.append(request)
            num_scheduled_tokens[request.request_id] = num_new_tokens
            new_block_ids[request.request_id] = new_blocks
            token_budget -= num_new_tokens
            req_index += 1

        # 2. Waiting requests, first come first served, if nothing was preempted.
        skipped: list[Request] = []  # their adapter has no slot: they keep their place
        while self.waiting and token_budget > 0 and not preempted_req_ids:
            if len(self.running) >= self.scheduler_config.max_num_seqs:
                break
            request = self.waiting[0]
            if not self._has_lora_slot(request):
                skipped.append(self.waiting.popleft())
                continue
            computed_blocks, num_computed_tokens = self.kv_cache_manager.get_computed_blocks(
                request
            )
            num_new_tokens = request.num_tokens - num_computed_tokens
            if num_new_tokens > token_budget:
                if not self.scheduler_config.enable_chunked_prefill:
                    break  # the whole prompt must fit in one step
                num_new_tokens = token_budget
            num_lookahead = min(self.scheduler_config.num_lookahead_tokens,
                                self.max_model_len - num_computed_tokens - num_new_tokens)
            lookahead = {"num_lookahead_tokens": num_lookahead} if num_lookahead > 0 else {}
            if self.kv_cache_manager.allocate_slots(
                request, num_new_tokens, computed_blocks, **lookahead
            ) is None:
                break  # the pool is full: later requests wait their turn too
            self.waiting.popleft()
            self.running.append(request)
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_computed_tokens
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_computed_tokens
            num_cache_queries += request.num_tokens
            num_cache_hits += num_computed_tokens
            scheduled_new.append(request)
            num_scheduled_tokens[request.request_id] = num_new_tokens
            # A new row in the worker's table: all its blocks, prefix-cache hits first.
            new_block_ids[request.request_id] = self.kv_cache_manager.get_block_ids(
                request.request_id)
            token_budget -= num_new_tokens
        self.waiting.extendleft(reversed(skipped))

        output = SchedulerOutput(
            scheduled_requests=scheduled_running + scheduled_new,
            num_scheduled_tokens=num_scheduled_tokens,
            total_num_scheduled_tokens=sum(num_scheduled_tokens.values()),
            preempted_req_ids=preempted_req_ids,
            finished_req_ids=self.finished_req_ids,
            new_req_ids=[r.request_id for r in scheduled_new],
            new_block_ids=new_block_ids,
            scheduled_spec_decode_tokens=scheduled_spec_decode_tokens,
            num_prefix_cache_queries=num_cache_queries,
            num_prefix_cache_hits=num_cache_hits,
        )
        self.finished_req_ids = []
        return output
        # END SOLUTION

    def _has_lora_slot(self, request: Request) -> bool:
        """Whether ``request`` may start now under ``SchedulerConfig.max_loras``: it has no
        adapter, or its adapter is already among the running requests', or those hold
        fewer than ``max_loras`` distinct adapters (vLLM's admission rule)."""
        max_loras = self.scheduler_config.max_loras
        if request.lora_request is None or max_loras is None:
            return True
        running = {r.lora_request.lora_int_id for r in self.running
                   if r.lora_request is not None}
        return request.lora_request.lora_int_id in running or len(running) < max_loras

    def _priority_victim(self, in_flight: Collection[str]) -> Request:
        """Under the ``priority`` policy, the running request to preempt when the pool is
        short: the one with the largest ``(priority, arrival_time)`` (vLLM's rule; on a
        tie, the earliest in ``running``), never one in flight. It may have been
        scheduled earlier in this step (the caller then takes that back).
        """
        return max((r for r in self.running if r.request_id not in in_flight),
                   key=PriorityWaitingQueue.key)

    def _preempt(self, request: Request) -> None:
        """Free ``request``'s blocks and send it to the front of the queue to recompute.

        Its chained block hashes stay on the request (vLLM v1 does the same):
        re-admitted, it looks its prompt up in the prefix cache without
        hashing it again.
        """
        # BEGIN SOLUTION
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids = []  # a resumed request recomputes; it gets no drafts
        request.num_preemptions += 1
        self.waiting.appendleft(request)
        # END SOLUTION

    def update_from_output(
        self, scheduler_output: SchedulerOutput,
        sampled_token_ids: dict[str, int] | dict[str, list[int]],
    ) -> list[Request]:
        """Record a finished forward pass; return the requests that finished now.

        Args:
            scheduler_output: what :meth:`schedule` returned for this step.
            sampled_token_ids: request id -> the token sampled for it, or (with
                speculative decoding) the list of tokens it emitted: its
                accepted drafts and one more. The model runner samples only
                requests whose every token is computed after this step; tokens
                for any other request are ignored.

        Tokens are appended one at a time and the stop rules checked after
        each, so a stop inside an accepted run ends the request exactly where
        plain decoding would, and the tokens after it are dropped. Reads, and
        never changes, ``scheduler_output`` (frozen) and ``sampled_token_ids``;
        a request aborted since :meth:`schedule` is skipped.
        """
        # BEGIN SOLUTION
        finished = []
        for request in scheduler_output.scheduled_requests:
            req_id = request.request_id
            if self.requests.get(req_id) is not request:
                continue  # aborted since schedule()
            request.num_computed_tokens += scheduler_output.num_scheduled_tokens[req_id]
            token_ids = sampled_token_ids.get(req_id)
            if token_ids is None or request.num_computed_tokens < request.num_tokens:
                continue  # a prefill chunk that is not the last one
            if isinstance(token_ids, int):
                token_ids = [token_ids]
            # Rejected drafts were computed in vain: roll back over them (their
            # slots stay allocated and a later step overwrites them).
            num_drafts = len(scheduler_output.scheduled_spec_decode_tokens.get(req_id, ()))
            request.num_computed_tokens -= num_drafts + 1 - len(token_ids)
            for token_id in token_ids:
                request.append_output_token_ids(token_id)
                if check_stop(request, self.max_model_len):
                    self._free_request(request)
                    finished.append(request)
                    break
        self._remove_from_running(finished)
        return finished
        # END SOLUTION

    def _remove_from_running(self, finished: list[Request]) -> None:
        """Take requests that finished this step out of ``running``, keeping its order.

        The one thing the fast twin changes (one pass instead of one
        ``list.remove`` per finished request).
        """
        for request in finished:
            self.running.remove(request)

    # -- queries ------------------------------------------------------------------------

    def has_unfinished_requests(self) -> bool:
        """True while any request is waiting or running."""
        return len(self.waiting) + len(self.running) > 0

    def get_num_unfinished_requests(self) -> int:
        """Number of requests waiting or running."""
        return len(self.waiting) + len(self.running)

    def get_block_ids(self, request_id: str) -> list[int]:
        """The KV blocks ``request_id`` holds now, in logical order ([] if none)."""
        return self.kv_cache_manager.get_block_ids(request_id)

    @property
    def num_free_blocks(self) -> int:
        """Free blocks in the pool (cached-but-unused blocks count as free)."""
        return self.block_allocator.num_free_blocks

    def reset_prefix_cache(self) -> bool:
        """Drop every cached block hash; only possible when no request holds blocks."""
        return self.block_allocator.reset_prefix_cache()
