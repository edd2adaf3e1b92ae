"""Pipeline-parallel bookkeeping shared by the simulation and the real ranks.

Pipeline parallelism (PP) cuts the decoder's layer stack into
``pipeline_parallel_size`` consecutive *stages*, one per rank: stage 0 also
holds the embedding, the last stage the final norm and the LM head. A batch
flows through the stages in order; between two stages travel only the
:class:`IntermediateTensors` (``hidden_states`` and ``residual``, each
``(num_tokens, hidden)``), where tensor parallelism exchanges partial results
twice in every layer.

A stage's forward is the model's own (:meth:`minivllm.model.llama.LlamaModel.forward`
runs layers ``[start, end)``, embeds on the first stage and norms on the
last). This module holds the rest:

- :func:`get_pp_indices`: the rule that splits the layers (vLLM's);
- :class:`IntermediateTensors`: what one stage hands to the next;
- :class:`PPMissingLayer`: the placeholder for a module another stage holds;
- :func:`stage_layer_ranges`: every stage's ``[start, end)`` layers, from the
  rule or from an explicit partition (``pp_layer_partition``; the engine
  config reads ``$MINIVLLM_PP_LAYER_PARTITION``, like vLLM's
  ``VLLM_PP_LAYER_PARTITION``, into it), validated;
- :func:`check_pp_size` and :func:`valid_pp_sizes`: the one size check;
- the rank layout (:func:`global_rank`, :func:`rank_coords`): tensor-parallel
  ranks are the inner index, as in vLLM, so ``rank = pp_rank * tp_size + tp_rank``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


@dataclass(frozen=True)
class IntermediateTensors:
    """What a pipeline stage sends to the next one (vLLM's ``IntermediateTensors``).

    Both are ``(num_tokens, hidden)``: the output of the stage's last decoder
    layer and the residual stream before it (the next layer's fused
    add-and-norm adds them). Read it like a dict: ``it["hidden_states"]``.
    """

    hidden_states: torch.Tensor  # (T, hidden)
    residual: torch.Tensor  # (T, hidden)

    def __getitem__(self, key: str) -> torch.Tensor:
        if key not in ("hidden_states", "residual"):
            raise KeyError(key)
        return getattr(self, key)

    def keys(self) -> tuple[str, str]:
        return ("hidden_states", "residual")


class PPMissingLayer(nn.Module):
    """A placeholder for a module another pipeline stage holds (vLLM's ``PPMissingLayer``).

    It has no parameters, so this stage neither allocates nor loads the
    module's weights, and the model's ``layers`` list keeps its full length:
    ``model.layers.7`` is layer 7 on every stage. Calling it is a bug.
    """

    def forward(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError("PPMissingLayer: this module lives on another pipeline stage")


def get_pp_indices(num_layers: int, pp_rank: int, pp_size: int) -> tuple[int, int]:
    """``(start, end)``: stage ``pp_rank`` of ``pp_size`` holds layers ``start .. end - 1``.

    ``num_layers // pp_size`` layers each; the remaining ``num_layers %
    pp_size`` go one each to the stages just before the last (stage
    ``pp_size - 2``, then ``pp_size - 3``, ...), never to the last, because
    it also runs the final norm and the LM head (a ``vocab x hidden`` matmul
    per sampled token). 5 layers on 3 stages: ``[0, 2) [2, 4) [4, 5)``.
    Needs ``1 <= pp_size <= num_layers`` and ``0 <= pp_rank < pp_size``.
    """
    sizes = [num_layers // pp_size] * pp_size
    for i in range(num_layers % pp_size):
        sizes[pp_size - 2 - i] += 1  # never the last stage: it has the LM head
    start = sum(sizes[:pp_rank])
    return start, start + sizes[pp_rank]


def valid_pp_sizes(num_layers: int) -> list[int]:
    """Every ``pipeline_parallel_size`` a model of ``num_layers`` layers splits into.

    Each stage needs at least one layer; the layers need not divide evenly
    (the extra ones go to the stages before the last).
    """
    return list(range(1, num_layers + 1))


def check_pp_size(pp_size: int, num_layers: int | None = None) -> None:
    """Raise ``ValueError`` unless ``pp_size`` is a positive int (at most ``num_layers``)."""
    if not isinstance(pp_size, int) or isinstance(pp_size, bool) or pp_size < 1:
        raise ValueError(f"pipeline_parallel_size must be an int >= 1, got {pp_size!r}")
    if num_layers is not None and pp_size > num_layers:
        raise ValueError(
            f"pipeline_parallel_size={pp_size} does not split this model "
            f"(num_hidden_layers={num_layers}: every stage needs a layer); "
            f"pp sizes that work: {valid_pp_sizes(num_layers)}"
        )


def parse_partition(partition: str | tuple[int, ...] | list[int] | None) -> tuple[int, ...] | None:
    """``"4,3,3"`` (or a sequence of ints) -> ``(4, 3, 3)``; None or ``""`` -> None."""
    if partition is None or partition == "":
        return None
    if isinstance(partition, str):
        try:
            return tuple(int(p) for p in partition.split(","))
        except ValueError:
            raise ValueError(f"pp_layer_partition must be comma-separated ints like '4,3,3', "
                             f"got {partition!r}") from None
    if not all(isinstance(p, int) and not isinstance(p, bool) for p in partition):
        raise ValueError(f"pp_layer_partition must be ints, got {partition!r}")
    return tuple(partition)


def stage_layer_ranges(num_layers: int, pp_size: int, partition: Any,
                       rule: Callable[[int, int, int], tuple[int, int]] = get_pp_indices,
                       ) -> list[tuple[int, int]]:
    """Every stage's ``(start, end)`` layers, in stage order; ONE place decides the split.

    Args:
        num_layers: the model's ``num_hidden_layers``.
        pp_size: number of stages.
        partition: layers per stage (``"4,3,3"`` or ``(4, 3, 3)``), or None for
            the rule. Must have ``pp_size`` entries, each >= 1, summing to
            ``num_layers``.
        rule: ``(num_layers, pp_rank, pp_size) -> (start, end)``; :func:`get_pp_indices`
            unless a test passes another.

    The ranges are checked to tile ``[0, num_layers)`` in order, whoever
    computed them, so a wrong rule fails here, before any weight is loaded.
    """
    check_pp_size(pp_size, num_layers)
    sizes = parse_partition(partition)
    if sizes is not None:
        if len(sizes) != pp_size or any(s < 1 for s in sizes) or sum(sizes) != num_layers:
            raise ValueError(
                f"pp_layer_partition must have pipeline_parallel_size={pp_size} entries, "
                f"each >= 1, summing to num_hidden_layers={num_layers}, got {list(sizes)}"
            )
        starts = [sum(sizes[:r]) for r in range(pp_size)]
        return [(s, s + n) for s, n in zip(starts, sizes)]
    ranges = [tuple(rule(num_layers, r, pp_size)) for r in range(pp_size)]
    ends = [0] + [end for _, end in ranges]
    if any(start != ends[r] or end <= start for r, (start, end) in enumerate(ranges)) \
            or ends[-1] != num_layers:
        raise ValueError(f"the rule for {num_layers} layers on {pp_size} stages gave {ranges}: "
                         f"not consecutive non-empty ranges covering [0, {num_layers})")
    return ranges


def global_rank(pp_rank: int, tp_rank: int, tp_size: int) -> int:
    """The process rank of stage ``pp_rank``'s tensor-parallel rank ``tp_rank`` (tp inner)."""
    return pp_rank * tp_size + tp_rank


def rank_coords(rank: int, tp_size: int) -> tuple[int, int]:
    """``(pp_rank, tp_rank)`` of process ``rank``: the inverse of :func:`global_rank`."""
    return rank // tp_size, rank % tp_size


@dataclass(frozen=True)
class StageTiming:
    """One stage's work on one micro-batch, for a Gantt chart (seconds, ``time.time()``).

    ``start`` is when the stage had its inputs (the step on stage 0, the
    previous stage's tensors on the others), ``end`` when its output was
    computed (before it is sent). Clocks of one host are shared by its
    processes, so the ranks' records line up.
    """

    batch: int  # the engine's micro-batch index, counted from 0 per executor
    rank: int
    pp_rank: int
    tp_rank: int
    start: float
    end: float
