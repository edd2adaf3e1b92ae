"""Pipeline parallelism, readable version: which layers a stage holds, and one stage's forward.

A model of ``L`` decoder layers on ``P`` pipeline stages (vLLM's
``get_pp_indices`` and the ``forward`` of its PP-aware models):

- :func:`get_pp_indices` is the split. Every stage gets ``L // P`` layers; the
  ``L % P`` left over go one each to the stages *before the last*, nearest to
  it first, because the last stage also runs the final norm and the LM head
  (a ``vocab x hidden`` matmul per sampled token). 5 layers on 3 stages:
  ``[0, 2) [2, 4) [4, 5)``.
- :func:`stage_forward` is what one stage does with a batch. Stage 0 embeds
  the token ids; every other stage starts from the
  :class:`~minivllm.pp_stages.IntermediateTensors` the previous stage sent.
  Each runs its own layers, ``model.start_layer .. model.end_layer - 1``, over
  its own KV cache (one ``(k, v)`` pair per layer *it holds*). A stage that is
  not the last returns ``IntermediateTensors(hidden_states, residual)`` to
  send on; the last applies the final norm and returns the hidden states,
  whose sampled rows the LM head turns into logits.

The model keeps its full ``layers`` list (placeholders,
:class:`~minivllm.model.llama.PPMissingLayer`, stand for the layers other
stages hold), so ``model.layers.7`` is layer 7 on every stage and checkpoint
names need no renumbering.

With one stage (``P = 1``) the one stage is first and last: this is the
plain forward pass, and every engine runs it.
"""

from __future__ import annotations

from typing import Any

import torch

from minivllm.pp_stages import IntermediateTensors
from minivllm.profiler import op_range

__all__ = ["get_pp_indices", "stage_forward"]


def get_pp_indices(num_layers: int, pp_rank: int, pp_size: int) -> tuple[int, int]:
    """``(start, end)``: stage ``pp_rank`` of ``pp_size`` holds layers ``start .. end - 1``.

    ``num_layers // pp_size`` layers each; the remaining ``num_layers %
    pp_size`` go one each to the stages just before the last (stage
    ``pp_size - 2``, then ``pp_size - 3``, ...). Needs ``1 <= pp_size <=
    num_layers`` and ``0 <= pp_rank < pp_size``.
    """
    # BEGIN SOLUTION
    sizes = [num_layers // pp_size] * pp_size
    for i in range(num_layers % pp_size):
        sizes[pp_size - 2 - i] += 1  # never the last stage: it has the LM head
    start = sum(sizes[:pp_rank])
    return start, start + sizes[pp_rank]
    # END SOLUTION


def stage_forward(
    model: Any,  # a LlamaModel built for one stage (start_layer, end_layer, is_first/last_rank)
    input_ids: torch.Tensor,  # (T,)
    positions: torch.Tensor,  # (T,)
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]],  # one (k, v) per layer of this stage
    attn_metadata: Any,
    intermediate_tensors: IntermediateTensors | None = None,  # None on the first stage
) -> torch.Tensor | IntermediateTensors:
    """One stage's part of the forward pass over a flat batch of ``T`` tokens.

    Returns ``IntermediateTensors(hidden_states, residual)`` (each ``(T,
    hidden)``) on every stage but the last, and the final-normed hidden states
    ``(T, hidden)`` on the last.
    """
    # BEGIN SOLUTION
    if model.is_first_rank:
        with op_range("op.embedding"):
            hidden = model.embed_tokens(input_ids)  # (T, hidden)
        residual = None  # layer 0 takes the embeddings as the residual stream
    else:  # what the previous stage sent
        hidden = intermediate_tensors["hidden_states"]  # (T, hidden)
        residual = intermediate_tensors["residual"]  # (T, hidden)
    for i in range(model.start_layer, model.end_layer):
        with op_range(f"layer.{i}"):
            hidden, residual = model.layers[i](positions, hidden, residual,
                                               kv_caches[i - model.start_layer], attn_metadata)
    if not model.is_last_rank:
        return IntermediateTensors(hidden_states=hidden, residual=residual)
    hidden, _ = model.norm(hidden, residual)
    return hidden
    # END SOLUTION
