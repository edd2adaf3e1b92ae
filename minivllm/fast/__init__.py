"""Optimised twins of :mod:`minivllm.ref`, with the same public API as their ref twins.

- Kernels: Triton on CUDA, C++ custom ops on a CPU (``csrc/``, built on first
  use by :mod:`minivllm.fast.cpu_ops`); each kernel module dispatches on the
  tensor's device. ``minivllm.fast.triton`` and ``minivllm.fast.cpu`` pick one
  of the two explicitly (the Triton kernels then run in Triton's interpreter
  on a CPU).
- Host side: O(1) / vectorised data structures (allocator, KV cache manager,
  scheduler, block tables, sampler) and real one-process-per-rank linear layers.

:mod:`minivllm.backend` imports a kernel twin only where it can run.
"""
