"""Helpers shared by the kernel equivalence tests (not a test module).

Kernel tests run the implementation under test (``minivllm.backend.get(name)``)
against ``minivllm.ref`` and, so that ``--backend=ref`` is meaningful too,
against a small independent oracle written in the test itself.
"""

from __future__ import annotations

import torch
from hypothesis import settings

#: Compiled kernels on a GPU when there is one; Triton's interpreter (or the ref) on CPU.
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
