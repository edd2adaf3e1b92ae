"""Prepacked float weights: the GEMMs for the rows the C++ GEMV does not take.

:func:`minivllm.fast.linear.linear` sends a CPU float projection with more token
rows than the GEMV's (:data:`minivllm.fast.linear.GEMV_MAX_ROWS`) to
:func:`prepacked_linear`, with the copy of the weight :func:`prepack_weight` made
once at load. Two kinds of copy:

- float32 where the C++ build has AVX-512 (``gemm_panels_width() > 0``): a
  :class:`PanelWeight`, the weight in (P, K, 48) panels for ``torch.ops.minivllm.gemm_panels``
  (``csrc/gemm_panels.cpp``), which prefetches the next panel while it multiplies
  this one. It takes up to :data:`PANEL_MAX_ROWS` rows (a decode batch); more (a
  prefill) run ``F.linear`` on the plain weight, as fast as oneDNN's there.
- otherwise (bf16, or no AVX-512): oneDNN's blocked copy, for :func:`packed_linear`:
  oneDNN's GEMM in chunks of at most :data:`PACKED_CHUNK_ROWS` rows whose counts go
  through :func:`packed_rows`, so that the process does not keep a compiled GEMM for
  every count it ever met (docs/serving.md, "Memory over time").

A W8A8 or W4A8 weight (int8 or 4-bit, int8 activations) on a CPU with
AVX512-VNNI gets a copy of its own, :func:`prepack_w8a8` / :func:`prepack_w4a8`:
panels of 32 rows in the order ``vpdpbusd`` reads them, which the C++ layer stack
multiplies one row of ``x`` by without the shuffles the stored layout needs
(``csrc/quant_w8a8_prepacked.h``).

Tested in ``tests/test_prepack.py``, ``tests/test_w8a8_prepacked.py`` and
``tests/test_memory_growth.py``.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from minivllm.quantized_weight import QuantizedWeight

#: The most token rows one oneDNN call takes; more run in chunks of this many (within
#: 4% of one call for 700-4096 rows, and 5-12% ahead of ``F.linear``, on the EPYC).
PACKED_CHUNK_ROWS = 512


#: The most token rows :func:`panel_linear` takes; more run ``F.linear`` on the plain weight.
#: Measured on the Xeon (2 threads, SmolLM2's 30 layers, weights in memory): the panels
#: took 26 / 52 / 99 / 201 ms at 24 / 64 / 128 / 256 rows against oneDNN's prepacked
#: 41 / 72 / 113 / 199 and ``F.linear``'s 205 at 256; at 512 rows 404 against 371 / 374.
PANEL_MAX_ROWS = 256

#: Weight rows a panel of :func:`prepack_w8a8` / :func:`prepack_w4a8`'s copies holds
#: (``PANEL`` in ``csrc/quant_w8a8_gemm.h``: two vectors of 16 int32 lanes).
PREPACKED_ROWS = 32


@dataclass(frozen=True)
class PanelWeight:
    """A float32 weight ``(N, K)`` as ``gemm_panels``' panels ``(P, K, width)``, zero-padded.

    Panel ``p`` holds output features ``p * width .. p * width + width - 1``, each input
    feature's ``width`` weights side by side (the order the kernel's k loop reads).
    """

    panels: torch.Tensor
    n: int


def pack_panels(weight: torch.Tensor, width: int) -> PanelWeight:
    """``weight`` (N, K) as :class:`PanelWeight` panels of ``width`` output features."""
    n, k = weight.shape
    p = -(-n // width)
    padded = weight.new_zeros(p * width, k)
    padded[:n] = weight
    return PanelWeight(padded.view(p, width, k).transpose(1, 2).contiguous(), n)


def panel_linear(x: torch.Tensor, packed: PanelWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ W.T + bias`` by ``torch.ops.minivllm.gemm_panels``, ``(..., K) -> (..., N)``."""
    from minivllm.fast import cpu_ops

    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape[0], packed.n, dtype=x.dtype)
    cpu_ops.ops().gemm_panels(out, rows, packed.panels,
                              None if bias is None else bias.contiguous())
    return out.view(*x.shape[:-1], packed.n)


def prepacked_linear(x: torch.Tensor, weight: torch.Tensor, packed: PanelWeight | torch.Tensor,
                     bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ weight.T + bias`` on :func:`prepack_weight`'s copy ``packed`` of ``weight``."""
    if isinstance(packed, PanelWeight):
        if x.numel() // max(1, x.shape[-1]) <= PANEL_MAX_ROWS:
            return panel_linear(x, packed, bias)
        return F.linear(x, weight, bias)
    return packed_linear(x, packed, bias, weight.shape[0])


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


def prepack_weight(weight, panels: bool = True) -> PanelWeight | torch.Tensor | None:
    """The copy of a float CPU weight :func:`prepacked_linear` multiplies by; else None.

    A float32 weight becomes :class:`PanelWeight` panels where the C++ build has
    ``gemm_panels`` (and ``panels`` is True); otherwise the copy is oneDNN's blocked one.

    A GEMM library reorders the weight into its blocked layout on every call; with
    a decode batch (64 rows x SmolLM2's 576 features) that reorder is a large part
    of the call. Done once at load it is not repeated (vLLM's CPU backend prepacks
    its oneDNN weights the same way), at the cost of a second copy of each float
    weight: the small-M GEMV reads the plain one. ``EngineConfig.prepack=False``
    (``$MINIVLLM_PREPACK=0``) turns it off; CUDA is never packed, nor is anything on a
    torch without oneDNN but the panels.

    An int8 or 4-bit weight with int8 activations (W8A8, W4A8), multiplied by the fast
    twin on a CPU with AVX512-VNNI, gets :func:`prepack_w8a8` / :func:`prepack_w4a8`'s
    copy: the C++ layer stack reads it for one row of ``x`` (a batch-1 decode step);
    other steps read the weight as stored.
    """
    if isinstance(weight, QuantizedWeight):
        return _prepack_quantized(weight)
    if (not isinstance(weight, torch.Tensor)
            or weight.device.type != "cpu" or weight.dim() != 2
            or weight.dtype not in (torch.float32, torch.bfloat16)):
        return None
    width = _panel_width() if panels and weight.dtype == torch.float32 else 0
    if width:
        return pack_panels(weight.detach(), width)
    if not torch.backends.mkldnn.is_available():
        return None
    if weight.dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return None  # oneDNN's bf16 GEMM needs AVX-512 (or AVX-NE-CONVERT)
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous())


