"""RMSNorm and residual-add + RMSNorm fused into one kernel: Triton on CUDA, C++ on a CPU.

What you learn here: *kernel fusion* for a memory-bound operation. A norm does
almost no arithmetic per byte, so its time is the time to move its bytes, and
the only way to make it faster is to move fewer of them.

The ref twin (:mod:`minivllm.ref.layernorm`) runs the decoder layer's
``residual = x + residual; y = rms_norm(residual)`` as separate torch ops.
Memory traffic in units of ``N = num_tokens * hidden`` elements: the add reads
2N and writes N; the norm then reads N, upcasts it to float32 (a 2N-byte
intermediate for bf16, written and read again), computes the variance, scales,
casts back and multiplies by the weight, each an extra pass. At least
5N element reads/writes, in practice around 10N.

The fused kernel reads ``x`` and ``residual`` once (2N), keeps the row in
registers in float32 and writes the new residual and the normed output once
each (2N): 4N, the minimum for this contract, in a single launch.

Launch grid: ``(num_tokens,)``: one program per row; the whole row
(``hidden`` up to a few thousand) sits in registers as one block of
``BLOCK = next_power_of_2(hidden)`` elements, so the mean of squares is one
in-register reduction.

On a CPU the same fusion runs as the C++ op ``torch.ops.minivllm.fused_add_rms_norm``
(``minivllm/fast/csrc/layernorm.cpp``): one pass per row over threads, the new
residual written into ``residual`` and the normed output into ``x``, so it
allocates nothing. :func:`rms_norm` and :func:`fused_add_rms_norm` pick the
realisation from the tensor's device; ``*_triton`` and ``*_cpu`` name them
directly (``minivllm.fast.triton`` / ``minivllm.fast.cpu``).

Rounding follows the ref exactly: ``x + residual`` is rounded to the input
dtype, the norm is computed in float32, rounded to the input dtype, and only
then multiplied by the weight (as transformers' ``LlamaRMSNorm`` does).
"""

from __future__ import annotations

import torch

from minivllm.fast import cpu_ops
from minivllm.ref import layernorm as ref_layernorm

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton wheels off Linux: the C++ CPU path still works
    from minivllm.fast._no_triton import tl, triton

__all__ = ["rms_norm", "fused_add_rms_norm"]


@triton.jit
def _rms_norm_kernel(
    x_ptr,  # (num_tokens, hidden), rows ``stride_x`` apart
    residual_ptr,  # (num_tokens, hidden) or a dummy when not HAS_RESIDUAL
    weight_ptr,  # (hidden,)
    out_ptr,  # (num_tokens, hidden) normed output
    residual_out_ptr,  # (num_tokens, hidden) new residual, or a dummy
    stride_x, stride_r, stride_o, stride_ro,  # row strides, in elements
    hidden,  # row length
    eps,  # added to the mean of squares
    HAS_RESIDUAL: tl.constexpr,  # fuse ``x + residual`` in front of the norm
    BLOCK: tl.constexpr,  # next_power_of_2(hidden)
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0)
        # Round the sum to the residual's dtype, as the unfused ``x + residual`` does.
        x = (x.to(tl.float32) + r.to(tl.float32)).to(residual_out_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * stride_ro + cols, x, mask=mask)
    x32 = x.to(tl.float32)
    variance = tl.sum(x32 * x32, axis=0) / hidden
    normed = (x32 * tl.rsqrt(variance + eps)).to(x.dtype)  # round to the input dtype first
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    # The product of two fp16/bf16 numbers is exact in float32, so multiplying there
    # and rounding once gives the ref's ``weight * normed`` bit for bit.
    y = normed.to(tl.float32) * w.to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


