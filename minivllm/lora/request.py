"""``LoRARequest``: which adapter a request runs with (vLLM's ``vllm.lora.request.LoRARequest``).

A request names its adapter by three things::

    LoRARequest("sql-tuned", 1, "/adapters/sql")   # lora_name, lora_int_id, lora_path

- ``lora_int_id`` (an int >= 1) is the adapter's identity everywhere inside the
  engine: the CPU cache, the device slots and the prefix cache key on it. Two
  requests with the same id share one loaded copy. 0 is reserved, as in vLLM,
  for "no adapter".
- ``lora_name`` is for people: logs, the OpenAI server's model list.
- ``lora_path`` is a directory in PEFT's format (``adapter_config.json`` and
  ``adapter_model.safetensors``; see :mod:`minivllm.lora.peft`).

Validation here is only about the fields themselves; whether the path holds an
adapter that fits the model is checked when it is loaded
(:func:`minivllm.lora.peft.load_adapter`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """A request's adapter: ``LoRARequest(lora_name, lora_int_id, lora_path)``.

    Raises ``ValueError`` naming the field if ``lora_name`` or ``lora_path``
    is not a non-empty string, or ``lora_int_id`` is not an int >= 1.
    """

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name must be a non-empty string, got {self.lora_name!r}")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) \
                or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an int >= 1 (0 means no adapter), "
                             f"got {self.lora_int_id!r}")
        path = self.lora_path
        if hasattr(path, "__fspath__"):  # a pathlib.Path: keep the string, as vLLM's field is
            object.__setattr__(self, "lora_path", str(path))
        elif not isinstance(path, str) or not path:
            raise ValueError(f"lora_path must be a non-empty path string, got {path!r}")

    # vLLM's accessors, for code written against it.
    @property
    def adapter_id(self) -> int:
        """``lora_int_id`` (vLLM's generic adapter-request name)."""
        return self.lora_int_id

    @property
    def name(self) -> str:
        """``lora_name``."""
        return self.lora_name

    @property
    def path(self) -> str:
        """``lora_path``."""
        return self.lora_path
