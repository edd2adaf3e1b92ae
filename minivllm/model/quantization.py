"""Quantize a loaded model's linear layers, or load a GGUF's quantized blocks as they are.

``LLM(model, quantization=...)`` (vLLM's engine argument) ends up here, after
the float weights are loaded:

- ``"int8"`` / ``"int4"``: every projection of every decoder layer
  (:data:`QUANTIZED_LAYERS`) is quantized from the weight this rank holds
  (:func:`minivllm.ref.quantization.quantize`), and the LM head to int8 per
  output channel for both (:data:`LM_HEAD_METHOD`);
- ``"gguf"``: the projections take the ``Q8_0`` / ``Q4_0`` / ``Q4_1`` blocks
  stored in the ``.gguf`` file itself, with no dequantize-requantize round
  trip (vLLM's ``quantization="gguf"``), so the default SmolLM2 runs on the
  4-bit weights it ships with. The LM head takes ``output.weight``'s blocks,
  or ``token_embd.weight``'s when the two are tied (SmolLM2's is ``Q8_0``).

Each value also says what the activations are, in vLLM's vocabulary
(:data:`SCHEMES`): ``"w8a16"`` / ``"w4a16"`` / ``"gguf-a16"`` quantize the
weights only (activations float, as llama.cpp's and vLLM's weight-only
kernels); ``"w8a8"`` / ``"w4a8"`` / ``"gguf-a8"`` quantize the activations too,
per token and group of 32, and multiply with integer dot products (llama.cpp's
``Q8_0 x Q8_0`` / ``Q4_1 x Q8_1``). A bare ``"int8"``, ``"int4"`` or ``"gguf"``
takes :data:`DEFAULT_ACTIVATIONS` (docs/quantization.md says why), except
that int8 activations need ``K`` a multiple of 32: a bare ``"int8"`` leaves a
layer whose ``K`` is not with float activations, where ``"w8a8"`` refuses it. The
choice is recorded on every :class:`QuantizedWeight` (``activations``), so
the matmul and the fast model runner read it from the weight.

Why the LM head too: a batch-1 decode step reads every weight once, and
SmolLM2's LM head (49152 x 576, tied to the embedding) is 113 MB in float32,
more than all its quantized layers together; llama.cpp's files keep it 8-bit,
which costs little quality (the logits' error is a small fraction of their
spread). The embedding stays in float: it is a lookup, not a matmul, and when
the two are tied the lookup still reads the float rows (only the LM head's
``weight`` attribute is replaced; the embedding keeps the shared parameter).

A layer's ``weight`` parameter is replaced by a
:class:`~minivllm.ref.quantization.QuantizedWeight`; its ``forward`` multiplies
through :func:`~minivllm.ref.quantization.apply_linear`. A GGUF's blocks reach
every rank through the layer's own ``weight_loader``: the integers, scales and
minimums are each spread to a full ``(N, K)`` float tensor and loaded like a
weight, so the tensor-parallel split (QKV heads, replicated KV heads, gate/up)
is written once, in the linear layers.
"""

from __future__ import annotations

from pathlib import Path
from types import MappingProxyType, ModuleType
from typing import Any

import numpy as np
import torch
from torch import nn

from minivllm.quantized_weight import ACT_GROUP_SIZE, INT4_GROUP_SIZE, METHODS, QuantizedWeight

#: The weight formats (``"gguf"``: the blocks a ``.gguf`` file stores).
WEIGHT_FORMATS = (*METHODS, "gguf")
#: ``quantization=`` values naming a scheme -> (weight format, activations), in vLLM's
#: vocabulary: W8A16 / W4A16 quantize the weights only, W8A8 / W4A8 the activations too.
SCHEMES = MappingProxyType({
    "w8a16": ("int8", "float"), "w8a8": ("int8", "int8"),
    "w4a16": ("int4", "float"), "w4a8": ("int4", "int8"),
    "gguf-a16": ("gguf", "float"), "gguf-a8": ("gguf", "int8"),
})
#: The activations a bare weight format gets: int8 (W8A8 / W4A8) for all three. The rule
#: (issue 25): the faster scheme wherever its perplexity is within 1% of the other's. On
#: SmolLM2 (docs/quantization.md, "W8A8") int8 activations cost +0.49% (int8 weights),
#: -0.12% (int4) and -0.11% (GGUF) against float activations in float32, and their
#: kernels are 1.2-1.9x faster at 64 rows and level at one.
DEFAULT_ACTIVATIONS = MappingProxyType({"int8": "int8", "int4": "int8", "gguf": "int8"})
#: Every value ``quantization=`` accepts (None: the float weights).
QUANTIZATION_METHODS = (*WEIGHT_FORMATS, *SCHEMES)
#: The layers that are quantized (the names of the decoder layers' projections).
QUANTIZED_LAYERS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
#: GGUF block types loaded without dequantizing -> our method.
GGUF_NATIVE_TYPES = MappingProxyType({"Q8_0": "int8", "Q4_0": "int4", "Q4_1": "int4"})
#: The LM head's format for each weight format that quantizes float weights.
LM_HEAD_METHOD = MappingProxyType({"int8": "int8", "int4": "int8"})


