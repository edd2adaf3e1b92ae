"""The waiting queue of the ``priority`` scheduling policy (vLLM's ``request_queue.py``).

Under ``--scheduling-policy priority`` the scheduler's ``waiting`` is ordered by
``(priority, arrival_time)``, lower first, instead of by arrival alone. The
scheduler twins share the decision loop (:mod:`minivllm.ref.scheduler`); the
queue is where they differ: this readable one keeps a sorted list, the fast
scheduler's (:class:`minivllm.fast.scheduler.HeapWaitingQueue`) a heap. Both answer
the calls the loop makes on the ``fcfs`` deque, so the loop reads the same.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Iterator

from minivllm.request import Request

__all__ = ["PriorityWaitingQueue"]


class PriorityWaitingQueue:
    """The ``priority`` policy's waiting queue, readable version: a list kept sorted.

    Ordered by ``(priority, arrival_time)``, lower first (vLLM's order); equal keys
    keep the order they came in. It answers the calls the scheduler makes on the
    ``fcfs`` policy's deque: ``[0]`` (the next to admit), ``popleft``,
    ``remove``, ``len``; and ``append``, ``appendleft``, ``extend``, ``extendleft``,
    which all put a request in its place by its key. Insertion is O(n) here; the
    fast scheduler's heap (:class:`minivllm.fast.scheduler.HeapWaitingQueue`) makes the same order in O(log n).
    """

    def __init__(self) -> None:
        self._requests: list[Request] = []

    @staticmethod
    def key(request: Request) -> tuple[int, float]:
        return request.priority, request.arrival_time

    def append(self, request: Request) -> None:
        """Put ``request`` after every request whose key is not larger."""
        bisect.insort_right(self._requests, request, key=self.key)

    appendleft = append  # a preempted request goes back to its place too (vLLM's)

    def extend(self, requests: Iterable[Request]) -> None:
        for request in requests:
            self.append(request)

    extendleft = extend

    def popleft(self) -> Request:
        return self._requests.pop(0)

    def remove(self, request: Request) -> None:
        self._requests.remove(request)

    def __getitem__(self, index: int) -> Request:
        return self._requests[index]

    def __len__(self) -> int:
        return len(self._requests)

    def __iter__(self) -> Iterator[Request]:
        return iter(list(self._requests))
