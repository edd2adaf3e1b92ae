"""Executors: run one engine's :class:`~minivllm.engine.worker.Worker` on every rank.

The engine (scheduler, model runner, sampler) lives in one process and calls
an executor once per step. Two kinds, with the same methods:

- :class:`UniProcExecutor` (here): one in-process ``Worker``. Used for
  ``tensor_parallel_size=1``, and at any ``tp_size`` for linear layers that
  simulate every rank in one process (the ref twin).
- :class:`~minivllm.engine.multiproc_executor.MultiprocExecutor`: real tensor
  parallelism, one process per rank, for linear layers that hold one rank's
  shards (the fast twin).
- :class:`~minivllm.engine.external_launcher.ExternalLauncherExecutor`: the
  same ranks, started by ``torchrun`` (or another launcher) instead of
  spawned, on one machine or several; rank 0 runs the engine.

Which one: :func:`~minivllm.engine.launcher.choose_executor_backend` turns
``distributed_executor_backend`` (None, ``"uni"``, ``"mp"``,
``"external_launcher"``) and the launcher's environment into one answer.

ONE rule picks between them, :func:`~minivllm.engine.ranks.simulates_all_ranks`,
read from the ``linear`` module the engine's components actually hold;
:func:`make_executor` (the engine's entry point) and both executors' checks
all call it. The rules both executors share live in
:mod:`minivllm.engine.ranks`, so neither executor module imports the other's
(this one imports ``MultiprocExecutor`` to pick it; that one imports nothing
from here). So a
course package that provides only ``layernorm`` (its ``linear`` falls back to
the ref) runs ``tensor_parallel_size=2`` in one process, as the ref does.

Both take a :class:`~minivllm.metadata.StepInput` per step: the batch plus
the block-table changes, which every rank's worker applies to its own table.
"""

from __future__ import annotations

import torch

from minivllm import backend
from minivllm.engine.external_launcher import start_external_launcher
from minivllm.engine.launcher import choose_executor_backend
from minivllm.engine.multiproc_executor import MultiprocExecutor
from minivllm.engine.ranks import (  # noqa: F401  (re-exported: one place to import from)
    check_model_tp_size,
    peek_hf_config,
    rank_devices,
    simulates_all_ranks,
)
from minivllm.engine.worker import Worker
from minivllm.metadata import StepInput
from minivllm.tp_shards import check_tp_size


def make_executor(model: str, dtype: torch.dtype, device: str | torch.device, tp_size: int,
                  components: backend.Components | backend.BackendSpec | None = None,
                  quantization: str | None = None,
                  distributed_executor_backend: str | None = None):
    """The executor for ``tp_size`` ranks with ``components`` (a spec is resolved once).

    ``distributed_executor_backend`` None chooses (see
    :mod:`minivllm.engine.launcher`): one in-process worker for ``tp_size=1``
    or simulating linear layers, the launcher's ranks under ``torchrun``,
    spawned worker processes otherwise. Under a launcher, on every rank but 0
    this never returns: the process serves rank 0 and then exits.
    """
    check_tp_size(tp_size)
    components = backend.as_components(components)
    kind = choose_executor_backend(distributed_executor_backend, tp_size,
                                   simulates_all_ranks(components))
    if kind == "external_launcher":
        return start_external_launcher(model, dtype, device, tp_size, components, quantization)
    if kind == "mp":
        return MultiprocExecutor(model, dtype, device, tp_size, components=components,
                                 quantization=quantization)
    return UniProcExecutor(model, dtype, device, tp_size, components, quantization)


class UniProcExecutor:
    """One in-process :class:`~minivllm.engine.worker.Worker` (tp=1, or the ref simulation).

    Args:
        model: a registered name, an HF model directory or a ``.gguf`` file.
        dtype: weight and activation dtype.
        device: ``"cpu"`` or ``"cuda[:N]"``.
        tp_size: ranks the layers are built for; above 1 only with linear
            layers that simulate every rank (the ref backend).
        components: the engine's :class:`~minivllm.backend.Components` (a
            spec, or None for the global one, is resolved once here).
        quantization: None, ``"int8"``, ``"int4"`` or ``"gguf"`` (see
            :mod:`minivllm.model.quantization`).
    """

    def __init__(self, model: str, dtype: torch.dtype, device: str | torch.device,
                 tp_size: int = 1,
                 components: backend.Components | backend.BackendSpec | None = None,
                 quantization: str | None = None) -> None:
        components = backend.as_components(components)
        if tp_size > 1 and not simulates_all_ranks(components):
            raise ValueError(
                f"tp_size={tp_size} with real (one process per rank) linear layers needs "
                "MultiprocExecutor; UniProcExecutor runs tp_size > 1 only with linear layers "
                "that simulate every rank (the ref)"
            )
        check_model_tp_size(model, tp_size)
        self.tp_size = tp_size
        self.worker = Worker(model, dtype, device, tp_size, components, quantization)
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