def check_quantization(value: str | None, model: str | Path | None = None) -> str | None:
    """Return ``value`` if ``quantization=value`` is allowed, else raise ``ValueError``."""
    if value is not None and value not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization must be None or one of {QUANTIZATION_METHODS}, "
                         f"got {value!r}")  # fmt: skip
    return value


def quantization_scheme(value: str) -> tuple[str, str]:
    """``(weight format, activations)`` of a ``quantization=`` value, e.g. ``"w8a8"`` ->
    ``("int8", "int8")``, ``"int4"`` -> ``("int4", DEFAULT_ACTIVATIONS["int4"])``."""
    check_quantization(value)
    if value in SCHEMES:
        return SCHEMES[value]
    return value, DEFAULT_ACTIVATIONS[value]


def quantized_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, layer)`` for every linear layer that quantization replaces."""
    return [(name, m) for name, m in model.named_modules()
            if name.rpartition(".")[2] in QUANTIZED_LAYERS]  # fmt: skip


def lm_head_of(model: nn.Module) -> nn.Module | None:
    """The model's LM head if this rank computes logits with one (else None: another
    pipeline stage's, or a model without one)."""
    head = getattr(model, "lm_head", None)
    return head if isinstance(getattr(head, "weight", None), torch.Tensor) else None


def _set_weight(layer: nn.Module, weight: QuantizedWeight) -> None:
    # The float Parameter goes; a plain attribute takes its place. A tied LM head
    # shares its Parameter with the embedding, which keeps it (and its float rows).
    del layer.weight
    layer.weight = weight


def quantize_model(model: nn.Module, method: str, ops: ModuleType,
                   gguf_path: str | Path | None = None) -> nn.Module:
    """Replace the weights of :func:`quantized_layers` with quantized ones, in place.

    Args:
        model: a loaded model (float weights).
        method: a ``quantization=`` value (:data:`QUANTIZATION_METHODS`): the weight
            format and the activations (:func:`quantization_scheme`).
        ops: the ``quantization`` component that will run the matmuls.
        gguf_path: the ``.gguf`` file the model was loaded from (GGUF schemes only).
    """
    fmt, activations = quantization_scheme(method)
    if fmt == "gguf":
        if gguf_path is None or Path(gguf_path).suffix != ".gguf":
            raise ValueError(f"quantization={method!r} needs a .gguf model (or a registered "
                             f"name converted from one), got {gguf_path!r}")  # fmt: skip
        _load_gguf_blocks(model, ops, Path(gguf_path), method, activations)
        return model
    layers = quantized_layers(model)
    head = lm_head_of(model)
    if head is not None:  # (..., V_r, K): this rank's vocabulary rows
        layers.append(("lm_head", head))
    for name, layer in layers:
        w = layer.weight.data  # (..., N, K): this rank's (or every simulated rank's) weight
        k = w.shape[-1]
        _check_k(method, name, k, INT4_GROUP_SIZE if fmt == "int4" else 1)
        acts = activations
        if acts == "int8" and k % ACT_GROUP_SIZE and method not in SCHEMES:
            acts = "float"  # a bare "int8" on a layer whose K no group of 32 divides: W8A16
        _check_k(method, name, k, ACT_GROUP_SIZE if acts == "int8" else 1)
        q = ops.quantize(w, LM_HEAD_METHOD[fmt] if layer is head else fmt)
        _set_weight(layer, QuantizedWeight(q.method, q.qweight, q.scales, q.mins,
                                           q.group_size, ops, acts))
    return model


def _check_k(method: str, name: str, k: int, multiple: int) -> None:
    if k % multiple:
        raise ValueError(f"quantization={method!r}: layer {name} has K = {k} input features "
                         f"per rank, not a multiple of {multiple}")


# --------------------------------------------------------------------------
# GGUF blocks, loaded as they are
# --------------------------------------------------------------------------


def gguf_blocks(data: np.ndarray, type_name: str) -> tuple[np.ndarray, ...]:
    """Split a GGUF tensor's raw bytes into ``(q, scale, min)``, each ``(N, K)`` float32.

    ``data``: the ``(N, bytes per row)`` uint8 array ``gguf.GGUFReader`` gives.
    Block layouts (llama.cpp's ``ggml-common.h``), 32 weights each:
    ``Q8_0``: fp16 ``d``, 32 int8 ``q``, ``w = d q``. ``Q4_0``: fp16 ``d``, 16
    bytes of nibbles, ``w = d q - 8 d``. ``Q4_1``: fp16 ``d``, fp16 ``m``, 16
    bytes, ``w = d q + m``. Nibbles: byte ``j`` holds ``q[j]`` low, ``q[j + 16]`` high.
    ``min`` is None for ``Q8_0``.
    """
    n = data.shape[0]
    size = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}[type_name]
    blocks = np.ascontiguousarray(data).reshape(n, -1, size)  # (N, G, bytes a block)
    d = blocks[..., 0:2].copy().view(np.float16).astype(np.float32)  # (N, G, 1)
    if type_name == "Q8_0":
        q = blocks[..., 2:34].copy().view(np.int8).astype(np.float32)  # (N, G, 32)
        m = None
    else:
        start = 2 if type_name == "Q4_0" else 4
        nib = blocks[..., start:start + 16]
        q = np.concatenate([nib & 0xF, nib >> 4], axis=-1).astype(np.float32)  # (N, G, 32)
        m = (-8 * d if type_name == "Q4_0"
             else blocks[..., 2:4].copy().view(np.float16).astype(np.float32))  # fmt: skip
    full = (n, q.shape[1] * 32)

    def spread(v: np.ndarray) -> np.ndarray:  # one value per group -> one per weight
        return np.broadcast_to(v, q.shape).reshape(full)

    return q.reshape(full), spread(d), None if m is None else spread(m)


