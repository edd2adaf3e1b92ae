"""``MultiprocExecutor``: one process per (tensor x pipeline)-parallel rank, seen from rank 0.

Rank 0's :class:`~minivllm.worker.worker.Worker` lives in the engine process;
ranks ``1 .. tp*pp-1`` are other processes, laid out tensor-parallel inner
(``rank = pp_rank * tp + tp_rank``, as vLLM), each running
:func:`minivllm.worker.worker.serve`. How they start is a strategy
(:mod:`minivllm.executor.rank_starters`): spawned from here, or started by a
launcher such as ``torchrun``. Every rank operation is one call,
:meth:`MultiprocExecutor.collective_rpc`: rank 0 sends the method's name and
arguments (pickled by :mod:`minivllm.executor.wire`) to its stage's peers,
every stage forwards it to the next (:mod:`minivllm.executor.stage_link`), and
every rank calls that method of its worker. Each step is the call
``execute_model`` with the :class:`~minivllm.metadata.StepInput` (the batch
and the block-table changes): every rank updates its own block table and
runs its layers; the last stage's tp rank 0 samples, and only the step's
token ids come back to rank 0 (a
:class:`~minivllm.step_sampling.ModelRunnerOutput`).

With pipeline parallelism (``pp_size > 1``) a step does not wait for its
tokens: :meth:`~minivllm.executor.abstract.Executor.execute_model` runs stage 0's layers, sends
the intermediate tensors on and returns a
:class:`~minivllm.executor.abstract.PendingStep`, so the engine can start the
next micro-batch while later stages work (``max_concurrent_batches =
pp_size``). Every rank records when it worked on which micro-batch
(:meth:`MultiprocExecutor.stage_timeline`).

Failure handling, so that nothing hangs and nothing is orphaned:

- spawned ranks are daemons and poll their parent's pid (a watchdog thread):
  if the engine process dies, they exit; they ignore Ctrl-C (the engine
  process handles it and shuts them down: ``atexit``, ``__del__``, or ``with``);
- a thread watches the spawned ranks: the first one that dies is named and
  every other one is killed at once, so a rank that dies mid-step makes the
  step raise ``RuntimeError("tensor-parallel rank N (pid P) died: killed by
  SIGKILL")`` within seconds instead of blocking, and no rank is left
  waiting on it; rank 0 also checks before each call, and the process groups
  have a timeout (``WorkerConfig.timeout_s``) for what no exit code shows;
- a step that rank 0's block table refuses (``ValueError``) raises, and the
  executor refuses every later step, since its ranks' tables may now
  disagree.
"""

from __future__ import annotations

import atexit
import functools
import weakref
from typing import Any

import torch
import torch.distributed as dist

from minivllm import backend, distributed
from minivllm.engine.config import WorkerConfig
from minivllm.executor.abstract import Executor, PendingStep
from minivllm.executor.rank_starters import LaunchedRanks, SpawnedRanks
from minivllm.executor.ranks import check_model_parallel_sizes, simulates_all_ranks
from minivllm.executor.stage_link import StageLink
from minivllm.worker.worker import Worker


def _shutdown_if_alive(ref: weakref.ref) -> None:
    executor = ref()
    if executor is not None:
        executor.shutdown()


def _without_frames(error: Exception) -> Exception:
    """``error`` without its traceback: the frames of a failed collective hold its
    process group, and so the group's TCP store and port, for as long as the caller
    keeps the error we raise from it (the message says what happened)."""
    return error.with_traceback(None)


