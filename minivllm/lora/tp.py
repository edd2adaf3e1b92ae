"""Tensor parallelism for LoRA: which part of an adapter's A and B each rank holds.

The base projections are split as in :mod:`minivllm.ref.linear` (read that first).
The LoRA delta of a projection, ``(x A^T) B^T``, follows the same split, as vLLM's
``ColumnParallelLinearWithLoRA`` and ``RowParallelLinearWithLoRA`` do:

- **Column-parallel** (``q/k/v_proj``, ``gate/up_proj``): rank ``r`` computes some
  output rows of the base projection from the whole input. It holds the same
  rows of ``B`` and *all* of ``A`` (replicated, it is small): its delta
  ``(x A^T) B_r^T`` is exactly its rows of the full delta, so no communication is
  added. For ``k/v`` with fewer KV heads than ranks, a replicated KV head's rows
  of ``B`` go to every rank that holds the head (:func:`minivllm.tp_shards.kv_head_partition`).
- **Row-parallel** (``o_proj``, ``down_proj``): rank ``r`` holds some *input*
  columns of the base weight and receives only those input features ``x_r``. It
  holds the same columns of ``A`` and all of ``B``: ``x_r A_r^T`` is a partial sum
  of ``x A^T`` over the ranks, and since the expand by ``B`` is linear,
  ``sum_r (x_r A_r^T) B^T = (x A^T) B^T``. So each rank adds its partial delta to
  its partial base output *before* the all-reduce, and the one all-reduce the
  layer already does sums both; the delta costs no extra communication.

:func:`shard_lora` cuts one module's ``(A, B)`` for a rank from the full PEFT
tensors, using the same shard arithmetic as the base layers
(:mod:`minivllm.tp_shards`), so an adapter's rows always line up with the
base weight's rows on the same rank.
"""

from __future__ import annotations

from typing import Any

import torch

from minivllm.hf_config import attention_config
from minivllm.lora.models import COLUMN_PARALLEL, SUPPORTED_MODULES
from minivllm.tp_shards import check_tp_size, divide, kv_head_partition


def shard_rows(module: str, hf_config: Any, tp_rank: int, tp_size: int) -> tuple[int, int]:
    """``(first, count)``: the output rows (column-parallel ``module``) or input columns
    (row-parallel) of the full weight that rank ``tp_rank`` of ``tp_size`` holds."""
    check_tp_size(tp_size)
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank must be in [0, {tp_size}), got {tp_rank!r}")
    if module not in SUPPORTED_MODULES:
        raise ValueError(f"module must be one of {list(SUPPORTED_MODULES)}, got {module!r}")
    dims = attention_config(hf_config)
    d, heads, kv_heads = dims.head_dim, dims.num_heads, dims.num_kv_heads
    if module in ("q_proj", "o_proj"):  # q's output rows and o's input columns: query heads
        per_rank = divide(heads, tp_size, "num_attention_heads") * d
        return tp_rank * per_rank, per_rank
    if module in ("k_proj", "v_proj"):
        per_rank, replicas = kv_head_partition(kv_heads, tp_size)
        return (tp_rank // replicas) * per_rank * d, per_rank * d
    per_rank = divide(hf_config.intermediate_size, tp_size, "intermediate_size")
    return tp_rank * per_rank, per_rank  # gate/up output rows, down input columns


def shard_lora(module: str, lora_a: torch.Tensor, lora_b: torch.Tensor, hf_config: Any,
               tp_rank: int, tp_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``tp_rank``'s ``(A, B)`` of one module from the full ``A (r, in)``, ``B (out, r)``.

    Column-parallel: ``(A, B[rows])``; row-parallel: ``(A[:, cols], B)`` (views).
    """
    first, count = shard_rows(module, hf_config, tp_rank, tp_size)
    if module in COLUMN_PARALLEL:
        return lora_a, lora_b[first : first + count]
    return lora_a[:, first : first + count], lora_b
