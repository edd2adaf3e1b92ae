"""Executors: run one engine's :class:`~minivllm.engine.worker.Worker` on every rank.

The engine (scheduler, model runner, sampler) lives in one process and calls
an executor once per step. Two kinds, with the same methods:

- :class:`UniProcExecutor` (here): one in-process ``Worker``. Used for
  ``tensor_parallel_size=1``, and at any ``tp_size`` for linear layers that
  simulate every rank in one process (the ref twin).
- :class:`~minivllm.engine.multiproc_executor.MultiprocExecutor`: real tensor
  parallelism, one process per rank, for linear layers that hold one rank's
  shards (the fast twin).

ONE rule picks between them, :func:`simulates_all_ranks`, read from the
``linear`` module the backend spec actually selects; :func:`make_executor`
(the engine's entry point) and both executors' checks all call it. So a
course package that provides only ``layernorm`` (its ``linear`` falls back to
the ref) runs ``tensor_parallel_size=2`` in one process, as the ref does.

Both take a :class:`~minivllm.metadata.StepInput` per step: the batch plus
the block-table changes, which every rank's worker applies to its own table.
"""

from __future__ import annotations

from typing import Any

import torch

from minivllm import backend
from minivllm.metadata import StepInput
from minivllm.tp_shards import check_tp_size


def simulates_all_ranks(spec: backend.BackendSpec | None = None) -> bool:
    """Whether the ``linear`` module ``spec`` selects computes every rank in one process.

    Read from the module itself (``SIMULATES_ALL_RANKS``), not from the spec's
    name: a package without its own ``linear`` gets the ref's. A ``linear``
    module that does not say raises ``ValueError``.
    """
    linear = backend.get("linear", spec)
    flag = getattr(linear, "SIMULATES_ALL_RANKS", None)
    if not isinstance(flag, bool):
        raise ValueError(
            f"linear module {linear.__name__} must set SIMULATES_ALL_RANKS = True (every rank "
            f"in one process, like minivllm.ref.linear) or False (one process per rank, like "
            f"minivllm.fast.linear), got {flag!r}"
        )
    return flag


def make_executor(model: str, dtype: torch.dtype, device: str | torch.device, tp_size: int,
                  spec: backend.BackendSpec | None = None, quantization: str | None = None):
    """The executor for ``tp_size`` ranks under ``spec`` (default: the global backend).

    One in-process worker for ``tp_size=1`` or simulating linear layers; real
    worker processes otherwise (:func:`simulates_all_ranks` decides).
    """
    check_tp_size(tp_size)
    with backend.use_backend(spec if spec is not None else backend.get_backend()):
        if tp_size > 1 and not simulates_all_ranks():
            from minivllm.engine.multiproc_executor import MultiprocExecutor

            return MultiprocExecutor(model, dtype, device, tp_size, quantization=quantization)
        return UniProcExecutor(model, dtype, device, tp_size, quantization)


def peek_hf_config(model: str) -> Any | None:
    """The model's HF config without loading weights (None for a ``.gguf`` file)."""
    from minivllm.model.loader import resolve_model_path

    path = resolve_model_path(model)
    if path.suffix == ".gguf":
        return None  # the config is inside the file; the layers check tp_size
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path, local_files_only=True)


def check_model_tp_size(model: str, tp_size: int) -> None:
    """Refuse a ``tp_size`` that does not split ``model`` before loading anything."""
    check_tp_size(tp_size)
    if tp_size == 1:
        return  # every model runs on one rank
    hf_config = peek_hf_config(model)
    if hf_config is not None:  # None for a .gguf file: its layers check while loading
        check_tp_size(tp_size, hf_config)


def rank_devices(device: str | torch.device, tp_size: int) -> list[torch.device]:
    """One device per rank: all ``cpu``, or ``cuda:first .. cuda:first + tp - 1``."""
    device = torch.device(device)
    if device.type == "cpu":
        return [device] * tp_size
    if device.type != "cuda":
        raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {str(device)!r}")
    first, found = device.index or 0, torch.cuda.device_count()
    if first + tp_size > found:
        raise ValueError(
            f"tensor_parallel_size={tp_size} needs GPUs cuda:{first}..cuda:{first + tp_size - 1}, "
            f"but {found} are visible"
        )
    return [torch.device("cuda", first + r) for r in range(tp_size)]


class UniProcExecutor:
    """One in-process :class:`~minivllm.engine.worker.Worker` (tp=1, or the ref simulation).

    Args:
        model: a registered name, an HF model directory or a ``.gguf`` file.
        dtype: weight and activation dtype.
        device: ``"cpu"`` or ``"cuda[:N]"``.
        tp_size: ranks the layers are built for; above 1 only with linear
            layers that simulate every rank (the ref backend).
        quantization: None, ``"int8"``, ``"int4"`` or ``"gguf"`` (see
            :mod:`minivllm.model.quantization`).
    """

    def __init__(self, model: str, dtype: torch.dtype, device: str | torch.device,
                 tp_size: int = 1, quantization: str | None = None) -> None:
        from minivllm.engine.worker import Worker

        if tp_size > 1 and not simulates_all_ranks():
            raise ValueError(
                f"tp_size={tp_size} with real (one process per rank) linear layers needs "
                "MultiprocExecutor; UniProcExecutor runs tp_size > 1 only with linear layers "
                "that simulate every rank (the ref)"
            )
        check_model_tp_size(model, tp_size)
        self.tp_size = tp_size
        self.worker = Worker(model, dtype, device, tp_size, quantization)
        self.tokenizer, self.hf_config = self.worker.tokenizer, self.worker.hf_config

    def bytes_per_block(self, block_size: int) -> int:
        """KV-cache bytes per block on this (the only) process."""
        return self.worker.bytes_per_block(block_size)

    def init_kv_cache(self, num_blocks: int, block_size: int, max_num_reqs: int = 256,
                      max_num_blocks_per_req: int | None = None) -> None:
        """Allocate the paged KV cache and the worker's block table."""
        self.worker.init_kv_cache(num_blocks, block_size, max_num_reqs, max_num_blocks_per_req)

    def execute_model(self, step_input: StepInput) -> torch.Tensor | None:
        """One step: ``(num_sampled, vocab)`` float32 logits (None if no token ran)."""
        return self.worker.execute_model(step_input)

    def check_health(self) -> None:
        """Nothing can die separately here."""

    def shutdown(self) -> None:
        """Nothing to stop."""

    def __enter__(self) -> UniProcExecutor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