class MultiprocExecutor(Executor):
    """Rank 0 in this process, ranks ``1 .. tp_size * pp_size - 1`` in other processes.

    Args:
        config: the model, dtype, device (``"cpu"``: every rank on the CPU,
            gloo; ``"cuda[:N]"``: rank ``r`` on ``cuda:N+r``, NCCL), the
            parallel sizes and the collectives' timeout.
        components: the engine's :class:`~minivllm.backend.Components` (a
            spec, or None for the global one, is resolved once here); every
            other rank rebuilds the same record from its decided choices.
        ranks: how the other ranks start: :class:`~minivllm.executor.rank_starters.SpawnedRanks`
            (the default) or :class:`~minivllm.executor.rank_starters.LaunchedRanks`.
        collective_stats: a :class:`~minivllm.distributed.CollectiveStats`
            that rank 0's collectives add their wall time to (``bench tp``),
            or None.
    """

    def __init__(self, config: WorkerConfig,
                 components: backend.Components | backend.BackendSpec | None = None,
                 ranks: SpawnedRanks | LaunchedRanks | None = None,
                 collective_stats: distributed.CollectiveStats | None = None) -> None:
        components = backend.as_components(components)
        tp, pp = config.tensor_parallel_size, config.pipeline_parallel_size
        if tp > 1 and simulates_all_ranks(components):
            raise ValueError(
                f"the selected linear layers ({components.linear.__name__}) simulate every "
                "rank in one process; use UniProcExecutor, or the fast linear backend for real "
                "worker processes")
        # Before starting anything: the sizes, and the partition, must split this model.
        check_model_parallel_sizes(config.model, tp, pp, config.pp_layer_partition)
        self.config = config
        self.ranks = SpawnedRanks() if ranks is None else ranks
        #: micro-batches the engine may keep in flight (vLLM's max_concurrent_batches)
        self.max_concurrent_batches = pp
        self._closed = False
        self._failure: str | None = None
        self._old_threads = torch.get_num_threads()
        self._pending: list[PendingStep] = []  # micro-batches sent, tokens not yet back
        # atexit holds only a weak reference, so that dropping the executor runs __del__.
        self._atexit = functools.partial(_shutdown_if_alive, weakref.ref(self))
        atexit.register(self._atexit)
        try:
            rank0 = self.ranks.start(config, components)
            self.device = rank0.device
            self.ranks.join_group(
                lambda: distributed.init_distributed(
                    0, config.num_ranks, rank0.init_method, rank0.dist_backend,
                    config.timeout_s, tp_size=tp, collective_stats=collective_stats),
                self.check_health)
            self.worker = Worker(config, components, pp_rank=0, device=rank0.device)
            self.link = self.worker.link = StageLink(
                0, tp, pp, self.worker.hf_config.hidden_size, config.dtype, rank0.device)
            self.ranks.wait_ready(self.check_health)
        except BaseException as e:
            if isinstance(e, RuntimeError) and self._failure is None:
                self._failure = str(e)
            self.shutdown()
            raise
        self.tokenizer, self.hf_config = self.worker.tokenizer, self.worker.hf_config

    @property
    def procs(self) -> list[Any]:
        """The processes this executor started (none under a launcher)."""
        return self.ranks.procs

    # -- liveness -------------------------------------------------------------

    def check_health(self) -> None:
        """Raise ``RuntimeError`` if a rank died or an earlier step failed."""
        if self._failure is not None:
            raise RuntimeError(self._failure)
        if self._closed:
            raise RuntimeError("the executor was shut down")
        dead = self.ranks.dead_ranks()
        if dead:
            self._failure = "; ".join(dead)
            raise RuntimeError(self._failure)

    def _run(self, fn: Any) -> Any:
        """Run one collective step on rank 0; a broken group becomes a clear RuntimeError."""
        self.check_health()
        try:
            return fn()
        except Exception as e:
            self._failure = self.ranks.explain(e)
            raise RuntimeError(self._failure) from _without_frames(e)

    # -- the one call ---------------------------------------------------------

    def collective_rpc(self, method: str, args: tuple = (), kwargs: dict | None = None,
                       reply: bool = True) -> list[Any]:
        """Send the call to every rank, make it on rank 0, and (``reply``) gather the results.

        A call with replies first collects the micro-batches still in flight
        (the last stage's outputs travel on the same group). A method that
        raises on any rank raises here, rank 0's own error first, and the
        ranks stay in step. A step (``reply=False``) that raises on rank 0
        may have left the ranks' block tables apart, so every later call is
        refused.
        """
        self.check_health()
        if reply:
            while self._pending:
                self.collect_oldest()
        kwargs = kwargs or {}
        self._run(lambda: self.link.send_rpc(method, args, kwargs, reply))
        try:
            result, error = getattr(self.worker, method)(*args, **kwargs), None
        except Exception as e:
            result, error = None, e
        if not reply:
            if error is not None:
                self._fail(error)
            return [result]
        results: list[Any] = [None] * self.config.num_ranks
        self._run(lambda: dist.gather_object((result, None), results, dst=0,
                                             group=distributed.get_world_cpu_group()))
        if error is not None:
            raise error
        for rank, (_, message) in enumerate(results):
            if message is not None:
                raise RuntimeError(f"rank {rank}: {method} failed: {message}")
        return [value for value, _ in results]

    def _fail(self, error: Exception) -> None:
        """Rank 0's step raised: refuse what follows, and raise the clearest error."""
        if isinstance(error, ValueError):  # its block table refused the step's changes
            self._failure = ("parallel step refused, the ranks' block tables may differ: "
                             f"{error}")
            raise error
        self._failure = self.ranks.explain(error)  # most often: a rank died mid-step
        raise RuntimeError(self._failure) from _without_frames(error)

    def output_later(self) -> PendingStep:
        """Stage 0 has run and sent its output on: the tokens come back later, in order."""
        pending = PendingStep(self)
        self._pending.append(pending)
        return pending

    def collect_oldest(self) -> None:
        """Receive the output of the oldest micro-batch in flight (they arrive in order)."""
        pending = self._pending[0]
        pending.value = self._run(self.link.recv_output)
        pending.done = True
        self._pending.pop(0)

    def whole_model_worker(self) -> Worker | None:
        """None: rank 0 holds only its shard (and its stage) of the model."""
        return None

    def shutdown(self) -> None:
        """Stop the other ranks (politely, then, if this process started them, by force)
        and leave the process group."""
        if self._closed:
            return
        atexit.unregister(self._atexit)
        if self._failure is None and hasattr(self, "link") and not self.ranks.dead_ranks():
            self.ranks.expect_exit()  # the ranks exit now because they are asked to
            try:
                while self._pending:  # the last stage's sends must be received first
                    self.collect_oldest()
                self.collective_rpc("shutdown", reply=False)
            except Exception:
                pass  # they are stopped below either way
        self._closed = True
        self.ranks.stop()
        distributed.destroy_distributed()
        torch.set_num_threads(self._old_threads)

    def __del__(self) -> None:
        try:
            self.shutdown()
        except Exception:
            pass

