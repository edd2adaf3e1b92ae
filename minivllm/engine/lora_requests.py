"""The engine's side of LoRA: adapters checked and loaded when a request arrives.

A step can only serve the adapters that sit in the device's ``max_loras``
slots (:mod:`minivllm.lora.manager`). That is the scheduler's rule, as in
vLLM: it admits a waiting request only while the running requests hold fewer
than ``max_loras`` distinct adapters or already hold its own
(``SchedulerConfig.max_loras``, :meth:`minivllm.ref.scheduler.Scheduler._has_lora_slot`).

An adapter is loaded on every rank the first time a request names it
(``Executor.add_lora``): a bad one (a missing path, a rank above
``max_lora_rank``, a shape or target that does not fit the model) is a
``ValueError`` for that request alone, before it is queued.
"""

from __future__ import annotations

from typing import Any


class LoRARequests:
    """The adapters the engine has loaded, by id.

    Args:
        lora_config: the engine's :class:`~minivllm.lora.manager.LoRAConfig`, or
            None (``enable_lora=False``: every ``lora_request`` is refused).
        executor: loads each new adapter on every rank.
    """

    def __init__(self, lora_config: Any, executor: Any) -> None:
        self.lora_config = lora_config
        self.executor = executor
        self.adapters: dict[int, Any] = {}  # lora_int_id -> the LoRARequest it was loaded from

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


__all__ = ["LoRARequests"]
