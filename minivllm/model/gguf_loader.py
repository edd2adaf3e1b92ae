"""Read a llama.cpp GGUF file as an HF config plus HF-named float tensors.

GGUF (llama.cpp's format) stores the config as key/value metadata
(``llama.embedding_length``, ``llama.block_count``, ...), the tokenizer as
token/merge lists, and each weight as a block-quantized tensor (``Q4_1``:
blocks of 32 weights sharing an fp16 scale ``d`` and minimum ``m``, each
weight a 4-bit ``q`` with value ``d * q + m``). We:

1. build a ``transformers.LlamaConfig`` from the metadata;
2. dequantize every tensor with ``gguf.quants.dequantize`` (the reference
   numpy dequantizer that ships with llama.cpp's ``gguf`` package);
3. rename it to the HF name (``blk.3.attn_q.weight`` ->
   ``model.layers.3.self_attn.q_proj.weight``);
4. undo llama.cpp's Q/K row permutation (below).

**The Q/K permutation.** HF Llama checkpoints apply RoPE "rotate half" style:
feature ``i`` of a head pairs with feature ``i + D/2``. llama.cpp's ``llama``
architecture rotates adjacent pairs ``(2i, 2i+1)`` instead, so its converter
(``convert_hf_to_gguf.py``) reorders the rows of ``W_q`` and ``W_k`` within
each head -- row ``i`` goes to ``2i`` and row ``i + D/2`` to ``2i + 1`` --
which makes the two conventions compute the same thing. We read the rows back
into HF order, so the rest of minivllm sees an ordinary HF Llama.

The tokenizer (and chat template) is rebuilt from the GGUF metadata by
transformers' GGUF tokenizer converter (no weights go through transformers).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from types import MappingProxyType
from typing import Any

import numpy as np
import torch

#: GGUF tensor name (after ``blk.N.``) -> HF name (after ``model.layers.N.``).
LAYER_TENSOR_NAMES = MappingProxyType({
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
})
#: Tensors outside the layers.
GLOBAL_TENSOR_NAMES = MappingProxyType({
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
})
_LAYER_RE = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")


def gguf_to_hf_name(name: str) -> str | None:
    """HF name of a GGUF tensor, or None for tensors we do not use (e.g. ``rope_freqs``)."""
    m = _LAYER_RE.match(name)
    if m:
        layer, kind, suffix = m.groups()
        hf = LAYER_TENSOR_NAMES.get(kind)
        return f"model.layers.{layer}.{hf}.{suffix}" if hf else None
    base, _, suffix = name.rpartition(".")
    hf = GLOBAL_TENSOR_NAMES.get(base)
    return f"{hf}.{suffix}" if hf else None


def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter permutation: HF "rotate half" rows -> interleaved pairs.

    Within each head, row ``i < D/2`` moves to ``2i`` and row ``D/2 + i`` to ``2i + 1``.
    (Used by tests to build GGUF files the way ``convert_hf_to_gguf.py`` does.)
    """
    rows = w.shape[0]
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo :func:`permute_qk`: interleaved pairs -> HF "rotate half" row order."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _field(reader: Any, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def config_from_gguf(reader: Any) -> Any:
    """A ``transformers.LlamaConfig`` built from a GGUF file's metadata."""
    from transformers import LlamaConfig

    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"GGUF general.architecture must be 'llama', got {arch!r}")

    def get(key: str, default: Any = None) -> Any:
        return _field(reader, f"llama.{key}", default)

    hidden, n_head = get("embedding_length"), get("attention.head_count")
    vocab = get("vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
    rope_parameters: dict[str, Any] = {"rope_type": "default",
                                       "rope_theta": float(get("rope.freq_base", 10000.0))}
    scaling_type = get("rope.scaling.type")
    if scaling_type not in (None, "none"):
        rope_parameters.update(rope_type=scaling_type, factor=float(get("rope.scaling.factor")))
        if get("rope.scaling.original_context_length"):
            rope_parameters["original_max_position_embeddings"] = int(
                get("rope.scaling.original_context_length"))
    names = {t.name for t in reader.tensors}
    return LlamaConfig(
        architectures=["LlamaForCausalLM"],
        vocab_size=int(vocab),
        hidden_size=int(hidden),
        intermediate_size=int(get("feed_forward_length")),
        num_hidden_layers=int(get("block_count")),
        num_attention_heads=int(n_head),
        num_key_value_heads=int(get("attention.head_count_kv", n_head)),
        head_dim=int(get("attention.key_length", hidden // n_head)),
        max_position_embeddings=int(get("context_length", 2048)),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_parameters=rope_parameters,
        tie_word_embeddings="output.weight" not in names,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=_field(reader, "tokenizer.ggml.eos_token_id"),
        pad_token_id=_field(reader, "tokenizer.ggml.padding_token_id"),
    )


def iterate_gguf_tensors(reader: Any, config: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, float32 tensor)`` for each weight, dequantized and un-permuted."""
    from gguf.quants import dequantize

    for t in reader.tensors:
        name = gguf_to_hf_name(t.name)
        if name is None:
            continue
        w = dequantize(t.data, t.tensor_type)  # (out, in) float32, HF orientation
        if name.endswith("q_proj.weight"):
            w = unpermute_qk(w, config.num_attention_heads)
        elif name.endswith("k_proj.weight"):
            w = unpermute_qk(w, config.num_key_value_heads)
        # np.array copies: F32 tensors come back as read-only views of the mmapped file.
        yield name, torch.from_numpy(np.array(w, dtype=np.float32))


def gguf_tokenizer(path: str | Path) -> Any:
    """The tokenizer (with chat template and bos/eos) stored in a GGUF file's metadata."""
    from minivllm.model.tokenizer import load_tokenizer

    path = Path(path)
    return load_tokenizer(path.parent, gguf_file=path.name)


def open_gguf(path: str | Path) -> Any:
    """A ``gguf.GGUFReader`` over ``path``, or a ``ValueError`` naming the file if it is
    cut short or corrupt.

    The reader parses the header and maps every tensor's bytes when it opens
    the file, so a truncated file fails here, before any model is built; its
    own errors (a numpy reshape, an unknown version) do not say which file.
    """
    import gguf

    try:
        return gguf.GGUFReader(str(path))
    except (ValueError, IndexError, KeyError, OverflowError, TypeError) as e:
        raise ValueError(f"{path}: not a readable GGUF file (truncated or corrupt?): "
                         f"{type(e).__name__}: {e}") from None


def load_gguf(path: str | Path) -> tuple[Any, Iterator[tuple[str, torch.Tensor]], Any]:
    """``(hf_config, weights iterator, tokenizer)`` for a llama GGUF file."""
    reader = open_gguf(path)
    config = config_from_gguf(reader)
    return config, iterate_gguf_tensors(reader, config), gguf_tokenizer(path)


def convert_gguf_to_hf(
    gguf_path: str | Path, out_dir: str | Path, dtype: torch.dtype = torch.float32
) -> Path:
    """Write an HF model directory (config, safetensors, tokenizer) from a GGUF file.

    Args:
        gguf_path: the ``.gguf`` file (architecture ``llama``).
        out_dir: created if needed; existing files of the same names are replaced.
        dtype: storage dtype of ``model.safetensors``. float32 keeps the
            dequantized weights exactly (see docs/models.md).
    """
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config, weights, tokenizer = load_gguf(gguf_path)
    tensors = {name: w.to(dtype).contiguous() for name, w in weights}
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir
