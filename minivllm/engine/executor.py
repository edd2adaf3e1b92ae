"""Executors: who runs one engine's :class:`~minivllm.engine.worker.Worker` on every rank.

The engine (scheduler, sampler, outputs) lives in one process and calls its
executor once per step. :class:`Executor` states everything the engine uses
of one, so the engine never has to guess what an executor offers. Two
implementations:

- :class:`UniProcExecutor` (here): the workers live in this process. One rank,
  or the ref's linear layers that simulate every tensor-parallel rank in one
  process, and with pipeline parallelism one worker per stage, run one after
  another (:meth:`UniProcExecutor.execute_model`, the textbook page).
- :class:`~minivllm.engine.multiproc_executor.MultiprocExecutor`: one process
  per rank, with real collectives. Rank 0's worker lives in this process; how
  the other ranks come to exist is a strategy
  (:mod:`minivllm.engine.rank_starters`): spawned from here (``"mp"``) or
  started by a launcher such as ``torchrun`` (``"external_launcher"``).

:func:`minivllm.engine.launcher.make_executor` chooses among them, once.
Every step takes a :class:`~minivllm.metadata.StepInput`: the batch plus the
block-table changes, which every rank's worker applies to its own table.
"""

from __future__ import annotations

import abc
import time
from typing import Any

import torch

from minivllm import backend
from minivllm.engine.config import WorkerConfig
from minivllm.engine.ranks import check_model_parallel_sizes, simulates_all_ranks
from minivllm.engine.worker import Worker
from minivllm.metadata import StepInput
from minivllm.pp_stages import IntermediateTensors, StageTiming


class PendingStep:
    """A step sent to the workers; :meth:`result` waits for its logits.

    With pipeline parallelism a step returns once stage 0 has run, and its
    logits come back later; results come back in the order the steps were
    sent (waiting for a later step collects the earlier ones first). A step
    that is already done holds its ``value``.
    """

    def __init__(self, executor: Any = None, num_rows: int = 0, value: Any = None,
                 done: bool = False) -> None:
        self.executor, self.num_rows = executor, num_rows
        self.value, self.done = value, done

    def result(self) -> torch.Tensor | None:
        """The step's ``(num_sampled, vocab)`` float32 logits (None for a step without tokens)."""
        while not self.done:
            self.executor.collect_oldest()
        return self.value


