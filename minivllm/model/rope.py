"""The rotary-embedding cache: one ``(cos, sin)`` row per position.

RoPE rotates each pair of query/key features by ``position * inv_freq[i]``
(see :mod:`minivllm.ref.rotary`). Everything that differs between models --
the base ``theta``, partial rotary dims, and the ``rope_scaling`` tricks that
stretch a model to longer contexts -- only changes ``inv_freq`` (and, for
YaRN, a constant ``mscale`` on cos/sin). So we compute, once per model::

    cos_sin_cache[p] = [cos(p * inv_freq) * mscale, sin(p * inv_freq) * mscale]
    # (max_position, rotary_dim) float32: cosines first half, sines second half

which is vLLM's layout. Supported ``rope_type``s:

- ``default``: ``inv_freq[i] = base ** (-2i / rotary_dim)``.
- ``linear``: positions divided by ``factor`` (same as ``inv_freq / factor``).
- ``dynamic`` (NTK-aware): a larger base. transformers recomputes it as the
  sequence grows; like vLLM we use one static cache, computed for the longest
  context we will serve, ``max_position * factor``.
- ``llama3`` (Llama 3.1 / 3.2): low frequencies divided by ``factor``, high
  ones kept, a smooth ramp in between.
- ``yarn``: a per-frequency blend of interpolation and extrapolation, plus an
  attention temperature ``mscale`` folded into cos/sin.

transformers 4.x stores these in ``config.rope_theta`` / ``config.rope_scaling``;
5.x in ``config.rope_parameters`` (``{"rope_type": ..., "rope_theta": ...}``).
:func:`rope_params_from_config` reads either.
"""

from __future__ import annotations

import math
from typing import Any

import torch

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")


def rope_params_from_config(config: Any) -> tuple[float, dict | None, float]:
    """``(rope_theta, rope_scaling or None, partial_rotary_factor)`` from an HF config.

    Reads transformers 5.x ``rope_parameters`` when present, else the 4.x
    ``rope_theta`` / ``rope_scaling`` attributes.
    """
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and "rope_theta" in params:
        theta = float(params["rope_theta"])
        scaling = dict(params)
    else:
        theta = float(getattr(config, "rope_theta", 10000.0))
        scaling = dict(getattr(config, "rope_scaling", None) or {})
    rope_type = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    partial = float(scaling.get("partial_rotary_factor", 0) or 0) if scaling else 0.0
    partial = partial or float(getattr(config, "partial_rotary_factor", 1.0) or 1.0)
    if rope_type == "default":
        return theta, None, partial
    scaling["rope_type"] = rope_type
    return theta, scaling, partial


def _base_inv_freq(base: float, rotary_dim: int) -> torch.Tensor:  # (rotary_dim // 2,)
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    return 1.0 / (base**exponents)


def _llama3_inv_freq(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths (low frequencies) are interpolated, short ones kept,
    # and the band in between ramps smoothly from one to the other.
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_inv_freq(base: float, rotary_dim: int, s: dict) -> tuple[torch.Tensor, float]:
    factor = s["factor"]
    orig_len = s["original_max_position_embeddings"]
    beta_fast, beta_slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        # The feature index whose wavelength fits num_rotations times in orig_len.
        wavelengths = orig_len / (num_rotations * 2 * math.pi)
        return rotary_dim * math.log(wavelengths) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001  # avoid dividing by zero in the ramp

    pos_freqs = base ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    ramp = ((torch.arange(rotary_dim // 2).float() - low) / (high - low)).clamp(0, 1)
    extrapolation_weight = 1 - ramp  # 1 for high frequencies: keep them as they are
    inv_freq = interpolation * (1 - extrapolation_weight) + extrapolation * extrapolation_weight

    mscale = s.get("attention_factor")
    if mscale is None:
        if s.get("mscale") and s.get("mscale_all_dim"):
            mscale = _yarn_mscale(factor, s["mscale"]) / _yarn_mscale(factor, s["mscale_all_dim"])
        else:
            mscale = _yarn_mscale(factor)
    return inv_freq, float(mscale)


def get_rope(
    head_dim: int,
    rotary_dim: int,
    max_position: int,
    base: float,
    rope_scaling: dict | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:  # (cache_len, rotary_dim) float32
    """Build the ``cos_sin_cache`` for one model.

    Args:
        head_dim: features per head (only checked: ``rotary_dim <= head_dim``).
        rotary_dim: how many leading features of each head rotate (even).
        max_position: the model's ``max_position_embeddings``. For ``dynamic``
            and ``yarn`` the cache covers ``max_position * factor`` positions.
        base: ``rope_theta``.
        rope_scaling: ``None`` or a dict with ``rope_type`` (or ``type``) and
            that type's fields, as in HF configs.
        dtype: the model dtype. The cache stays float32 whatever it is (the
            rotation is computed in float32, as transformers does); the
            argument is kept for vLLM's signature.

    Returns:
        ``(cache_len, rotary_dim)`` float32: cosines then sines of each position.
    """
    del dtype  # the cache is float32 by design; see the docstring
    if rotary_dim % 2 or not 2 <= rotary_dim <= head_dim:
        raise ValueError(
            f"rotary_dim must be even and in [2, head_dim={head_dim}], got {rotary_dim}"
        )
    scaling = dict(rope_scaling or {})
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"rope_scaling type must be one of {SUPPORTED_ROPE_TYPES}, got {rope_type!r}"
        )

    mscale, cache_len = 1.0, max_position
    if rope_type == "default":
        inv_freq = _base_inv_freq(base, rotary_dim)
    elif rope_type == "linear":
        inv_freq = _base_inv_freq(base, rotary_dim) / scaling["factor"]
    elif rope_type == "dynamic":
        # vLLM's static NTK: size the base for the longest context we will serve.
        factor = scaling["factor"]
        cache_len = int(max_position * factor)
        base = base * (factor * cache_len / max_position - (factor - 1)) ** (
            rotary_dim / (rotary_dim - 2)
        )
        inv_freq = _base_inv_freq(base, rotary_dim)
    elif rope_type == "llama3":
        inv_freq = _llama3_inv_freq(_base_inv_freq(base, rotary_dim), scaling)
    else:  # yarn
        inv_freq, mscale = _yarn_inv_freq(base, rotary_dim, scaling)
        cache_len = int(scaling["original_max_position_embeddings"] * scaling["factor"])
        cache_len = max(cache_len, max_position)

    positions = torch.arange(cache_len, dtype=torch.float32)
    freqs = torch.outer(positions, inv_freq)  # (cache_len, rotary_dim // 2)
    return torch.cat((freqs.cos() * mscale, freqs.sin() * mscale), dim=-1)
