"""The continuous-batching scheduler with cheaper bookkeeping (twin of the ref).

The scheduling *policy* (budget, order, chunked prefill, preemption, prefix
cache, rejection) is exactly :mod:`minivllm.ref.scheduler`'s; read that file
for it. This twin subclasses the ref and keeps its :meth:`schedule`
unchanged on purpose: the decision loop is a handful of integer comparisons
per request, and sharing the code is the surest way to make the same
decisions. It changes one thing:

- the ref's hook :meth:`_remove_from_running` (called at the end of
  ``update_from_output``) takes finished requests out of ``running`` in one
  pass, instead of ``list.remove`` per finished request (O(running) each, so
  O(running x finished) per step);
- under the ``priority`` policy, the waiting queue is a heap
  (:class:`HeapWaitingQueue`, O(log n) to add or pop) instead of the ref's sorted
  list (O(n) to insert): the same order, so the same decisions.

The rest of the speed comes from the twins the swap layer hands it: the fast
block allocator (O(1) free queue) and the fast KV cache manager (a decode
fast path that skips the allocator). That is what
``python -m minivllm.bench host`` measures.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterable, Iterator

from minivllm.ref import scheduler as _ref
from minivllm.request import Request, RequestStatus
from minivllm.request_queue import PriorityWaitingQueue

__all__ = ["Scheduler"]


class HeapWaitingQueue:
    """:class:`~minivllm.request_queue.PriorityWaitingQueue`'s order in a heap.

    Entries are ``(priority, arrival_time, seq, request)``: ``seq`` counts
    insertions, so equal keys keep their insertion order (the sorted list's
    ``insort_right``) and requests are never compared. ``remove`` is lazy: the
    request's live entry is forgotten and the heap drops stale entries when they
    reach the top, so every call is O(log n) amortised.
    """

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []
        self._live: dict[str, int] = {}  # request_id -> seq of its entry in the heap
        self._seq = itertools.count()

    def append(self, request: Request) -> None:
        seq = next(self._seq)
        self._live[request.request_id] = seq
        heapq.heappush(self._heap, (*PriorityWaitingQueue.key(request), seq, request))

    appendleft = append

    def extend(self, requests: Iterable[Request]) -> None:
        for request in requests:
            self.append(request)

    extendleft = extend

    def _drop_stale(self) -> None:
        while self._heap and self._live.get(self._heap[0][3].request_id) != self._heap[0][2]:
            heapq.heappop(self._heap)

    def popleft(self) -> Request:
        self._drop_stale()
        request = heapq.heappop(self._heap)[3]
        del self._live[request.request_id]
        return request

    def remove(self, request: Request) -> None:
        if request.request_id not in self._live:
            raise ValueError(f"request {request.request_id!r} is not waiting")
        del self._live[request.request_id]

    def __getitem__(self, index: int) -> Request:
        if index != 0:
            return list(self)[index]
        self._drop_stale()
        if not self._heap:
            raise IndexError("the waiting queue is empty")
        return self._heap[0][3]

    def __len__(self) -> int:
        return len(self._live)

    def __iter__(self) -> Iterator[Request]:
        live = [e for e in self._heap if self._live.get(e[3].request_id) == e[2]]
        return iter([e[3] for e in sorted(live, key=lambda e: e[:3])])


class Scheduler(_ref.Scheduler):
    """Continuous batching with chunked prefill, prefix caching and preemption.

    Args:
        scheduler_config: budget, ``max_num_seqs``, ``max_model_len``, chunking.
        cache_config: ``num_blocks`` (the pool), ``block_size``, prefix caching.
        kv_cache_manager_cls: the ``KVCacheManager`` class to build on the
            block allocator; None takes ``components.kv_cache_manager``'s.
        components: the engine's :class:`~minivllm.backend.Components`.
    """

    priority_queue_cls = HeapWaitingQueue

    def _remove_from_running(self, finished: list[Request]) -> None:
        """One pass over ``running`` for every request that finished this step."""
        if finished:
            self.running = [r for r in self.running if r.status == RequestStatus.RUNNING]
