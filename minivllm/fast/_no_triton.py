"""Stand-ins for ``triton`` and ``triton.language`` where Triton is not installed.

Triton has wheels for Linux only, but the fast kernel modules also hold the C++
CPU path, which must import on macOS and Windows too. With these stand-ins the
``@triton.jit`` kernel definitions still import; launching one raises a clear
error (it can only happen for CUDA tensors, and :mod:`minivllm.backend` never
picks the fast kernels on CUDA without Triton).
"""

from __future__ import annotations


class _Missing:
    """Any attribute, call or decoration gives this object back; a launch raises."""

    def __getattr__(self, name: str) -> _Missing:
        return self

    def __call__(self, *args, **kwargs) -> _Missing:
        return self

    def __getitem__(self, grid) -> None:
        raise RuntimeError("Triton is not installed: the Triton kernels cannot run here")


triton = _Missing()
tl = _Missing()
