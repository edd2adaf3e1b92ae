"""Optimised twins of :mod:`minivllm.ref`: Triton kernels and O(1) / vectorised
host-side data structures, with the same public API as their ref twins.

Kernel modules import Triton at import time; :mod:`minivllm.backend` only
imports them when Triton can run (on CUDA, or in the interpreter).
"""
