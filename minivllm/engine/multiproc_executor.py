"""``MultiprocExecutor``: one process per (tensor x pipeline)-parallel rank, seen from rank 0.

Rank 0's :class:`~minivllm.engine.worker.Worker` lives in the engine process;
ranks ``1 .. tp*pp-1`` are other processes, laid out tensor-parallel inner
(``rank = pp_rank * tp + tp_rank``, as vLLM), each running
:func:`minivllm.engine.worker.serve`. How they start is a strategy
(:mod:`minivllm.engine.rank_starters`): spawned from here, or started by a
launcher such as ``torchrun``. Each step rank 0 sends the
:class:`~minivllm.metadata.StepInput` (the batch and the block-table changes,
packed by :mod:`minivllm.engine.wire`) to its stage's peers, and every stage
forwards it to the next (:mod:`minivllm.engine.stage_link`); every rank
updates its own block table and runs its layers; the logits come back on
rank 0 only.

With pipeline parallelism (``pp_size > 1``) a step does not wait for its
logits: :meth:`MultiprocExecutor.execute_model` runs stage 0's layers, sends
the intermediate tensors on and returns a
:class:`~minivllm.engine.executor.PendingStep`, so the engine can start the
next micro-batch while later stages work (``max_concurrent_batches =
pp_size``). Every rank records when it worked on which micro-batch
(:meth:`MultiprocExecutor.stage_timeline`).

Failure handling, so that nothing hangs and nothing is orphaned:

- spawned ranks are daemons and poll their parent's pid (a watchdog thread):
  if the engine process dies, they exit; they ignore Ctrl-C (the engine
  process handles it and shuts them down: ``atexit``, ``__del__``, or ``with``);
- rank 0 checks that every spawned rank is alive before each step, and the
  process groups have a timeout (``WorkerConfig.timeout_s``), so a rank that
  dies mid-step makes the step raise ``RuntimeError("tensor-parallel worker N
  died (exitcode ...)")`` within seconds instead of blocking forever;
- rank 0 applies each step's block-table changes to its own table *before*
  sending them: a step the table refuses (``ValueError``) is never sent, and
  the executor refuses every later step, since its ranks' tables may now
  disagree.
"""

from __future__ import annotations

import atexit
import functools
import time
import weakref
from typing import Any

import torch
import torch.distributed as dist

from minivllm import backend, distributed
from minivllm.engine.config import WorkerConfig
from minivllm.engine.executor import Executor, PendingStep
from minivllm.engine.rank_starters import LaunchedRanks, SpawnedRanks
from minivllm.engine.ranks import check_model_parallel_sizes, simulates_all_ranks
from minivllm.engine.stage_link import StageLink
from minivllm.engine.wire import (
    CMD_BYTES_PER_BLOCK,
    CMD_INIT_KV_CACHE,
    CMD_MEMORY,
    CMD_REMOVE_LORA,
    CMD_SHUTDOWN,
    CMD_TIMELINE,
    make_header,
    pack_lora_request,
    pack_step_input,
)
from minivllm.engine.worker import Worker
from minivllm.metadata import StepInput
from minivllm.pp_stages import StageTiming


def _shutdown_if_alive(ref: weakref.ref) -> None:
    executor = ref()
    if executor is not None:
        executor.shutdown()