class Executor(abc.ABC):
    """Everything the engine uses of whoever runs its workers.

    Attributes:
        config: the :class:`~minivllm.engine.config.WorkerConfig` every rank was built from.
        worker: rank 0's worker, in this process (the first stage's, when the
            stages are simulated here).
        tokenizer: the model's tokenizer (None for a directory without one).
        hf_config: the model's HF config.
        max_concurrent_batches: how many steps the engine may keep in flight
            (vLLM's name): the number of pipeline stages, else 1.
    """

    config: WorkerConfig
    worker: Worker
    tokenizer: Any
    hf_config: Any
    max_concurrent_batches: int

    @abc.abstractmethod
    def bytes_per_block(self, block_size: int) -> int:
        """KV-cache bytes one block costs on one rank (the largest rank's)."""

    @abc.abstractmethod
    def init_kv_cache(self, num_blocks: int, block_size: int, max_num_reqs: int,
                      max_num_blocks_per_req: int) -> None:
        """Allocate every rank's KV cache and block table, and build its model runner."""

    @abc.abstractmethod
    def execute_model(self, step_input: StepInput) -> PendingStep:
        """Send one step to every rank; its logits come back through the :class:`PendingStep`.

        At most :attr:`max_concurrent_batches` steps may be pending at once.
        """

    def add_lora(self, lora_request: Any) -> None:
        """Load a LoRA adapter on every rank (each its shards); ``ValueError`` if it is bad.

        Rank 0 loads first, so a bad adapter is refused before any other rank hears of it.
        """
        self.worker.add_lora(lora_request)

    def remove_lora(self, lora_int_id: int) -> None:
        """Forget an adapter on every rank."""
        self.worker.remove_lora(lora_int_id)

    @abc.abstractmethod
    def whole_model_worker(self) -> Worker | None:
        """The worker that holds every layer of every rank in this process, or None.

        A draft model runs beside the target in one process and needs it; with
        one process per rank (or per stage) there is none.
        """

    @abc.abstractmethod
    def memory_per_rank(self) -> list[dict[str, int]]:
        """``[{"weights": bytes, "kv_cache": bytes}, ...]``, one per rank (or simulated stage)."""

    @abc.abstractmethod
    def stage_timeline(self, clear: bool = False) -> list[StageTiming]:
        """Every stage's :class:`~minivllm.pp_stages.StageTiming` records, by (batch, rank)."""

    @abc.abstractmethod
    def check_health(self) -> None:
        """Raise ``RuntimeError`` if a rank died or an earlier step failed."""

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Stop every rank this executor runs (idempotent)."""

    def __enter__(self) -> Executor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


class UniProcExecutor(Executor):
    """In-process :class:`~minivllm.engine.worker.Worker` s: one rank, or the ref simulation.

    Args:
        config: the model and how to run it. ``tensor_parallel_size`` above 1
            only with linear layers that simulate every rank (the ref);
            ``pipeline_parallel_size`` stages are simulated here one after
            another (one worker each, holding only its layers and KV cache).
        components: the engine's :class:`~minivllm.backend.Components` (a
            spec, or None for the global one, is resolved once here).
    """

    def __init__(self, config: WorkerConfig,
                 components: backend.Components | backend.BackendSpec | None = None) -> None:
        components = backend.as_components(components)
        tp, pp = config.tensor_parallel_size, config.pipeline_parallel_size
        if tp > 1 and not simulates_all_ranks(components):
            raise ValueError(
                f"tensor_parallel_size={tp} with real (one process per rank) linear layers "
                "needs MultiprocExecutor; UniProcExecutor runs it only with linear layers "
                "that simulate every rank (the ref)")
        check_model_parallel_sizes(config.model, tp, pp, config.pp_layer_partition)
        self.config = config
        #: micro-batches the engine may keep in flight: as many as the real ranks
        #: would, so that the simulation schedules exactly the same batches
        self.max_concurrent_batches = pp
        self.workers = [Worker(config, components, pp_rank=r) for r in range(pp)]
        self.worker = self.workers[0]
        self.tokenizer, self.hf_config = self.worker.tokenizer, self.worker.hf_config
        self._num_batches = 0
        self._timeline: list[StageTiming] = []

    def add_lora(self, lora_request: Any) -> None:
        """Load an adapter into every simulated stage (stage 0 first: a bad one raises there)."""
        for w in self.workers:
            w.add_lora(lora_request)

    def remove_lora(self, lora_int_id: int) -> None:
        """Forget an adapter in every simulated stage."""
        for w in self.workers:
            w.remove_lora(lora_int_id)

    def bytes_per_block(self, block_size: int) -> int:
        """KV-cache bytes per block on one rank (the largest stage's)."""
        return max(w.bytes_per_block(block_size) for w in self.workers)

    def init_kv_cache(self, num_blocks: int, block_size: int, max_num_reqs: int = 256,
                      max_num_blocks_per_req: int | None = None) -> None:
        """Allocate every stage's paged KV cache (its own layers) and its block table."""
        for w in self.workers:
            w.init_kv_cache(num_blocks, block_size, max_num_reqs, max_num_blocks_per_req)

    def execute_model(self, step_input: StepInput) -> PendingStep:
        """One step, every stage in turn, handing on what it computed; done at once.

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
            return PendingStep(value=None, done=True)
        received: IntermediateTensors | None = None  # what the next stage receives
        for stage, (worker, model_input) in enumerate(zip(self.workers, model_inputs)):
            start = time.time()
            sent = worker.run_model(model_input, received)
            self._timeline.append(StageTiming(batch, stage * self.config.tensor_parallel_size,
                                              stage, 0, start, time.time()))
            received = sent  # (T, hidden) x 2 on the wire; logits after the last stage
        return PendingStep(value=received, done=True)

    def whole_model_worker(self) -> Worker | None:
        """The one worker, when there is one stage (it holds every simulated rank)."""
        return self.worker if len(self.workers) == 1 else None

    def memory_per_rank(self) -> list[dict[str, int]]:
        """One entry per stage (the simulation holds every tensor-parallel rank of a stage
        in one worker)."""
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
