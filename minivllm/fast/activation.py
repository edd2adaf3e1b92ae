"""SiLU-and-mul (the gated activation of Llama's MLP) as one kernel: Triton or C++.

What you learn here: the simplest *elementwise fusion*. The input row is
``[gate | up]`` (``2 * I`` elements); the output is ``silu(gate) * up``.

The ref twin (:mod:`minivllm.ref.activation`) runs ``F.silu(gate) * up``:
memory traffic ``T * I`` reads of ``gate`` + ``T * I`` writes of the silu
intermediate, then ``2 * T * I`` reads (intermediate and ``up``) + ``T * I``
writes: ``5 * T * I`` element moves in two launches. The kernel reads gate and
up once and writes the output once: ``3 * T * I``, one launch. Everything is
computed in float32 and rounded once at the end (as vLLM does), so results can
differ from the ref's double rounding by one unit in the last place of
fp16/bf16.

Launch grid: ``(num_tokens, cdiv(I, BLOCK))``; one program handles ``BLOCK``
output features of one token.

On a CPU the same one-pass loop is the C++ op ``torch.ops.minivllm.silu_and_mul``
(``minivllm/fast/csrc/activation.cpp``), rows spread over threads, with a
polynomial ``exp`` so the loop vectorises. :func:`silu_and_mul` picks the
realisation from the tensor's device.
"""

from __future__ import annotations

import torch

from minivllm.fast import cpu_ops

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton wheels off Linux: the C++ CPU path still works
    from minivllm.fast._no_triton import tl, triton

__all__ = ["silu_and_mul"]


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,  # (num_tokens, 2 * I): gate then up, rows ``stride_x`` apart
    out_ptr,  # (num_tokens, I), contiguous
    stride_x,  # row stride of x, in elements
    inter,  # I
    BLOCK: tl.constexpr,  # output features per program
):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(x_ptr + token * stride_x + cols, mask=mask).to(tl.float32)
    up = tl.load(x_ptr + token * stride_x + inter + cols, mask=mask).to(tl.float32)
    silu = gate / (1.0 + tl.exp(-gate))  # gate * sigmoid(gate)
    tl.store(out_ptr + token * inter + cols, (silu * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:  # (T, 2I) -> (T, I)
    """``silu(x[..., :I]) * x[..., I:]``."""
    if x.device.type == "cpu":
        return silu_and_mul_cpu(x)
    return silu_and_mul_triton(x)


def _check(x: torch.Tensor) -> None:
    if x.dim() < 1 or x.shape[-1] % 2 != 0:
        raise ValueError(f"x's last dimension must be even (gate | up), got {tuple(x.shape)}")


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as (rows, 2 * I) with unit column stride."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:  # (T, 2I) -> (T, I)
    """:func:`silu_and_mul` by the Triton kernel (CUDA, or the interpreter on a CPU)."""
    _check(x)
    inter = x.shape[-1] // 2
    out = torch.empty((*x.shape[:-1], inter), dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    x2 = _rows(x)
    block = min(triton.next_power_of_2(inter), 1024)
    grid = (x2.shape[0], triton.cdiv(inter, block))
    _silu_and_mul_kernel[grid](x2, out, x2.stride(0), inter, BLOCK=block, num_warps=4)
    return out


def silu_and_mul_cpu(x: torch.Tensor) -> torch.Tensor:  # (T, 2I) -> (T, I)
    """:func:`silu_and_mul` by the C++ op ``torch.ops.minivllm.silu_and_mul``."""
    _check(x)
    inter = x.shape[-1] // 2
    out = torch.empty((*x.shape[:-1], inter), dtype=x.dtype)
    if out.numel():
        cpu_ops.ops().silu_and_mul(out.view(-1, inter), _rows(x))
    return out
