"""The engine's side of LoRA: adapters checked when a request arrives, and at most
``max_loras`` distinct adapters among the requests the scheduler holds.

A step can only serve the adapters that sit in the device's ``max_loras``
slots (:mod:`minivllm.lora.manager`). vLLM's scheduler skips a waiting request
whose adapter would be one too many; here the engine does it in front of the
scheduler, so any scheduler (a student's too) serves LoRA unchanged: a
request whose adapter would make ``max_loras + 1`` distinct adapters among
the scheduler's requests (waiting or running) is held back, and released, in
arrival order, once an adapter's last request has left. Since every step's
batch is drawn from the scheduler's requests, no step ever needs more slots
than there are.

An adapter is loaded on every rank the first time a request names it
(``Executor.add_lora``): a bad one (a missing path, a rank above
``max_lora_rank``, a shape or target that does not fit the model) is a
``ValueError`` for that request alone, before it is queued.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from minivllm.request import Request


class LoRARequests:
    """Adapters by id, and the requests held back for want of a slot.

    Args:
        lora_config: the engine's :class:`~minivllm.lora.manager.LoRAConfig`, or
            None (``enable_lora=False``: every ``lora_request`` is refused).
        executor: loads each new adapter on every rank.
    """

    def __init__(self, lora_config: Any, executor: Any) -> None:
        self.lora_config = lora_config
        self.executor = executor
        self.adapters: dict[int, Any] = {}  # lora_int_id -> the LoRARequest it was loaded from
        self.held: deque[Request] = deque()

    def check(self, lora_request: Any) -> None:
        """Load a new adapter on every rank; refuse a bad one, or an id reused for another.

        Raises ``ValueError`` naming the problem; nothing is left behind.
        """
        if lora_request is None:
            return
        from minivllm.lora.request import LoRARequest

        if not isinstance(lora_request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest or None, "
                             f"got {type(lora_request).__name__}")
        if self.lora_config is None:
            raise ValueError("lora_request needs an engine built with enable_lora=True")
        known = self.adapters.get(lora_request.lora_int_id)
        if known is not None:
            if (known.lora_name, known.lora_path) != (lora_request.lora_name,
                                                      lora_request.lora_path):
                raise ValueError(
                    f"lora_int_id {lora_request.lora_int_id} is already the adapter "
                    f"{known.lora_name!r} ({known.lora_path}); give "
                    f"{lora_request.lora_name!r} an id of its own")
            return
        self.executor.add_lora(lora_request)  # ValueError: the adapter is refused
        self.adapters[lora_request.lora_int_id] = lora_request

    def remove(self, lora_int_id: int) -> bool:
        """Forget an adapter (``/v1/unload_lora_adapter``); False if unknown."""
        if self.adapters.pop(lora_int_id, None) is None:
            return False
        self.executor.remove_lora(lora_int_id)
        return True

    # -- the max_loras rule --------------------------------------------------------------

    def hold_if_needed(self, request: Request, scheduler: Any) -> None:
        """Right after ``scheduler.add_request(request)``: take it back out and hold it if
        its adapter would be one too many (or others wait before it)."""
        if request.lora_request is None or self.lora_config is None:
            return
        if self.held or not self._fits(request, scheduler):
            self.held.append(scheduler.withdraw(request.request_id))

    def release(self, scheduler: Any) -> None:
        """Before each schedule: queue the held requests whose adapter now fits, in order."""
        kept: deque[Request] = deque()
        while self.held:
            request = self.held.popleft()
            if not kept and self._fits(request, scheduler):
                scheduler.requeue((), to_front=False, new_requests=[request])
            else:
                kept.append(request)  # first come, first served among the held
        self.held = kept

    def abort(self, request_ids: set[str]) -> None:
        """Drop held requests (they never reached the scheduler)."""
        self.held = deque(r for r in self.held if r.request_id not in request_ids)

    def _fits(self, request: Request, scheduler: Any) -> bool:
        active = {r.lora_request.lora_int_id for r in scheduler.requests.values()
                  if r.lora_request is not None and r is not request}
        return (request.lora_request.lora_int_id in active
                or len(active) < self.lora_config.max_loras)


__all__ = ["LoRARequests"]