class MultiprocExecutor(Executor):
    """Rank 0 in this process, ranks ``1 .. tp_size * pp_size - 1`` in other processes.

    Args:
        config: the model, dtype, device (``"cpu"``: every rank on the CPU,
            gloo; ``"cuda[:N]"``: rank ``r`` on ``cuda:N+r``, NCCL), the
            parallel sizes and the collectives' timeout.
        components: the engine's :class:`~minivllm.backend.Components` (a
            spec, or None for the global one, is resolved once here); every
            other rank rebuilds the same record from its decided choices.
        ranks: how the other ranks start: :class:`~minivllm.engine.rank_starters.SpawnedRanks`
            (the default) or :class:`~minivllm.engine.rank_starters.LaunchedRanks`.
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
        self._pending: list[PendingStep] = []  # micro-batches sent, logits not yet back
        self._num_batches = 0
        self._timeline: list[StageTiming] = []  # rank 0's own records
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
            self.link = StageLink(0, tp, pp, self.worker.hf_config.hidden_size, config.dtype,
                                  rank0.device)
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
            raise RuntimeError(self._failure) from e

    def _send_header(self, *values: int) -> None:
        self.link.send_header(make_header(*values))

    def _require_idle(self, what: str) -> None:
        if self._pending:
            raise RuntimeError(f"{what}: {len(self._pending)} micro-batches are still in "
                               "flight; collect their results first")

    # -- the executor API -----------------------------------------------------

    def bytes_per_block(self, block_size: int) -> int:
        """KV-cache bytes per block on one rank (the max over ranks; they are equal)."""
        def step() -> int:
            self._send_header(CMD_BYTES_PER_BLOCK, block_size)
            nbytes = torch.tensor([self.worker.bytes_per_block(block_size)], dtype=torch.int64)
            dist.all_reduce(nbytes, op=dist.ReduceOp.MAX,
                            group=distributed.get_world_cpu_group())
            return int(nbytes)

        return self._run(step)

    def init_kv_cache(self, num_blocks: int, block_size: int, max_num_reqs: int = 256,
                      max_num_blocks_per_req: int | None = None) -> None:
        """Allocate ``num_blocks`` blocks of this rank's KV heads, and a block table, on every rank."""
        sizes = (num_blocks, block_size, max_num_reqs, max_num_blocks_per_req or num_blocks)

        def step() -> None:
            self._send_header(CMD_INIT_KV_CACHE, *sizes)
            self.worker.init_kv_cache(*sizes)

        self._run(step)

    def execute_model(self, step_input: StepInput) -> PendingStep:
        """Send ``step_input``; every rank updates its block table and runs its layers.

        With one stage the returned step is done (its logits are rank 0's,
        None for a step without tokens). With pipeline parallelism it returns
        once stage 0 has run and sent its output on; up to
        ``max_concurrent_batches`` steps may be pending.
        """
        self.check_health()
        try:
            # Rank 0 first: a change its table refuses is never sent to the others.
            model_input = self.worker.prepare_model_input(step_input)
        except ValueError as e:
            self._failure = f"parallel step refused, the ranks' block tables may differ: {e}"
            raise
        header, payload = pack_step_input(step_input)
        batch = self._num_batches
        self._num_batches += 1

        def step() -> torch.Tensor | None:
            self.link.send_header(header)
            self.link.send_payload(payload)
            if step_input.num_tokens == 0:
                return None
            start = time.time()
            out = self.worker.run_model(model_input)
            self._timeline.append(StageTiming(batch, 0, 0, 0, start, time.time()))
            if self.config.pipeline_parallel_size > 1:
                self.link.send_intermediate(out)  # on to stage 1; logits come back later
            return out

        out = self._run(step)
        if self.config.pipeline_parallel_size == 1 or step_input.num_tokens == 0:
            return PendingStep(value=out, done=True)
        pending = PendingStep(self, num_rows=step_input.logits_indices.numel())
        self._pending.append(pending)
        return pending

    def collect_oldest(self) -> None:
        """Receive the logits of the oldest micro-batch in flight (they arrive in order)."""
        pending = self._pending[0]
        vocab = self.hf_config.vocab_size
        pending.value = self._run(
            lambda: self.link.recv_logits(pending.num_rows, vocab, self.device))
        pending.done = True
        self._pending.pop(0)

    def add_lora(self, lora_request: Any) -> None:
        """Load an adapter on rank 0 (a bad one raises ``ValueError`` here, and no other
        rank hears of it), then on every other rank."""
        self.check_health()
        self._require_idle("add_lora")
        self.worker.add_lora(lora_request)
        header, payload = pack_lora_request(lora_request)

        def step() -> None:
            self.link.send_header(header)
            self.link.send_payload(payload)

        self._run(step)

    def remove_lora(self, lora_int_id: int) -> None:
        """Forget an adapter on every rank."""
        self._require_idle("remove_lora")
        self.worker.remove_lora(lora_int_id)
        self._run(lambda: self._send_header(CMD_REMOVE_LORA, lora_int_id))

    def whole_model_worker(self) -> Worker | None:
        """None: rank 0 holds only its shard (and its stage) of the model."""
        return None

    def memory_per_rank(self) -> list[dict[str, int]]:
        """``[{"weights": bytes, "kv_cache": bytes}, ...]``, one per rank (rank order)."""
        self._require_idle("memory_per_rank")

        def step() -> list[dict[str, int]]:
            self._send_header(CMD_MEMORY)
            out: list[Any] = [None] * self.config.num_ranks
            dist.gather_object(self.worker.memory_bytes(), out, dst=0,
                               group=distributed.get_world_cpu_group())
            return out

        return self._run(step)

    def stage_timeline(self, clear: bool = False) -> list[StageTiming]:
        """Every rank's :class:`~minivllm.pp_stages.StageTiming` records, by (batch, rank).

        One record per rank per micro-batch with tokens: when the rank had
        its inputs and when its output was ready (``time.time()`` seconds;
        batches are numbered from 0 per executor). ``clear`` forgets them
        afterwards. Call it between steps, with no micro-batch in flight.
        """
        self._require_idle("stage_timeline")

        def step() -> list[StageTiming]:
            self._send_header(CMD_TIMELINE, int(clear))
            out: list[Any] = [None] * self.config.num_ranks
            dist.gather_object(self._timeline, out, dst=0,
                               group=distributed.get_world_cpu_group())
            return [t for records in out for t in records]

        records = self._run(step)
        if clear:
            self._timeline = []
        return sorted(records, key=lambda t: (t.batch, t.rank))

    def shutdown(self) -> None:
        """Stop the other ranks (politely, then, if this process started them, by force)
        and leave the process group."""
        if self._closed:
            return
        atexit.unregister(self._atexit)
        if self._failure is None and hasattr(self, "link") and not self.ranks.dead_ranks():
            try:
                while self._pending:  # the last stage's sends must be received first
                    self.collect_oldest()
                self._send_header(CMD_SHUTDOWN)
                self.link.wait_sends()
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