def _prepack_quantized(weight: QuantizedWeight) -> torch.Tensor | None:
    """:func:`prepack_w8a8` / :func:`prepack_w4a8`'s copy of a weight with int8 activations
    that the C++ ops multiply; else None."""
    from minivllm.fast import cpu_ops

    # The fast twin multiplies it (it is loaded by then; looked up, not imported: the
    # twin imports this module's callers).
    fast_quantization = sys.modules.get("minivllm.fast.quantization")
    if (weight.activations != "int8" or weight.qweight.dim() != 2
            or weight.qweight.device.type != "cpu" or weight.ops is not fast_quantization
            or cpu_ops.build()[0] is None or not cpu_ops.ops().w8a8_prepacked_available()):
        return None
    if weight.method == "int8":
        return prepack_w8a8(weight.qweight, weight.scales)
    return prepack_w4a8(weight.qweight, weight.scales, weight.mins)


def _panel_width() -> int:
    """``gemm_panels``' panel width in this C++ build; 0 where it has none (or no build)."""
    from minivllm.fast import cpu_ops

    if cpu_ops.build()[0] is None:  # no compiler: the ref kernels run, and oneDNN's GEMM
        return 0
    return int(torch.ops.minivllm.gemm_panels_width())


class Prepacked:
    """A layer whose float weight :func:`prepack_weight` copies once its weights are loaded."""

    packed_weight: PanelWeight | torch.Tensor | None = None

    def process_weights_after_loading(self, *, prepack: bool = True) -> None:
        """Called by the loader after every weight is loaded (and quantized).

        The weights are final from here: whoever changes ``weight`` later calls
        this again, or the GEMM keeps multiplying by the old packed copy.
        ``prepack=False`` (``EngineConfig.prepack``) keeps no packed copy.
        """
        self.packed_weight = prepack_weight(self.weight) if prepack else None


def _panel_rows(t: torch.Tensor, panels: int) -> torch.Tensor:
    """``t`` with zero rows to ``panels`` panels of :data:`PREPACKED_ROWS` rows."""
    out = t.new_zeros((panels * PREPACKED_ROWS, *t.shape[1:]))
    out[: t.shape[0]] = t
    return out


def prepack_w8a8(qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """An int8 weight in the layout ``w8a8_linear_prepacked`` reads one row of ``x`` by.

    ``qweight`` ``(N, K)`` int8, ``scales`` ``(N, G)`` (G divides ``K / 32``), float32 or
    float16. Returns ``(ceil(N / 32), bytes)`` uint8: panels of 32 weight rows (zero
    rows pad the last), each its rows' scales, scale group after scale group (32 side
    by side), then every group of 32 input features as its rows' bytes plus 128
    (unsigned), 4 at a time (a 32-bit word of each row, row after row).
    """
    n, k = qweight.shape
    panels, groups = -(-n // PREPACKED_ROWS), k // 32
    s = _panel_rows(scales.contiguous(), panels).view(panels, PREPACKED_ROWS, -1).transpose(1, 2)
    unsigned = (qweight.contiguous().view(torch.uint8) ^ 0x80)  # w + 128, as a byte
    words = _panel_rows(unsigned, panels).view(torch.int32)  # (P * 32, K / 4): 8 a group
    words = words.view(panels, PREPACKED_ROWS, groups, 8).permute(0, 2, 3, 1)
    return torch.cat([s.contiguous().view(torch.uint8).view(panels, -1),
                      words.contiguous().view(torch.uint8).view(panels, -1)], dim=1)


def prepack_w4a8(qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    """A 4-bit weight in the layout ``w4a8_linear_prepacked`` reads one row of ``x`` by.

    ``qweight`` ``(N, K / 2)`` (byte ``l`` of a group holds its weights ``l`` and
    ``l + 16``), ``scales`` and ``mins`` ``(N, K / 32)``, both float32 or both float16.
    Returns ``(ceil(N / 32), K / 32, bytes)`` uint8: panels of 32 weight rows (zero rows
    pad the last), each group as its 32 rows' bytes, 4 at a time (a 32-bit word of each
    row, row after row: the order ``vpdpbusd`` reads), then their 32 scales and 32
    minimums (``csrc/quant_w8a8_prepacked.h``).
    """
    rows, groups = PREPACKED_ROWS, scales.shape[1]
    panels = -(-qweight.shape[0] // rows)
    words = _panel_rows(qweight.contiguous(), panels).view(torch.int32)  # (P * 32, K / 8)
    words = words.view(panels, rows, groups, 4).permute(0, 2, 3, 1)  # (P, G, word, row)
    per_group = [words.contiguous().view(torch.uint8).view(panels, groups, -1)]
    for t in (scales, mins):  # (P, G, row): a group's 32 values side by side
        t = _panel_rows(t.contiguous(), panels).view(panels, rows, groups).transpose(1, 2)
        per_group.append(t.contiguous().view(torch.uint8).view(panels, groups, -1))
    return torch.cat(per_group, dim=2).contiguous()
