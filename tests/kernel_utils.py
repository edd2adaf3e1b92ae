"""Helpers shared by the kernel equivalence tests (not a test module).

Kernel tests run the implementation under test (``minivllm.backend.get(name)``)
against ``minivllm.ref`` and, so that ``--backend=ref`` is meaningful too,
against a small independent oracle written in the test itself.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import settings

from minivllm import backend

#: Compiled Triton kernels on a GPU when there is one; the C++ ops (and Triton's
#: interpreter, through ``minivllm.fast.triton``) on a CPU.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

DTYPES = [torch.float32, torch.float16, torch.bfloat16]

#: (rtol, atol) per dtype for "same function, different rounding order".
TOL = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}


def examples(n: int) -> int:
    """At most ``n`` hypothesis examples, fewer if the loaded profile asks for fewer."""
    return min(n, settings.default.max_examples)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, scale=1.0):
    """Compare with the dtype's tolerance (times ``scale``); NaN never passes."""
    rtol, atol = TOL[dtype]
    assert not torch.isnan(actual).any(), "NaN in the output"
    torch.testing.assert_close(
        actual.float().cpu(), expected.float().cpu(), rtol=rtol * scale, atol=atol * scale
    )


def kernel_backends() -> list[str]:
    """The backends a kernel test module runs under.

    ``--backend`` itself; and under ``fast`` on a CPU, where ``fast`` means the
    C++ ops, also ``minivllm.fast.triton``: the Triton kernels in the interpreter.
    """
    spec = backend.get_backend()
    if spec == "fast" and not torch.cuda.is_available() and backend.triton_available():
        return ["fast", "minivllm.fast.triton"]
    return [spec]


@pytest.fixture(scope="module", autouse=True, params=kernel_backends())
def kernel_backend(request: pytest.FixtureRequest):
    """Import into a test module to run all its tests under each of :func:`kernel_backends`."""
    with backend.use_backend(request.param):
        yield request.param
