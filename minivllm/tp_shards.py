"""Shard arithmetic for tensor parallelism, shared by both ``linear`` twins.

Which tensor-parallel sizes split a layer or a whole model evenly (the one
``check_tp_size`` and ``valid_tp_sizes`` the executors use too), how KV heads
are divided or replicated, how the vocabulary is padded, and the
weight-loading shape check.
Both :mod:`minivllm.ref.linear` (every rank simulated in one process) and
:mod:`minivllm.fast.linear` (one process per rank) use these, so the two can
only differ in *where* the shards live, never in how they are cut.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from minivllm.config import cdiv
from minivllm.hf_config import num_kv_heads


def divisors(n: int) -> list[int]:
    """All ``d >= 1`` with ``n % d == 0``, ascending."""
    return [d for d in range(1, n + 1) if n % d == 0]


def check_tp_size(tp_size: int, hf_config: Any = None) -> None:
    """Raise ``ValueError`` unless ``tp_size`` is a positive int that splits the model.

    Without ``hf_config`` only the first half is checked (a layer checks its
    own split itself); with it, ``tp_size`` must be one of
    :func:`valid_tp_sizes` ``(hf_config)``, and the error names the model's
    head counts and the sizes that work.
    """
    if not isinstance(tp_size, int) or tp_size < 1:
        raise ValueError(f"tp_size must be an int >= 1, got {tp_size!r}")
    if hf_config is None:
        return
    ok = valid_tp_sizes(hf_config)
    if tp_size not in ok:
        heads, kv_heads = _head_counts(hf_config)
        raise ValueError(
            f"tensor_parallel_size={tp_size} does not split this model "
            f"(num_attention_heads={heads}, num_key_value_heads={kv_heads}, "
            f"intermediate_size={hf_config.intermediate_size}); tp sizes that work: {ok}"
        )


def valid_tp_sizes(hf_config: Any) -> list[int]:
    """The tensor-parallel sizes a Llama-family model (its HF config) splits evenly into.

    Those :func:`qkv_tp_sizes` allows for its heads that also divide the
    MLP's ``intermediate_size``. The vocabulary is padded
    (:func:`vocab_partition`), so it never limits ``tp_size``.
    """
    heads, kv_heads = _head_counts(hf_config)
    return [tp for tp in qkv_tp_sizes(heads, kv_heads) if hf_config.intermediate_size % tp == 0]


def _head_counts(hf_config: Any) -> tuple[int, int]:
    """``(num_attention_heads, num_key_value_heads)`` (:func:`~minivllm.hf_config.num_kv_heads`)."""
    return hf_config.num_attention_heads, num_kv_heads(hf_config)


def divide(numerator: int, tp_size: int, what: str) -> int:
    """``numerator // tp_size``, or a ``ValueError`` naming ``what`` and the sizes that work."""
    check_tp_size(tp_size)
    if numerator % tp_size != 0:
        raise ValueError(
            f"{what}={numerator} is not divisible by tp_size={tp_size}; "
            f"tp sizes that work: {divisors(numerator)}"
        )
    return numerator // tp_size


def qkv_tp_sizes(total_num_heads: int, total_num_kv_heads: int) -> list[int]:
    """The ``tp_size`` values :class:`QKVParallelLinear` accepts for these head counts.

    The query heads must split evenly. The KV heads either split evenly too,
    or (``tp_size > num_kv_heads``) each KV head is replicated on
    ``tp_size / num_kv_heads`` ranks, which needs ``tp_size % num_kv_heads == 0``.
    """
    return [
        tp
        for tp in divisors(total_num_heads)
        if total_num_kv_heads % tp == 0 or tp % total_num_kv_heads == 0
    ]


def kv_head_partition(total_num_kv_heads: int, tp_size: int) -> tuple[int, int]:
    """``(num_kv_heads per rank, num_kv_head_replicas)`` for a tp-sharded QKV.

    With at least as many KV heads as ranks, each rank gets
    ``total / tp_size`` of them and nothing is replicated; with fewer, each
    rank gets one and each KV head lives on ``tp_size / total`` ranks.
    """
    if tp_size <= total_num_kv_heads:
        return total_num_kv_heads // tp_size, 1
    return 1, tp_size // total_num_kv_heads


def vocab_partition(num_embeddings: int, tp_size: int) -> tuple[int, int]:
    """``(rows per rank, padded vocabulary size)``: the vocabulary padded to a
    multiple of ``tp_size``, so every rank holds ``ceil(vocab / tp_size)`` rows."""
    check_tp_size(tp_size)
    per_partition = cdiv(num_embeddings, tp_size)
    return per_partition, per_partition * tp_size


def default_weight_loader(param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
    """Copy a whole, unsharded checkpoint tensor into ``param`` (shapes must match)."""
    check_shape(loaded_weight, tuple(param.shape), "default_weight_loader")
    param.data.copy_(loaded_weight)


def check_shape(loaded: torch.Tensor, expected: tuple[int, ...], what: str) -> None:
    if tuple(loaded.shape) != tuple(expected):
        raise ValueError(f"{what}: checkpoint shape {tuple(loaded.shape)} != expected {expected}")


def check_qkv_split(total_num_heads: int, total_num_kv_heads: int, tp_size: int) -> None:
    """Raise ``ValueError`` listing the sizes that work if ``tp_size`` cannot split q/k/v."""
    check_tp_size(tp_size)
    ok = qkv_tp_sizes(total_num_heads, total_num_kv_heads)
    if tp_size not in ok:
        raise ValueError(
            f"QKVParallelLinear: tp_size={tp_size} does not split "
            f"total_num_heads={total_num_heads}, total_num_kv_heads={total_num_kv_heads} "
            f"(query heads must divide evenly; KV heads divide evenly or are replicated "
            f"when tp_size is a multiple of them); tp sizes that work: {ok}"
        )
