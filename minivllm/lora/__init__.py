"""Multi-LoRA serving: many fine-tunes of one base model in one batch (issue 28).

A neutral layer below the engine (it imports torch and minivllm's shard
arithmetic, never engine code):

- :mod:`minivllm.lora.request`: :class:`LoRARequest`, a request's adapter (vLLM's).
- :mod:`minivllm.lora.models`: a loaded adapter (:class:`LoRAModel`, per layer and
  module ``A``, ``B`` and its scaling) and the model's targetable projections.
- :mod:`minivllm.lora.peft_format`: reads PEFT's ``adapter_config.json`` +
  ``adapter_model.safetensors``, checking everything at load time.
- :mod:`minivllm.lora.manager`: ``max_loras`` device slots filled from an LRU cache
  of ``max_cpu_loras`` adapters; per step, the token -> slot map.
- :mod:`minivllm.lora.mapping`: :class:`LoRAMapping`, that map grouped by slot.
- :mod:`minivllm.lora.tp`: which shard of A and B each tensor-parallel rank holds.

The arithmetic (each token's delta added to a projection's output) is the swap
layer's ``lora`` component: :mod:`minivllm.ref.lora` and :mod:`minivllm.fast.lora`.
See ``docs/lora.md``.
"""

from minivllm.lora.request import LoRARequest

__all__ = ["LoRARequest"]
