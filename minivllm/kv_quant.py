"""The KV cache's storage formats (``kv_cache_dtype``), and the one quantization formula.

vLLM's engine argument ``kv_cache_dtype`` picks how each layer's paged K/V
cache is stored:

==================  =======================  ============================  ==========================
``kv_cache_dtype``  stored as                scale                         bytes per (token, KV head)
==================  =======================  ============================  ==========================
``"auto"``          the model's dtype        none                          ``D * itemsize``
``"int8"``          ``torch.int8``           float32 per (token, KV head)  ``D + 4``
``"fp8"``           ``torch.float8_e4m3fn``  float32 per (token, KV head)  ``D + 4``
==================  =======================  ============================  ==========================

(``"fp8_e4m3"`` is ``"fp8"``.) A quantized layer's cache is four tensors, the
scales beside the values::

    k_cache, v_cache  (num_blocks, block_size, H_kv, D)  int8 / float8_e4m3fn
    k_scale, v_scale  (num_blocks, block_size, H_kv)     float32

so the scale of the row in slot ``s`` sits at the same ``[s // block_size, s %
block_size]`` index: the block table and the slot mapping address both.

**The formula** (:func:`quantize`, on write; :func:`dequantize`, on read). One
(token, KV head) row ``x`` of ``D`` values::

    s = max_i |x_i| / QMAX        QMAX = 127 (int8), 448 (e4m3's largest finite value)
    q = round(x / s)              int8: to the nearest integer, ties to even, in [-127, 127]
                                  fp8: to the nearest e4m3 value, ties to even
    x' = q * s                    (a row of zeros has s = 0 and q = 0)

in float32 arithmetic, ``x / s`` a true division: every twin (the ref, the C++
op, the Triton kernel) computes exactly these codes and scales.

**The error**, from the formula. int8 steps are uniform, ``s`` apart, so
``|x - x'| <= s / 2``. e4m3 has 3 mantissa bits, so for ``|x / s| >= 2^-6``
(its normal range) ``|x - x'| <= |x| / 16``, and below that its step is
``2^-9 s`` (``|x - x'| <= s / 1024``). int8 is finer for the largest values of
a row (relative ``1/254`` at the maximum, against fp8's ``1/16``), fp8 for the
smallest (int8 rounds everything below ``s / 2`` to zero).

**Why one scale per (token, KV head)**:

- It is known when the row is written, from that row alone, and never changes:
  a scale shared by many tokens (per block, per layer) is either calibrated
  ahead of time (vLLM's per-layer ``k_scale``/``v_scale`` come from the
  checkpoint and default to 1.0, which overflows e4m3 for a row above 448) or
  would have to rescale rows already stored. A block's contents depend on its
  tokens only, so prefix caching, chunked prefill and recompute after
  preemption all see the same bytes.
- A row is what a kernel loads at once (one token, one KV head: ``D``
  contiguous values), and its scale factors out of both products of attention:
  ``q . (s k) = s (q . k)`` and ``sum_t p_t (s_t v_t) = sum_t (p_t s_t) v_t``.
- It costs 4 bytes per ``D``: 6% at ``D = 64``, 3% at 128. llama.cpp's
  ``q8_0`` keeps one fp16 scale per 32 values (the same bytes at ``D = 64``),
  finer where a row's values differ in size. Keys do: a few channels carry
  most of the magnitude (KIVI quantizes keys per channel for that), but a
  per-channel scale spans tokens, which the first point rules out.
"""

from __future__ import annotations

from types import MappingProxyType

import torch

#: vLLM's values of ``kv_cache_dtype``.
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "int8")

#: The storage dtype of each quantized ``kv_cache_dtype``.
STORAGE_DTYPES = MappingProxyType({
    "int8": torch.int8, "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn,
})

#: The largest code of each quantized storage dtype: ``s = max|x| / QMAX``.
QMAX = MappingProxyType({torch.int8: 127.0, torch.float8_e4m3fn: 448.0})

#: The dtype of the scales.
SCALE_DTYPE = torch.float32


def check_kv_cache_dtype(value: object) -> None:
    """Raise ``ValueError`` naming ``kv_cache_dtype`` unless it is one of :data:`KV_CACHE_DTYPES`."""
    if not (isinstance(value, str) and value in KV_CACHE_DTYPES):
        raise ValueError(f"kv_cache_dtype must be one of {list(KV_CACHE_DTYPES)}, got {value!r}")


def cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype,
                device: torch.device | str = "cpu") -> torch.dtype:
    """The dtype the cache is stored in: the model's for ``"auto"``, else int8 / e4m3.

    The Triton kernels read e4m3 with the GPU's float8 instructions, which
    need compute capability 8.9 (Ada, Hopper) or newer: fp8 on an older GPU is a
    ``ValueError``.
    """
    check_kv_cache_dtype(kv_cache_dtype)
    if kv_cache_dtype == "auto":
        return model_dtype
    dtype = STORAGE_DTYPES[kv_cache_dtype]
    device = torch.device(device)
    if dtype == torch.float8_e4m3fn and device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) < (8, 9):
            raise ValueError(f"kv_cache_dtype must be 'auto' or 'int8' on this GPU (compute "
                             f"capability {major}.{minor}; e4m3 needs 8.9 or newer), "
                             f"got {kv_cache_dtype!r}")
    return dtype


def is_quantized(dtype: torch.dtype) -> bool:
    """True for a quantized cache dtype (its cache has scales beside it)."""
    return dtype in QMAX


def check_scales(k_cache, v_cache, k_scale, v_scale) -> None:
    """A quantized cache comes with both scale tensors, ``(num_blocks, block_size, H_kv)``
    float32; a float cache with neither (the cache_write and attention twins check this)."""
    quantized = is_quantized(k_cache.dtype)
    if v_cache.dtype != k_cache.dtype:
        raise ValueError(f"k_cache and v_cache must share a dtype, got {k_cache.dtype} "
                         f"and {v_cache.dtype}")
    if not quantized:
        if k_scale is not None or v_scale is not None:
            raise ValueError(f"k_scale/v_scale are for a quantized (int8 / fp8) cache; "
                             f"this cache is {k_cache.dtype}")
        return
    for name, t in (("k_scale", k_scale), ("v_scale", v_scale)):
        if t is None:
            raise ValueError(f"{name} is required with a {k_cache.dtype} cache")
        if tuple(t.shape) != tuple(k_cache.shape[:3]) or t.dtype != SCALE_DTYPE:
            raise ValueError(f"{name} must be {SCALE_DTYPE} of shape (num_blocks, "
                             f"block_size, num_kv_heads) = {tuple(k_cache.shape[:3])}, got "
                             f"{t.dtype} {tuple(t.shape)}")


def bytes_per_token_head(head_dim: int, dtype: torch.dtype) -> int:
    """Bytes one (token, KV head) row costs in K or in V, its scale included."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    scale = torch.empty((), dtype=SCALE_DTYPE).element_size() if is_quantized(dtype) else 0
    return head_dim * itemsize + scale


def allocate(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
             dtype: torch.dtype, device: torch.device | str) -> tuple[torch.Tensor, ...]:
    """One layer's cache: ``(k_cache, v_cache)``, plus ``(k_scale, v_scale)`` if quantized."""
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    cache = (torch.zeros(shape, dtype=dtype, device=device),
             torch.zeros(shape, dtype=dtype, device=device))
    if not is_quantized(dtype):
        return cache
    return cache + (torch.zeros(shape[:3], dtype=SCALE_DTYPE, device=device),
                    torch.zeros(shape[:3], dtype=SCALE_DTYPE, device=device))


def quantize(x: torch.Tensor,  # (..., D) float32 / float16 / bfloat16
             dtype: torch.dtype,
             ) -> tuple[torch.Tensor, torch.Tensor]:  # (..., D) codes, (...) float32 scales
    """Quantize each row of the last dimension: ``s = max|x| / QMAX``, ``q = round(x / s)``."""
    x = x.float()
    scale = x.abs().amax(dim=-1) / QMAX[dtype]  # (...,)
    # A row of zeros has s = 0: divide by 1 instead (its codes are 0 either way).
    y = x / torch.where(scale > 0, scale, 1.0).unsqueeze(-1)  # (..., D), |y| <= QMAX
    if dtype == torch.int8:
        q = torch.round(y).clamp(-127, 127).to(torch.int8)  # round: ties to even
    else:
        q = y.to(dtype)  # the nearest e4m3 value, ties to even
    return q, scale


def dequantize(q: torch.Tensor,  # (..., D) int8 / float8_e4m3fn codes
               scale: torch.Tensor,  # (...) float32
               ) -> torch.Tensor:  # (..., D) float32
    """``x' = q * s``, in float32."""
    return q.float() * scale.unsqueeze(-1)
