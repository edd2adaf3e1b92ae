"""The C++ CPU kernels as a backend: ``backend="minivllm.fast.cpu"``.

On a CPU, ``fast`` (and ``auto``, where the ops built) already means these
kernels; this module names them explicitly, e.g. to compare them with the
Triton kernels in the interpreter (:mod:`minivllm.fast.triton`) or to insist on
them (no silent fallback: if the build failed, calling one raises). The ops
are built on first use (:mod:`minivllm.fast.cpu_ops`); each attribute below
serves one kernel component; the host-side components come from ``ref``.
"""

from __future__ import annotations

from types import MappingProxyType

from minivllm.fast import activation as _activation
from minivllm.fast import attention as _attention
from minivllm.fast import cache_write as _cache_write
from minivllm.fast import layernorm as _layernorm
from minivllm.fast import lora as _lora
from minivllm.fast import rotary as _rotary
from minivllm.fast.triton import component

#: The attention twin's other public names (the ref's helpers it re-exports).
_attention_helpers = MappingProxyType({n: getattr(_attention, n) for n in _attention.__all__
                                       if n != "paged_attention"})
attention = component(f"{__name__}.attention", "Paged attention by the C++ op.",
                      paged_attention=_attention.paged_attention_cpu, **_attention_helpers)
cache_write = component(f"{__name__}.cache_write", "The cache write and block copies by the C++ ops.",
                        reshape_and_cache=_cache_write.reshape_and_cache_cpu,
                        copy_blocks=_cache_write.copy_blocks_cpu)
layernorm = component(f"{__name__}.layernorm", "RMSNorm by the C++ ops.",
                      rms_norm=_layernorm.rms_norm_cpu,
                      fused_add_rms_norm=_layernorm.fused_add_rms_norm_cpu)
rotary = component(f"{__name__}.rotary", "RoPE by the C++ op.",
                   apply_rotary_emb=_rotary.apply_rotary_emb_cpu)
activation = component(f"{__name__}.activation", "SiLU-and-mul by the C++ op.",
                       silu_and_mul=_activation.silu_and_mul_cpu)
lora = component(f"{__name__}.lora", "The LoRA delta by the C++ op.", add_lora=_lora.add_lora_cpu)
#: The quantized matmuls: the fast twin's own module (its C++ ops run on CPU tensors),
#: and the model runner: the fast twin (its C++ layer stack runs only where every kernel
#: the model calls is the C++ op, else the model's own forward).
from minivllm.fast import model_runner, quantization  # noqa: E402, F401
