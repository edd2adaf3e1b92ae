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

Pipeline parallelism follows the same rule: with simulating linear layers
(the ref) :class:`UniProcExecutor` holds one worker per *stage* in this
process and runs them one after another (:meth:`UniProcExecutor.run_pipeline`,
the textbook page); otherwise every stage's ranks are real processes.
"""

from __future__ import annotations

import time

import torch

from minivllm import backend
from minivllm.engine.external_launcher import start_external_launcher
from minivllm.engine.launcher import choose_executor_backend
from minivllm.engine.multiproc_executor import MultiprocExecutor, PendingStep
from minivllm.engine.ranks import (  # noqa: F401  (re-exported: one place to import from)
    check_model_parallel_sizes,
    check_model_tp_size,
    peek_hf_config,
    rank_devices,
    simulates_all_ranks,
)
from minivllm.engine.worker import Worker
from minivllm.metadata import StepInput
from minivllm.pp_stages import IntermediateTensors, StageTiming, check_pp_size
from minivllm.tp_shards import check_tp_size


def make_executor(model: str, dtype: torch.dtype, device: str | torch.device, tp_size: int,
                  components: backend.Components | backend.BackendSpec | None = None,
                  quantization: str | None = None, pp_size: int = 1,
                  pp_layer_partition: str | tuple[int, ...] | None = None,
                  distributed_executor_backend: str | None = None):
    """The executor for ``tp_size x pp_size`` ranks with ``components`` (a spec is resolved once).

    ``distributed_executor_backend`` None chooses (see
    :mod:`minivllm.engine.launcher`): one in-process worker (per pipeline
    stage) for a single rank or simulating linear layers, the launcher's ranks
    under ``torchrun``, spawned worker processes otherwise
    (:func:`simulates_all_ranks` decides which layers simulate). Under a
    launcher, on every rank but 0 this never returns: the process serves rank
    0 and then exits.
    """
    check_tp_size(tp_size)
    check_pp_size(pp_size)
    components = backend.as_components(components)
    kind = choose_executor_backend(distributed_executor_backend, tp_size * pp_size,
                                   simulates_all_ranks(components))
    if kind == "external_launcher":
        return start_external_launcher(model, dtype, device, tp_size, components, quantization,
                                       pp_size=pp_size, pp_layer_partition=pp_layer_partition)
    if kind == "mp":
        return MultiprocExecutor(model, dtype, device, tp_size, components=components,
                                 quantization=quantization, pp_size=pp_size,
                                 pp_layer_partition=pp_layer_partition)
    return UniProcExecutor(model, dtype, device, tp_size, components, quantization, pp_size,
                           pp_layer_partition)


class UniProcExecutor:
    """In-process :class:`~minivllm.engine.worker.Worker` s: one rank, or the ref simulation.

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
        pp_size: pipeline stages, simulated here one after another (one
            worker each, holding only its layers and their KV cache).
        pp_layer_partition: layers per stage (``"4,3,3"``), or None for the rule.
    """

    def __init__(self, model: str, dtype: torch.dtype, device: str | torch.device,
                 tp_size: int = 1,
                 components: backend.Components | backend.BackendSpec | None = None,
                 quantization: str | None = None, pp_size: int = 1,
                 pp_layer_partition: str | tuple[int, ...] | None = None) -> None:
        components = backend.as_components(components)
        if tp_size > 1 and not simulates_all_ranks(components):
            raise ValueError(
                f"tp_size={tp_size} with real (one process per rank) linear layers needs "
                "MultiprocExecutor; UniProcExecutor runs tp_size > 1 only with linear layers "
                "that simulate every rank (the ref)"
            )
        check_model_parallel_sizes(model, tp_size, pp_size, pp_layer_partition)
        self.tp_size, self.pp_size = tp_size, pp_size
        #: micro-batches the engine may keep in flight: as many as the real ranks
        #: would, so that the simulation schedules exactly the same batches
        self.max_concurrent_batches = pp_size
        self.workers = [Worker(model, dtype, device, tp_size, components, quantization,
                               pp_rank=r, pp_size=pp_size, pp_layer_partition=pp_layer_partition)
                        for r in range(pp_size)]
        self.worker = self.workers[0]
        self.tokenizer, self.hf_config = self.worker.tokenizer, self.worker.hf_config
        self._num_batches = 0
        self._timeline: list[StageTiming] = []

    def bytes_per_block(self, block_size: int) -> int:
        """KV-cache bytes per block on one rank (the largest stage's)."""
        return max(w.bytes_per_block(block_size) for w in self.workers)

    def init_kv_cache(self, num_blocks: int, block_size: int, max_num_reqs: int = 256,
                      max_num_blocks_per_req: int | None = None) -> None:
        """Allocate every stage's paged KV cache (its own layers) and its block table."""
        for w in self.workers:
            w.init_kv_cache(num_blocks, block_size, max_num_reqs, max_num_blocks_per_req)

    def execute_model(self, step_input: StepInput,
                      non_block: bool = False) -> torch.Tensor | None | PendingStep:
        """One step: ``(num_sampled, vocab)`` float32 logits (None if no token ran).

        ``non_block`` wraps the (already computed) result in a
        :class:`~minivllm.engine.multiproc_executor.PendingStep`, as the real
        pipeline returns one.
        """
        if self.pp_size == 1:
            out = self.worker.execute_model(step_input)
        else:
            out = self.run_pipeline(step_input)
        return PendingStep(value=out, done=True) if non_block else out

    def run_pipeline(self, step_input: StepInput) -> torch.Tensor | None:
        """The pipeline, simulated: every stage in turn, handing on what it computed.

        Each stage's worker applies the step's block-table changes to its own
        table and builds its own metadata, as a real rank does. Stage 0
        receives nothing and embeds the tokens; each later stage receives the
        previous one's :class:`~minivllm.pp_stages.IntermediateTensors`; the
        last one returns the logits. The timings are recorded as the real
        ranks record theirs (:meth:`stage_timeline`): here the stages run one
        after another, so the timeline is all bubble.
        """
        model_inputs = [w.prepare_model_input(step_input) for w in self.workers]
        batch = self._num_batches
        self._num_batches += 1
        if step_input.num_tokens == 0:
            return None
        received: IntermediateTensors | None = None  # what the next stage receives
        for stage, (worker, model_input) in enumerate(zip(self.workers, model_inputs)):
            start = time.time()
            sent = worker.run_model(model_input, received)
            self._timeline.append(StageTiming(batch, stage * self.tp_size, stage, 0,
                                              start, time.time()))
            received = sent  # (T, hidden) x 2 on the wire; logits after the last stage
        return received

    def memory_per_rank(self) -> list[dict[str, int]]:
        """``[{"weights": bytes, "kv_cache": bytes}, ...]``, one per stage (the simulation
        holds every tensor-parallel rank of a stage in one worker)."""
        return [w.memory_bytes() for w in self.workers]

    def stage_timeline(self, clear: bool = False) -> list[StageTiming]:
        """Every stage's records per micro-batch (see ``MultiprocExecutor.stage_timeline``)."""
        records = list(self._timeline)
        if clear:
            self._timeline = []
        return records

    def check_health(self) -> None:
        """Nothing can die separately here."""

    def shutdown(self) -> None:
        """Nothing to stop."""

    def __enter__(self) -> UniProcExecutor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