_check = ref_layernorm._check  # the same shape rule as the ref


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as a 2-D (rows, hidden) tensor with unit column stride."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _launch(x2, r2, weight, out2, rout2, eps):
    hidden = x2.shape[-1]
    block = triton.next_power_of_2(hidden)
    # Wide rows need more warps so each thread holds a few elements, not hundreds.
    num_warps = min(max(block // 256, 1), 16)
    has_res = r2 is not None
    _rms_norm_kernel[(x2.shape[0],)](
        x2, r2 if has_res else x2, weight, out2, rout2 if has_res else out2,
        x2.stride(0), r2.stride(0) if has_res else 0, out2.stride(0),
        rout2.stride(0) if has_res else 0,
        hidden, eps,
        HAS_RESIDUAL=has_res, BLOCK=block, num_warps=num_warps,
    )  # fmt: skip


def rms_norm(
    x: torch.Tensor,  # (num_tokens, hidden)
    weight: torch.Tensor,  # (hidden,)
    eps: float,
) -> torch.Tensor:
    """RMS-normalise each row of ``x`` and scale by ``weight``."""
    if x.device.type == "cpu":
        return rms_norm_cpu(x, weight, eps)
    return rms_norm_triton(x, weight, eps)


def fused_add_rms_norm(
    x: torch.Tensor,  # (num_tokens, hidden)
    residual: torch.Tensor,  # (num_tokens, hidden)
    weight: torch.Tensor,  # (hidden,)
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``(rms_norm(x + residual), x + residual)``.

    Writes into ``x`` and ``residual`` where it can; callers must use the
    returned tensors.
    """
    if x.device.type == "cpu":
        return fused_add_rms_norm_cpu(x, residual, weight, eps)
    return fused_add_rms_norm_triton(x, residual, weight, eps)


def rms_norm_triton(
    x: torch.Tensor,  # (num_tokens, hidden)
    weight: torch.Tensor,  # (hidden,)
    eps: float,
) -> torch.Tensor:
    """:func:`rms_norm` by the Triton kernel (CUDA, or the interpreter on a CPU)."""
    _check(x, weight)
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    if x.numel() == 0:
        return out
    x2 = _rows(x)
    _launch(x2, None, weight, out.view(-1, x.shape[-1]), None, eps)
    return out


def fused_add_rms_norm_triton(
    x: torch.Tensor,  # (num_tokens, hidden)
    residual: torch.Tensor,  # (num_tokens, hidden)
    weight: torch.Tensor,  # (hidden,)
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`fused_add_rms_norm` by the Triton kernel.

    The new residual is written into ``residual`` itself when it is contiguous
    and already has the sum's dtype (the usual case), so no buffer is allocated.
    Callers must use the returned tensors.
    """
    _check(x, weight)
    if residual.shape != x.shape:
        raise ValueError(
            f"residual shape {tuple(residual.shape)} must equal x shape {tuple(x.shape)}"
        )
    res_dtype = torch.promote_types(x.dtype, residual.dtype)
    out_dtype = torch.promote_types(res_dtype, weight.dtype)
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    if residual.dtype == res_dtype and residual.is_contiguous():
        res_out = residual  # in place: saves an allocation, not bytes
    else:
        res_out = torch.empty(x.shape, dtype=res_dtype, device=x.device)
    if x.numel() == 0:
        return out, res_out
    hidden = x.shape[-1]
    _launch(_rows(x), _rows(residual), weight, out.view(-1, hidden), res_out.view(-1, hidden), eps)
    return out, res_out


# ----------------------------------------------------------------------------- C++ (CPU)
def _same_dtype(*tensors: torch.Tensor) -> bool:
    return all(t.dtype == tensors[0].dtype for t in tensors)


def rms_norm_cpu(
    x: torch.Tensor,  # (num_tokens, hidden)
    weight: torch.Tensor,  # (hidden,)
    eps: float,
) -> torch.Tensor:
    """:func:`rms_norm` by the C++ op ``torch.ops.minivllm.rms_norm``.

    Mixed dtypes (a float32 weight on bfloat16 rows) take the ref's path: the
    op reads one dtype.
    """
    _check(x, weight)
    if not _same_dtype(x, weight):
        return ref_layernorm.rms_norm(x, weight, eps)
    out = torch.empty(x.shape, dtype=x.dtype)
    if x.numel():
        cpu_ops.ops().rms_norm(out.view(-1, x.shape[-1]), _rows(x), weight.contiguous(), eps)
    return out


def fused_add_rms_norm_cpu(
    x: torch.Tensor,  # (num_tokens, hidden)
    residual: torch.Tensor,  # (num_tokens, hidden)
    weight: torch.Tensor,  # (hidden,)
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`fused_add_rms_norm` by the C++ op, in place: returns ``(x, residual)``.

    The op overwrites ``residual`` with the sum and ``x`` with the normed
    output. Inputs it cannot update in place (mixed dtypes, non-contiguous
    rows) take the ref's path.
    """
    _check(x, weight)
    if residual.shape != x.shape:
        raise ValueError(
            f"residual shape {tuple(residual.shape)} must equal x shape {tuple(x.shape)}"
        )
    if not (_same_dtype(x, residual, weight) and x.is_contiguous() and residual.is_contiguous()):
        return ref_layernorm.fused_add_rms_norm(x, residual, weight, eps)
    if x.numel():
        hidden = x.shape[-1]
        cpu_ops.ops().fused_add_rms_norm(x.view(-1, hidden), residual.view(-1, hidden),
                                         weight.contiguous(), eps)  # fmt: skip
    return x, residual
