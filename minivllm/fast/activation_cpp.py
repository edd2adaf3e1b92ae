"""SiLU-and-mul as a C++ extension of its own: ``csrc/activation.cpp``, built alone.

What you learn here: the smallest ``torch.utils.cpp_extension`` flow. The
kernel (``minivllm::silu_and_mul(out, input)`` in ``csrc/activation.cpp``, the
same source the full C++ backend, :mod:`minivllm.fast.cpu_ops`, compiles) is
included into a few lines of glue that allocate the output and bind one
Python function with pybind11; :func:`torch.utils.cpp_extension.load_inline`
compiles that with the host compiler into torch's extension cache
(``$TORCH_EXTENSIONS_DIR``) and imports it. It is called through
:func:`minivllm.fast.cpp_build.load_inline`, which holds minivllm's build lock
around it, so a build stopped part-way never leaves the next one waiting forever.

This is the course's C++ task (Task 16): the student package holds a copy of
this module and of ``csrc/activation.cpp`` with the loop body stubbed out,
and this module builds whichever ``csrc/`` sits beside it. The extension's
name carries a hash of the sources, so an edited kernel is always rebuilt
and an unchanged one (the same solution in another package) is reused.
"""

from __future__ import annotations

import functools
import hashlib
import sys
from pathlib import Path

import torch

from minivllm.fast.cpp_build import load_inline  # torch's, under minivllm's build lock

CSRC = Path(__file__).with_name("csrc")
SOURCES = ("activation.cpp", "ops.h", "thread_team.h", "thread_team.cpp")

# The kernel, and the thread team its parallel_for runs on (thread_team.h), in one unit.
_GLUE = """
#include "activation.cpp"
#include "thread_team.cpp"

// (rows, 2 * I) -> (rows, I): allocate the output, call the kernel.
torch::Tensor course_silu_and_mul(const torch::Tensor& input) {
  TORCH_CHECK(input.dim() == 2, "input: (rows, 2 * I)");
  auto out = torch::empty({input.size(0), input.size(1) / 2}, input.options());
  minivllm::silu_and_mul(out, input);
  return out;
}
"""


@functools.cache
def _library():
    """Compile (once per source version) and import the extension."""
    digest = hashlib.sha256(_GLUE.encode())
    for name in SOURCES:
        digest.update((CSRC / name).read_bytes())
    flags = ["-O3"] + (["-fopenmp"] if sys.platform.startswith("linux") else [])
    return load_inline(
        name=f"course_silu_and_mul_{digest.hexdigest()[:16]}",
        cpp_sources=[_GLUE], functions=["course_silu_and_mul"],
        extra_include_paths=[str(CSRC)], extra_cflags=flags,
        extra_ldflags=["-fopenmp"] if sys.platform.startswith("linux") else [],
        verbose=False)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:  # (..., 2I) -> (..., I)
    """``silu(x[..., :I]) * x[..., I:]`` by the C++ kernel (CPU tensors; float32, bf16, fp16)."""
    if x.dim() < 1 or x.shape[-1] % 2 != 0:
        raise ValueError(f"x's last dimension must be even (gate | up), got {tuple(x.shape)}")
    if x.device.type != "cpu":
        raise ValueError(f"x must be on the CPU, got {x.device}")
    rows = x.reshape(-1, x.shape[-1])  # a view when it can be
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = _library().course_silu_and_mul(rows)  # (rows, I)
    return out.view(*x.shape[:-1], x.shape[-1] // 2)
