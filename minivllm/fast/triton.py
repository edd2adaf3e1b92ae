"""The Triton kernels as a backend, on any device: ``backend="minivllm.fast.triton"``.

``fast`` picks the best native kernels for the tensor's device: Triton on CUDA,
the C++ ops (:mod:`minivllm.fast.cpu`) on a CPU. This module names the Triton
realisation explicitly, so it can run on a CPU in Triton's interpreter, e.g. to
step through a kernel or to test it without a GPU::

    TRITON_INTERPRET=1 minivllm generate --backend minivllm.fast.triton "Hello"
    pytest --backend=fast tests/test_attention.py   # runs both, the interpreter included

``TRITON_INTERPRET=1`` must be set before Triton is first imported (the
pytest plugin does it). Through the swap layer's import-path form, each
attribute below serves one kernel component; the host-side components come
from ``ref``.
"""

from __future__ import annotations

import types
from types import MappingProxyType

from minivllm.fast import activation as _activation
from minivllm.fast import attention as _attention
from minivllm.fast import cache_write as _cache_write
from minivllm.fast import layernorm as _layernorm
from minivllm.fast import lora as _lora
from minivllm.fast import rotary as _rotary


def component(qualname: str, doc: str, **functions) -> types.ModuleType:
    """A module object named ``qualname`` whose public API is ``functions``."""
    mod = types.ModuleType(qualname, doc)
    mod.__dict__.update(functions)
    mod.__all__ = sorted(functions)
    return mod


#: The attention twin's other public names (the ref's helpers it re-exports).
_attention_helpers = MappingProxyType({n: getattr(_attention, n) for n in _attention.__all__
                                       if n != "paged_attention"})
attention = component(f"{__name__}.attention", "Paged attention by the Triton kernels.",
                      paged_attention=_attention.paged_attention_triton, **_attention_helpers)
cache_write = component(f"{__name__}.cache_write", "The cache write and block copies by Triton.",
                        reshape_and_cache=_cache_write.reshape_and_cache_triton,
                        copy_blocks=_cache_write.copy_blocks_triton)
layernorm = component(f"{__name__}.layernorm", "RMSNorm by the Triton kernel.",
                      rms_norm=_layernorm.rms_norm_triton,
                      fused_add_rms_norm=_layernorm.fused_add_rms_norm_triton)
rotary = component(f"{__name__}.rotary", "RoPE by the Triton kernel.",
                   apply_rotary_emb=_rotary.apply_rotary_emb_triton)
activation = component(f"{__name__}.activation", "SiLU-and-mul by the Triton kernel.",
                       silu_and_mul=_activation.silu_and_mul_triton)
lora = component(f"{__name__}.lora", "The LoRA delta by the Triton kernels.",
                 add_lora=_lora.add_lora_triton)
#: The model runner: the fast twin (a CUDA graph of the model's forward on a GPU; on a
#: CPU its C++ layer stack needs the C++ ops, so the model's own forward runs). No Triton
#: kernel for the quantized matmuls yet: the ref's (dequantize, then matmul).
from minivllm.fast import model_runner  # noqa: E402, F401
from minivllm.ref import quantization  # noqa: E402, F401
