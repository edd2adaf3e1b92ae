"""Segmented LoRA (Punica's SGMV / BGMV): every token's own adapter delta, grouped by adapter.

What you learn here: how one batch serves many fine-tunes at almost the cost of
one. The base projection is one shared GEMM for every token (unchanged, done
before this). What remains is, for each token ``t`` with adapter slot ``s``,
``y[t] += scale_s * (x[t] A_s^T) B_s^T``. The ref twin (:mod:`minivllm.ref.lora`)
does that token by token: ``T`` shrink and ``T`` expand matrix-vector products per
slice, each re-reading its adapter's A and B. Here the step's
:class:`~minivllm.lora.mapping.LoRAMapping` (built once per step, shared by every
layer) hands the tokens over *grouped by slot* (a *segment* per adapter), so each
adapter's weights are read once per group of tokens and both products become
small GEMMs:

- shrink: ``H[seg] = scale_s * X[seg] A_s^T``  (``n_seg x in`` times ``in x r``),
- expand: ``Y[seg] += H[seg] B_s^T``         (``n_seg x r`` times ``r x out_i``),

``r`` is small (8 to 64), so the intermediate ``H`` is tiny; the stacks store
``B`` transposed (``(r, out_i)`` per slot) so the expand reads contiguous rows.
A decode batch has one token per request: segments of one or a few tokens,
the gathered matrix-vector product Punica calls BGMV; the same code serves it.

Two realisations, picked by the tensor's device:

- **CPU**: the C++ op ``torch.ops.minivllm.add_lora`` (``csrc/lora.cpp``): work
  items of up to 8 tokens of one segment and one slice, spread over threads.
  The shrink runs register blocks of 2 tokens x 4 rows of A; the expand keeps
  one accumulator vector per token while the rows of B^T stream past, so each
  weight vector loaded serves several tokens (vector extensions compiled for
  the native instruction set: AVX2 + FMA on the development machine).
- **CUDA**: two Triton kernels per output slice. :func:`_lora_shrink_kernel`,
  grid ``(token blocks, segments)``, writes ``H`` (float32, rows in segment
  order); :func:`_lora_expand_kernel`, grid ``(token blocks, output blocks,
  segments)``, reads ``H`` and adds its product with ``B^T`` into ``y`` at the
  tokens' rows. Grid dimension 0 covers the *longest* segment (a host-side int
  in the mapping, so no device sync); programs past their own segment's end
  return at once. A slot with scale 0 (an adapter that leaves the slice alone)
  returns too.

Both accumulate in float32 and round once into ``y``, as the ref does, so the
twins differ only in the order of float32 sums.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from minivllm.fast import cpu_ops
from minivllm.fast.attention_decode import _dot, dot_mode
from minivllm.lora.mapping import LoRAMapping, check_add_lora_args

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton wheels off Linux: the C++ CPU path still works
    from minivllm.fast._no_triton import tl, triton

__all__ = ["add_lora"]


def add_lora(y: torch.Tensor, x: torch.Tensor, lora_a: Sequence[torch.Tensor],
             lora_b: Sequence[torch.Tensor], scalings: Sequence[torch.Tensor],
             mapping: LoRAMapping, output_slices: Sequence[int]) -> None:
    """Add every token's adapter delta to ``y`` in place (the ref's contract; see its docstring)."""
    if y.device.type == "cpu":
        return add_lora_cpu(y, x, lora_a, lora_b, scalings, mapping, output_slices)
    return add_lora_triton(y, x, lora_a, lora_b, scalings, mapping, output_slices)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` with unit stride along its last dimension (a view when it already has it)."""
    return t if t.stride(-1) == 1 else t.contiguous()


