"""Executors: who runs one engine's :class:`~minivllm.worker.worker.Worker` on every rank.

The engine (scheduler, sampler, outputs) lives in one process and calls its
executor once per step. :class:`Executor` states everything the engine uses
of one, so the engine never has to guess what an executor offers. Every
rank operation goes through ONE call, :meth:`Executor.collective_rpc`
(``method`` names a :class:`~minivllm.worker.worker.Worker` method, run on
every rank); the operations themselves are written once, in the base class.
Two implementations, which differ only in how a call reaches the ranks:

- :class:`~minivllm.executor.uniproc_executor.UniProcExecutor`: the workers live in this process and a
  call is a method call on each. One rank, or the ref's linear layers that
  simulate every tensor-parallel rank in one process, and with pipeline
  parallelism one worker per stage, run one after another, each handing its
  output to the next through a
  :class:`~minivllm.executor.uniproc_executor.SimulatedStageLink`.
- :class:`~minivllm.executor.multiproc_executor.MultiprocExecutor`: one process
  per rank, with real collectives; a call is pickled and broadcast
  (:mod:`minivllm.executor.wire`). Rank 0's worker lives in this process; how
  the other ranks come to exist is a strategy
  (:mod:`minivllm.executor.rank_starters`): spawned from here (``"mp"``) or
  started by a launcher such as ``torchrun`` (``"external_launcher"``).

:func:`minivllm.executor.launcher.make_executor` chooses among them, once.
Every step takes a :class:`~minivllm.metadata.StepInput`: the batch plus the
block-table changes, which every rank's worker applies to its own table.
"""

from __future__ import annotations

import abc
from typing import Any

from minivllm.engine.config import WorkerConfig
from minivllm.metadata import StepInput
from minivllm.pp_stages import IntermediateTensors, StageTiming
from minivllm.step_sampling import ModelRunnerOutput
from minivllm.worker.worker import Worker


class PendingStep:
    """A step sent to the workers; :meth:`result` waits for its output.

    With pipeline parallelism a step returns once stage 0 has run, and its
    output comes back later; results come back in the order the steps were
    sent (waiting for a later step collects the earlier ones first). A step
    that is already done holds its ``value``.
    """

    def __init__(self, executor: Any = None, value: Any = None, done: bool = False) -> None:
        self.executor = executor
        self.value, self.done = value, done

    def result(self) -> ModelRunnerOutput | None:
        """The step's :class:`~minivllm.step_sampling.ModelRunnerOutput`: its tokens (its
        raw logits for a step without a plan); None for a step without tokens."""
        while not self.done:
            self.executor.collect_oldest()
        return self.value


class Executor(abc.ABC):
    """Everything the engine uses of whoever runs its workers.

    Every rank operation is one call, :meth:`collective_rpc` (vLLM v1's
    name): the method of :class:`~minivllm.worker.worker.Worker` to run on
    every rank, and its arguments. The operations the engine uses
    (:meth:`execute_model`, :meth:`init_kv_cache`, ...) are written once,
    here, over it; an executor only says how a call reaches its ranks.

    Attributes:
        config: the :class:`~minivllm.engine.config.WorkerConfig` every rank was built from.
        worker: rank 0's worker, in this process (the first stage's, when the
            stages are simulated here), for inspection (tests, benchmarks): the
            engine reaches the ranks only through :meth:`collective_rpc`.
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
    def collective_rpc(self, method: str, args: tuple = (), kwargs: dict | None = None,
                       reply: bool = True) -> list[Any]:
        """Call ``worker.method(*args, **kwargs)`` on every rank (every simulated stage).

        Returns the results, one per rank in rank order (one per stage when
        the ranks are simulated). ``reply=False`` is for the per-step call,
        whose outputs travel stage to stage instead: only the results of the
        workers in this process come back. A method that raises on a rank
        raises here.
        """

    def execute_model(self, step_input: StepInput) -> PendingStep:
        """Send one step to every rank; its tokens come back through the :class:`PendingStep`.

        Every rank updates its block table and runs its layers, and the
        sampling worker samples
        (:meth:`~minivllm.worker.worker.Worker.execute_model`). At most
        :attr:`max_concurrent_batches` steps may be pending at once.
        """
        outs = self.collective_rpc("execute_model", (step_input,), reply=False)
        if isinstance(outs[-1], IntermediateTensors):  # the last stage is another process
            return self.output_later()
        if step_input.num_tokens == 0:
            return PendingStep(value=None, done=True)
        return PendingStep(value=next(o for o in outs if isinstance(o, ModelRunnerOutput)),
                           done=True)

    def output_later(self) -> PendingStep:
        """A step whose output a later stage in another process sends back."""
        raise NotImplementedError(f"{type(self).__name__} runs every stage in this process")

    def bytes_per_block(self, block_size: int) -> int:
        """KV-cache bytes one block costs on one rank (the largest rank's)."""
        return max(self.collective_rpc("bytes_per_block", (block_size,)))

    def init_kv_cache(self, num_blocks: int, block_size: int, max_num_reqs: int = 256,
                      max_num_blocks_per_req: int | None = None,
                      max_model_len: int | None = None) -> None:
        """Allocate every rank's KV cache (its own layers and KV heads) and block
        table, and build its model runner (and the sampling worker's sampler)."""
        self.collective_rpc("init_kv_cache", (num_blocks, block_size, max_num_reqs,
                                              max_num_blocks_per_req, max_model_len))

    def add_lora(self, lora_request: Any) -> None:
        """Load a LoRA adapter on every rank (each its shards); ``ValueError`` if it is bad."""
        self.collective_rpc("add_lora", (lora_request,))

    def remove_lora(self, lora_int_id: int) -> None:
        """Forget an adapter on every rank."""
        self.collective_rpc("remove_lora", (lora_int_id,))

    def memory_per_rank(self) -> list[dict[str, int]]:
        """``[{"weights": bytes, "kv_cache": bytes}, ...]``, one per rank (or simulated stage)."""
        return self.collective_rpc("memory_bytes")

    def stage_timeline(self, clear: bool = False) -> list[StageTiming]:
        """Every stage's :class:`~minivllm.pp_stages.StageTiming` records, by (batch, rank).

        One record per rank per micro-batch with tokens: when the rank had
        its inputs and when its output was ready (``time.time()`` seconds;
        batches are numbered from 0 per executor). ``clear`` forgets them
        afterwards. Call it between steps, with no micro-batch in flight.
        """
        per_rank = self.collective_rpc("stage_timeline", (clear,))
        return sorted((t for records in per_rank for t in records),
                      key=lambda t: (t.batch, t.rank))

    @abc.abstractmethod
    def whole_model_worker(self) -> Worker | None:
        """The worker that holds every layer of every rank in this process, or None.

        A draft model runs beside the target in one process and needs it; with
        one process per rank (or per stage) there is none.
        """

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
