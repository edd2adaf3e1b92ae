"""Which module a kernel task's tests call (not a test module).

Under ``--backend=PKG`` it is the package's own copy (``PKG.attention_decode``,
``PKG.activation_cpp``); under ``ref`` or ``fast`` it is ``minivllm.fast``'s,
the solution itself.
"""

from __future__ import annotations

import importlib
import os

import torch

from minivllm import backend


def kernel_module(component: str, module: str):
    """``<package serving component>.<module>``, or ``minivllm.fast.<module>``."""
    served = getattr(backend.get(component), "__name__", "minivllm.fast.x")
    package = served.rpartition(".")[0]
    if package in ("minivllm.ref", "minivllm.fast", ""):
        package = "minivllm.fast"
    return importlib.import_module(f"{package}.{module}")


def triton_runs_here() -> bool:
    """Triton kernels can run: on CUDA, or in Triton's interpreter (set by the plugin for
    any --backend but ref on a machine without CUDA)."""
    return torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