def _as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` contiguous in ``dtype``: itself when it already is (the usual case, and a
    per-call cost worth avoiding: a layer makes four calls per step)."""
    return t if t.dtype == dtype and t.is_contiguous() else t.to(dtype).contiguous()


def add_lora_cpu(y: torch.Tensor, x: torch.Tensor, lora_a: Sequence[torch.Tensor],
                 lora_b: Sequence[torch.Tensor], scalings: Sequence[torch.Tensor],
                 mapping: LoRAMapping, output_slices: Sequence[int]) -> None:
    """:func:`add_lora` by the C++ op ``torch.ops.minivllm.add_lora``."""
    check_add_lora_args(y, x, lora_a, lora_b, scalings, mapping, output_slices)
    if not mapping.slots:
        return
    out = _rows(y)
    x = _rows(x) if x.dtype == y.dtype else _rows(x).to(y.dtype)
    cpu_ops.ops().add_lora(
        out, x, [_as(a, y.dtype) for a in lora_a], [_as(b, y.dtype) for b in lora_b],
        [_as(s, torch.float32) for s in scalings], mapping.sorted_tokens, mapping.seg_starts,
        mapping.seg_slots, output_slices)
    if out is not y:
        y.copy_(out)


# --------------------------------------------------------------------------------- Triton
@triton.jit
def _lora_shrink_kernel(
    x_ptr,  # (T, K): the projection's input, rows stride_xt apart
    a_ptr,  # (max_loras, R, K): this slice's A of every slot, contiguous
    scale_ptr,  # (max_loras,) float32
    h_ptr,  # (T_lora, R_PAD) float32, out: scale * x A^T, rows in segment order
    sorted_tokens_ptr,  # (T_lora,) int64: tokens grouped by slot
    seg_starts_ptr,  # (S + 1,) int64
    seg_slots_ptr,  # (S,) int64
    stride_xt,  # x's row stride
    K,  # in features
    R,  # max_rank of the stack
    BLOCK_T: tl.constexpr,  # tokens per program (>= 16: tl.dot's smallest tile)
    BLOCK_K: tl.constexpr,  # input features per loop step
    R_PAD: tl.constexpr,  # R padded to a power of 2 >= 16
    DOT_MODE: tl.constexpr,
):
    seg = tl.program_id(1)
    start = tl.load(seg_starts_ptr + seg)
    end = tl.load(seg_starts_ptr + seg + 1)
    row0 = start + tl.program_id(0) * BLOCK_T
    if row0 >= end:  # this segment is shorter than the longest one
        return
    slot = tl.load(seg_slots_ptr + seg)
    scale = tl.load(scale_ptr + slot)
    if scale == 0.0:  # the adapter leaves this slice alone (the expand skips it too)
        return
    rows = row0 + tl.arange(0, BLOCK_T)
    row_mask = rows < end
    tokens = tl.load(sorted_tokens_ptr + rows, mask=row_mask, other=0)
    r = tl.arange(0, R_PAD)
    a_base = a_ptr + slot * R * K
    acc = tl.zeros([BLOCK_T, R_PAD], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_mask = k < K
        x = tl.load(x_ptr + tokens[:, None] * stride_xt + k[None, :],
                    mask=row_mask[:, None] & k_mask[None, :], other=0.0)  # [BLOCK_T, BLOCK_K]
        a = tl.load(a_base + r[None, :] * K + k[:, None],
                    mask=(r[None, :] < R) & k_mask[:, None], other=0.0)  # [BLOCK_K, R_PAD]: A^T
        acc += _dot(x, a, DOT_MODE)
    tl.store(h_ptr + rows[:, None] * R_PAD + r[None, :], acc * scale, mask=row_mask[:, None])


@triton.jit
def _lora_expand_kernel(
    h_ptr,  # (T_lora, R_PAD) float32: the shrink's output, rows in segment order
    b_ptr,  # (max_loras, R, N): this slice's B^T of every slot, contiguous
    scale_ptr,  # (max_loras,) float32 (only to skip slots with scale 0)
    y_ptr,  # (T, N_total): the base output, updated in place at columns col0 .. col0 + N
    sorted_tokens_ptr,  # (T_lora,) int64
    seg_starts_ptr,  # (S + 1,) int64
    seg_slots_ptr,  # (S,) int64
    stride_yt,  # y's row stride
    col0,  # this slice's first column in y
    N,  # this slice's width
    R,  # max_rank of the stack
    BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr,  # output features per program
    R_PAD: tl.constexpr,
):
    seg = tl.program_id(2)
    start = tl.load(seg_starts_ptr + seg)
    end = tl.load(seg_starts_ptr + seg + 1)
    row0 = start + tl.program_id(0) * BLOCK_T
    if row0 >= end:
        return
    slot = tl.load(seg_slots_ptr + seg)
    if tl.load(scale_ptr + slot) == 0.0:
        return
    rows = row0 + tl.arange(0, BLOCK_T)
    row_mask = rows < end
    tokens = tl.load(sorted_tokens_ptr + rows, mask=row_mask, other=0)
    r = tl.arange(0, R_PAD)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < N
    h = tl.load(h_ptr + rows[:, None] * R_PAD + r[None, :], mask=row_mask[:, None],
                other=0.0)  # [BLOCK_T, R_PAD] float32
    bt = tl.load(b_ptr + slot * R * N + r[:, None] * N + n[None, :],
                 mask=(r[:, None] < R) & n_mask[None, :], other=0.0)  # [R_PAD, BLOCK_N]
    # float32 at full precision: h stays unrounded, as in the ref (r is small: cheap).
    delta = tl.dot(h, bt.to(tl.float32), input_precision="ieee")  # [BLOCK_T, BLOCK_N]
    y_ptrs = y_ptr + tokens[:, None] * stride_yt + col0 + n[None, :]
    mask = row_mask[:, None] & n_mask[None, :]
    y = tl.load(y_ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptrs, (y + delta).to(y_ptr.dtype.element_ty), mask=mask)


#: Tokens per program (tl.dot's smallest tile is 16).
BLOCK_T = 16


def add_lora_triton(y: torch.Tensor, x: torch.Tensor, lora_a: Sequence[torch.Tensor],
                    lora_b: Sequence[torch.Tensor], scalings: Sequence[torch.Tensor],
                    mapping: LoRAMapping, output_slices: Sequence[int]) -> None:
    """:func:`add_lora` by the Triton kernels (CUDA, or the interpreter on a CPU)."""
    check_add_lora_args(y, x, lora_a, lora_b, scalings, mapping, output_slices)
    if not mapping.slots:
        return
    out = _rows(y)
    x = _rows(x) if x.dtype == y.dtype else _rows(x).to(y.dtype)
    num_segments, max_seg = len(mapping.slots), mapping.max_seg_len
    col0 = 0
    for a, b, scale, width in zip(lora_a, lora_b, scalings, output_slices):
        a, b, scale = _as(a, y.dtype), _as(b, y.dtype), _as(scale, torch.float32)
        max_rank, k = a.shape[1], a.shape[2]
        r_pad = max(16, triton.next_power_of_2(max_rank))
        h = torch.empty(mapping.sorted_tokens.shape[0], r_pad, dtype=torch.float32,
                        device=y.device)  # (T_lora, R_PAD)
        block_k = max(16, min(64, triton.next_power_of_2(k)))
        _lora_shrink_kernel[(triton.cdiv(max_seg, BLOCK_T), num_segments)](
            x, a, scale, h, mapping.sorted_tokens, mapping.seg_starts, mapping.seg_slots,
            x.stride(0), k, max_rank, BLOCK_T=BLOCK_T, BLOCK_K=block_k, R_PAD=r_pad,
            DOT_MODE=dot_mode(y.dtype), num_warps=4)
        block_n = max(16, min(64, triton.next_power_of_2(width)))
        _lora_expand_kernel[(triton.cdiv(max_seg, BLOCK_T), triton.cdiv(width, block_n),
                             num_segments)](
            h, b, scale, out, mapping.sorted_tokens, mapping.seg_starts, mapping.seg_slots,
            out.stride(0), col0, width, max_rank, BLOCK_T=BLOCK_T, BLOCK_N=block_n,
            R_PAD=r_pad, num_warps=4)
        col0 += width
    if out is not y:
        y.copy_(out)
