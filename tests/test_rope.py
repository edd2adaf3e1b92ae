"""The RoPE cache and its scaling variants against transformers' own rotary code.

Oracle: transformers' ``Phi3RotaryEmbedding`` (unlike Llama's it honours
``partial_rotary_factor``; it dispatches every scaling type to
``ROPE_INIT_FUNCTIONS``) on a ``LlamaConfig``, and Phi-3's ``apply_rotary_pos_emb``
(which rotates only the first ``rotary_dim`` features).
Ours: :func:`minivllm.model.rope.get_rope` feeding
the ref rotary kernel and the backend under test.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from minivllm import backend
from minivllm.model.rope import get_rope, rope_params_from_config
from minivllm.ref import rotary as ref_rotary

MAX_POS = 48

SCALINGS = {
    "default": {"rope_type": "default"},
    "linear": {"rope_type": "linear", "factor": 2.5},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
             "beta_fast": 32, "beta_slow": 1},
}
# (head_dim, partial_rotary_factor): a non-power-of-2 head, and partial rotation.
SHAPES = [(40, 1.0), (24, 0.5), (16, 0.75)]


def _hf_config(scaling: dict, head_dim: int, partial: float, theta: float = 500.0):
    from transformers import LlamaConfig

    params = dict(scaling, rope_theta=theta)
    if partial != 1.0:
        params["partial_rotary_factor"] = partial
    return LlamaConfig(hidden_size=3 * head_dim, num_attention_heads=3, num_key_value_heads=1,
                      max_position_embeddings=MAX_POS, rope_parameters=params)


def _hf_cos_sin(config, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    rope = Phi3RotaryEmbedding(config)
    x = torch.zeros(1, dtype=torch.float32)
    # dynamic NTK: feeding the whole cache length first makes transformers grow
    # its base for that length, which is what our static cache is built for.
    rope(x, torch.arange(int(positions.max()) + 1)[None])
    return rope(x, positions[None])  # each (1, T, rotary_dim), halves duplicated


def _our_cache(config) -> torch.Tensor:
    theta, scaling, partial = rope_params_from_config(config)
    head_dim = config.hidden_size // config.num_attention_heads
    return get_rope(head_dim, int(head_dim * partial), config.max_position_embeddings, theta,
                    scaling)


@pytest.mark.parametrize("head_dim,partial", SHAPES)
@pytest.mark.parametrize("kind", sorted(SCALINGS))
def test_cache_matches_transformers(kind, head_dim, partial):
    config = _hf_config(SCALINGS[kind], head_dim, partial)
    cache = _our_cache(config)  # (cache_len, rotary_dim)
    rotary_dim = int(head_dim * partial)
    assert cache.shape[1] == rotary_dim and cache.dtype == torch.float32
    if kind == "dynamic":
        assert cache.shape[0] == MAX_POS * 2  # sized for the extended context
    positions = torch.arange(cache.shape[0])
    cos, sin = _hf_cos_sin(config, positions)
    half = rotary_dim // 2
    torch.testing.assert_close(cache[:, :half], cos[0, :, :half], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(cache[:, half:], sin[0, :, :half], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("head_dim,partial", SHAPES)
@pytest.mark.parametrize("kind", ["default", "llama3", "yarn"])
def test_apply_rotary_matches_transformers(kind, head_dim, partial):
    from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb

    config = _hf_config(SCALINGS[kind], head_dim, partial)
    cache = _our_cache(config)
    g = torch.Generator().manual_seed(head_dim)
    T, H, H_kv = 13, 3, 1
    positions = torch.randint(0, cache.shape[0], (T,), generator=g)
    q = torch.randn(T, H, head_dim, generator=g)
    k = torch.randn(T, H_kv, head_dim, generator=g)
    cos, sin = _hf_cos_sin(config, positions)
    # transformers wants (batch, heads, T, D)
    q_hf, k_hf = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    q_hf, k_hf = q_hf[0].transpose(0, 1), k_hf[0].transpose(0, 1)

    for impl in (ref_rotary, backend.get("rotary")):
        q_out, k_out = impl.apply_rotary_emb(positions, q.clone(), k.clone(), cache, True)
        torch.testing.assert_close(q_out, q_hf, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(k_out, k_hf, atol=1e-5, rtol=1e-5)


def test_reads_transformers_4_style_config():
    """rope_theta / rope_scaling attributes (transformers 4.x) work like rope_parameters."""
    old = SimpleNamespace(rope_theta=500.0, partial_rotary_factor=0.5,
                          rope_scaling={"type": "linear", "factor": 2.5})
    theta, scaling, partial = rope_params_from_config(old)
    assert (theta, scaling["rope_type"], scaling["factor"], partial) == (500.0, "linear", 2.5, 0.5)
    new = _hf_config(SCALINGS["linear"], 24, 0.5)
    assert rope_params_from_config(new)[0] == 500.0
    assert rope_params_from_config(new)[2] == 0.5
    none = SimpleNamespace(rope_theta=10000.0, rope_scaling=None)
    assert rope_params_from_config(none) == (10000.0, None, 1.0)


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="rope_scaling type"):
        get_rope(16, 16, 32, 10000.0, {"rope_type": "longrope"})
    with pytest.raises(ValueError, match="rotary_dim"):
        get_rope(16, 15, 32, 10000.0)
    with pytest.raises(ValueError, match="rotary_dim"):
        get_rope(16, 32, 32, 10000.0)
