"""``UniProcExecutor``: every worker in this process (one rank, or the ref's simulation).

A call is a method call on each worker (:meth:`UniProcExecutor.collective_rpc`).
With one rank there is one worker. The ref's linear layers simulate every
tensor-parallel rank in one process, so ``tensor_parallel_size`` > 1 runs here
too with them; and with pipeline parallelism there is one worker per stage,
run one after another, each handing its output to the next through a
:class:`SimulatedStageLink` (the same attributes a real
:class:`~minivllm.executor.stage_link.StageLink` has, so the worker runs the
same either way). See :mod:`minivllm.executor.abstract` for the interface.
"""

from __future__ import annotations

from typing import Any

from minivllm import backend
from minivllm.engine.config import WorkerConfig
from minivllm.executor.abstract import Executor
from minivllm.executor.ranks import check_model_parallel_sizes, simulates_all_ranks
from minivllm.pp_stages import IntermediateTensors
from minivllm.worker.worker import Worker


class SimulatedStageLink:
    """How simulated pipeline stages, one worker each in this process, hand each
    other their output: the stage before puts it down, the next one picks it up.

    It has the :class:`~minivllm.executor.stage_link.StageLink` attributes a
    worker reads, so that :meth:`~minivllm.worker.worker.Worker.execute_model`
    runs the same with real stages and with simulated ones.
    """

    def __init__(self, pp_rank: int, tp_size: int, pp_size: int, slot: list) -> None:
        self.pp_rank, self.tp_rank, self.pp_size = pp_rank, 0, pp_size
        self.rank = pp_rank * tp_size  # the rank a real stage's tp rank 0 would have
        self.is_first, self.is_last = pp_rank == 0, pp_rank == pp_size - 1
        self._slot = slot  # shared by every stage: at most one output on it

    def recv_intermediate(self, num_tokens: int) -> IntermediateTensors:
        """The previous stage's output, ``(T, hidden)`` x 2."""
        return self._slot.pop()

    def send_intermediate(self, tensors: IntermediateTensors) -> None:
        """This stage's output, for the next one."""
        self._slot.append(tensors)

    def send_output(self, output: object) -> None:
        """Nothing to send: the last stage's return value is the step's output."""

    def wait_sends(self) -> None:
        """Nothing in flight."""


class UniProcExecutor(Executor):
    """In-process :class:`~minivllm.worker.worker.Worker` s: one rank, or the ref simulation.

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
        if pp > 1:
            slot: list[IntermediateTensors] = []
            for r, w in enumerate(self.workers):
                w.link = SimulatedStageLink(r, tp, pp, slot)
        self.worker = self.workers[0]
        self.tokenizer, self.hf_config = self.worker.tokenizer, self.worker.hf_config

    def collective_rpc(self, method: str, args: tuple = (), kwargs: dict | None = None,
                       reply: bool = True) -> list[Any]:
        """Call ``method`` on every stage's worker in turn (stage 0 first: what it
        refuses, no later stage sees).

        With simulated stages a step runs every stage one after another, each
        handing its output to the next, so the timeline is all bubble.
        """
        return [getattr(w, method)(*args, **(kwargs or {})) for w in self.workers]

    def whole_model_worker(self) -> Worker | None:
        """The one worker, when there is one stage (it holds every simulated rank)."""
        return self.worker if len(self.workers) == 1 else None

    def check_health(self) -> None:
        """Nothing can die separately here."""

    def shutdown(self) -> None:
        """Nothing to stop."""