def _gguf_sources(layer_name: str) -> list[tuple[str, Any]]:
    """``(gguf tensor name, shard_id)`` pieces of one fused layer, e.g. ``model.layers.3.qkv_proj``."""
    index = int(layer_name.split(".")[2])
    kind = layer_name.rpartition(".")[2]
    pieces = {
        "qkv_proj": [("attn_q", "q"), ("attn_k", "k"), ("attn_v", "v")],
        "o_proj": [("attn_output", None)],
        "gate_up_proj": [("ffn_gate", 0), ("ffn_up", 1)],
        "down_proj": [("ffn_down", None)],
    }[kind]
    return [(f"blk.{index}.{name}.weight", shard) for name, shard in pieces]


def _load_gguf_blocks(model: nn.Module, ops: ModuleType, path: Path, method: str,
                      activations: str) -> None:
    from minivllm.model.gguf_loader import open_gguf

    reader = open_gguf(path)
    tensors = {t.name: t for t in reader.tensors}
    layers = [(name, layer, _gguf_sources(name)) for name, layer in quantized_layers(model)]
    head = lm_head_of(model)
    if head is not None:  # untied: output.weight; tied: the embedding's blocks
        source = "output.weight" if "output.weight" in tensors else "token_embd.weight"
        layers.append(("lm_head", head, [(source, None)]))
    for name, layer, sources in layers:
        types = {tensors[s].tensor_type.name for s, _ in sources}
        if len(types) != 1 or next(iter(types)) not in GGUF_NATIVE_TYPES:
            continue  # e.g. F32 or K-quant blocks: this layer keeps its dequantized weight
        _check_k(method, name, layer.weight.shape[-1], 32)  # GGUF blocks: 32 weights
        weight = _gguf_weight(layer, sources, tensors, types.pop(), model.config, ops, activations)
        if activations == "int8" and weight.method == "int8" and weight.qweight.min() < -127:
            # the integer kernels take |q| <= 127 (llama.cpp's quantizer never writes -128)
            raise ValueError(f"quantization={method!r}: layer {name}'s Q8_0 blocks hold -128; "
                             f"int8 activations need weights in [-127, 127]")
        _set_weight(layer, weight)


def _gguf_weight(layer: nn.Module, sources: list[tuple[str, Any]], tensors: dict,
                 type_name: str, config: Any, ops: ModuleType,
                 activations: str = "float") -> QuantizedWeight:
    """This rank's :class:`QuantizedWeight` for ``layer`` from the GGUF ``sources``' blocks."""
    from minivllm.model.gguf_loader import unpermute_qk

    method = GGUF_NATIVE_TYPES[type_name]
    # Three scratch "weights" shaped like this rank's: integers, scales, minimums.
    parts = [torch.empty(layer.weight.shape) for _ in range(3 if method == "int4" else 2)]
    for source, shard in sources:
        arrays = gguf_blocks(tensors[source].data, type_name)
        for part, array in zip(parts, arrays):
            if shard in ("q", "k"):  # llama.cpp's Q/K row order -> HF's
                heads = config.num_attention_heads if shard == "q" \
                    else config.num_key_value_heads
                array = unpermute_qk(array, heads)
            full = torch.from_numpy(np.array(array, dtype=np.float32))
            if shard is None:
                layer.weight_loader(part, full)
            else:
                layer.weight_loader(part, full, shard)
    device = layer.weight.device
    # The blocks' scales and minimums are float16 in the file. The integer kernels (int8
    # activations) read them so: exact, and 2 bytes a block less to stream at batch 1
    # (a Q4_1 row is 20 bytes a block, not 24). The float-activation kernels read float32.
    per_block = [p[..., ::32].contiguous() for p in parts[1:]]  # scales (, mins), float32
    if activations == "int8" and all(torch.equal(p.half().float(), p) for p in per_block):
        per_block = [p.half() for p in per_block]  # (Q4_0's m = -8 d is exact too)
    q, scales = parts[0], per_block[0].to(device)
    if method == "int8":
        return QuantizedWeight("int8", q.to(torch.int8).to(device), scales, None, 32, ops,
                               activations)
    mins = per_block[1].to(device)
    return QuantizedWeight("int4", ops.pack_int4(q).to(device), scales, mins, INT4_GROUP_SIZE, ops,
                           activations)
