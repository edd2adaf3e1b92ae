"""Prepacked float weights: oneDNN's GEMM for the rows the C++ GEMV does not take.

:func:`minivllm.fast.linear.linear` sends a CPU float projection with more token
rows than the GEMV's (:data:`minivllm.fast.linear.GEMV_MAX_ROWS`) to
:func:`packed_linear`: oneDNN's GEMM on a copy of the weight reordered once at load
(:func:`prepack_weight`), in chunks of at most :data:`PACKED_CHUNK_ROWS` rows whose
counts go through :func:`packed_rows`, so that the process does not keep a compiled
GEMM for every count it ever met (docs/serving.md, "Memory over time"). Tested in
``tests/test_prepack.py`` and ``tests/test_memory_growth.py``.
"""

from __future__ import annotations

import torch

#: The most token rows one oneDNN call takes; more run in chunks of this many (within
#: 4% of one call for 700-4096 rows, and 5-12% ahead of ``F.linear``, on the EPYC).
PACKED_CHUNK_ROWS = 512


def packed_rows(m: int) -> int:
    """The row count oneDNN's GEMM runs for ``m`` rows: ``m`` rounded up to a bucket.

    oneDNN compiles a kernel for every new shape and keeps about half a megabyte
    for each, for as long as the process lives (about half of it in its primitive
    cache, which ``ONEDNN_PRIMITIVE_CACHE_CAPACITY`` bounds; the rest not even
    with a capacity of 0). A server's steps bring ever new row counts, so its
    memory grew without end (measured: docs/serving.md, "Memory over time").
    Rounded up to a multiple of 8 below 128 rows, of 16 below 256 and of 32 up to
    :data:`PACKED_CHUNK_ROWS` (padding: at most 7 rows below 128, then at most 1
    row in 8), a weight meets at most 32 shapes.
    """
    step = max(8, 1 << max(0, m.bit_length() - 4))
    return -(-m // step) * step


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
                  n: int) -> torch.Tensor:
    """``x @ W.T + bias`` on oneDNN's prepacked ``W``, ``(..., K) -> (..., n)``.

    In chunks of :data:`PACKED_CHUNK_ROWS` rows, each padded with zero rows to
    :func:`packed_rows` (their outputs are dropped).
    """
    rows = x.reshape(-1, x.shape[-1])
    m = rows.shape[0]
    if m <= PACKED_CHUNK_ROWS:  # zero rows too (a stage with nothing scheduled)
        return _gemm(rows, packed, bias).view(*x.shape[:-1], n)
    out = torch.empty(m, n, dtype=x.dtype)
    for start in range(0, m, PACKED_CHUNK_ROWS):
        part = rows[start:start + PACKED_CHUNK_ROWS]
        out[start:start + part.shape[0]] = _gemm(part, packed, bias)
    return out.view(*x.shape[:-1], n)


def _gemm(rows: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """One oneDNN call on ``rows`` padded to :func:`packed_rows`; the padding's outputs dropped."""
    count = rows.shape[0]
    padded = packed_rows(count)
    if padded != count:
        rows = torch.cat([rows, rows.new_zeros(padded - count, rows.shape[1])])
    return torch.ops.mkldnn._linear_pointwise(rows, packed, bias, "none", [], "")[:count]


def prepack_weight(weight) -> torch.Tensor | None:
    """oneDNN's blocked copy of a float CPU weight, for :func:`packed_linear`; else None.

    A GEMM library reorders the weight into its blocked layout on every call; with
    a decode batch (64 rows x SmolLM2's 576 features) that reorder is a large part
    of the call. Done once at load it is not repeated (vLLM's CPU backend prepacks
    its oneDNN weights the same way), at the cost of a second copy of each float
    weight: the small-M GEMV reads the plain one. ``EngineConfig.prepack=False``
    (``$MINIVLLM_PREPACK=0``) turns it off; quantized weights, CUDA and a torch
    without oneDNN are never packed.
    """
    if (not isinstance(weight, torch.Tensor)
            or weight.device.type != "cpu" or weight.dim() != 2
            or weight.dtype not in (torch.float32, torch.bfloat16)
            or not torch.backends.mkldnn.is_available()):
        return None
    if weight.dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return None  # oneDNN's bf16 GEMM needs AVX-512 (or AVX-NE-CONVERT)
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous())


class Prepacked:
    """A layer whose float weight :func:`prepack_weight` copies once its weights are loaded."""

    packed_weight: torch.Tensor | None = None

    def process_weights_after_loading(self, *, prepack: bool = True) -> None:
        """Called by the loader after every weight is loaded (and quantized).

        The weights are final from here: whoever changes ``weight`` later calls
        this again, or the GEMM keeps multiplying by the old packed copy.
        ``prepack=False`` (``EngineConfig.prepack``) keeps no packed copy.
        """
        self.packed_weight = prepack_weight(self.weight) if prepack else None
