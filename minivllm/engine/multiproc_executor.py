"""``MultiprocExecutor``: one process per (tensor x pipeline)-parallel rank, and its lifecycle.

Rank 0's :class:`~minivllm.engine.worker.Worker` lives in the engine process;
ranks ``1 .. tp*pp-1`` are worker processes (``multiprocessing`` ``spawn``),
laid out tensor-parallel inner (``rank = pp_rank * tp + tp_rank``, as vLLM).
Each step rank 0 sends the :class:`~minivllm.metadata.StepInput` (the batch
and the block-table changes, packed by :mod:`minivllm.engine.wire`) to its
stage's peers, and every stage forwards it to the next
(:mod:`minivllm.engine.stage_link`); every rank updates its own block table
and runs its layers; the logits come back on rank 0 only.

With pipeline parallelism (``pp_size > 1``) a step does not wait for its
logits: ``execute_model(step, non_block=True)`` runs stage 0's layers, sends
the intermediate tensors on and returns a :class:`PendingStep`, so the engine
can start the next micro-batch while later stages work
(``max_concurrent_batches = pp_size``, :mod:`minivllm.engine.pipeline`).
Every rank records when it worked on which micro-batch
(:meth:`MultiprocExecutor.stage_timeline`).

Failure handling, so that nothing hangs and nothing is orphaned:

- worker processes are daemons and poll their parent's pid (a watchdog
  thread): if the engine process dies, they exit;
- they ignore Ctrl-C: the engine process handles it and shuts them down
  (``atexit``, ``__del__``, or ``with MultiprocExecutor(...)``);
- rank 0 checks that every worker is alive before each step, and the
  process groups have a timeout (``timeout_s``), so a worker that dies
  mid-step makes the step raise ``RuntimeError("tensor-parallel worker N
  died (exitcode ...)")`` within seconds instead of blocking forever;
- rank 0 applies each step's block-table changes to its own table *before*
  sending them: a step the table refuses (``ValueError``) is never sent, and
  the executor refuses every later step, since its ranks' tables may now
  disagree.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import multiprocessing as mp
import os
import queue
import signal
import socket
import sys
import threading
import time
import traceback
import types
import weakref
from collections.abc import Iterator
from typing import Any

import torch

from minivllm import backend, distributed
from minivllm.engine.ranks import check_model_parallel_sizes, rank_devices, simulates_all_ranks
from minivllm.engine.stage_link import StageLink
from minivllm.engine.wire import (
    CMD_BYTES_PER_BLOCK,
    CMD_EXECUTE,
    CMD_INIT_KV_CACHE,
    CMD_MEMORY,
    CMD_SHUTDOWN,
    CMD_TIMELINE,
    make_header,
    pack_step_input,
    unpack_step_input,
)
from minivllm.metadata import StepInput
from minivllm.pp_stages import StageTiming, rank_coords


def _num_cpus() -> int:
    """CPUs this process may run on (its affinity mask, where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _main_module_hidden() -> Iterator[None]:
    """Start a worker without re-running the user's script inside it.

    ``spawn`` normally re-imports ``__main__`` in every child, so that
    functions defined there can be unpickled; a script without an ``if
    __name__ == "__main__":`` guard (a tutorial, a notebook) would then run
    again in each worker. Our worker's entry point lives in this module, so
    the child does not need ``__main__``: hide it while the child starts.
    """
    main = sys.modules["__main__"]
    sys.modules["__main__"] = types.ModuleType("__main__")  # no __file__, no __spec__
    try:
        yield
    finally:
        sys.modules["__main__"] = main


def _exit_if_orphaned(parent_pid: int) -> None:
    """Watchdog thread body: exit this worker as soon as its parent is gone."""
    while True:
        time.sleep(0.5)
        if os.getppid() != parent_pid:
            os._exit(1)


def _worker_main(rank: int, tp_size: int, init_method: str, dist_backend: str, model: str,
                 dtype: torch.dtype, device: torch.device, components: Any, timeout_s: float,
                 parent_pid: int, ready: Any, num_threads: int,
                 quantization: str | None = None, pp_size: int = 1,
                 pp_layer_partition: Any = None) -> None:
    """Entry point of worker process ``rank``: join the group, load the model, serve commands."""
    from minivllm.engine.worker import Worker

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the engine process's business
    threading.Thread(target=_exit_if_orphaned, args=(parent_pid,), daemon=True).start()
    if device.type == "cpu":
        torch.set_num_threads(num_threads)  # share the cores with the other ranks
    else:
        torch.cuda.set_device(device)
    pp_rank, _ = rank_coords(rank, tp_size)
    try:
        distributed.init_distributed(rank, tp_size * pp_size, init_method, dist_backend,
                                     timeout_s, tp_size=tp_size)
        # `components` arrived pickled as the engine's decided choices and was
        # rebuilt from them: the engine's record, not this process's default.
        worker = Worker(model, dtype, device, tp_size, components, quantization,
                        pp_rank=pp_rank, pp_size=pp_size, pp_layer_partition=pp_layer_partition)
        link = StageLink(rank, tp_size, pp_size, worker.hf_config.hidden_size, dtype, device)
    except BaseException:
        ready.put(("error", rank, traceback.format_exc()))
        raise
    ready.put(("ready", rank, None))
    _serve(worker, link)
    distributed.destroy_distributed()


def _serve(worker: Any, link: StageLink) -> None:
    """Worker loop: wait for a header, act on it, until CMD_SHUTDOWN.

    A step (CMD_EXECUTE): the payload, then (on a later stage) the previous
    stage's intermediate tensors; this stage's layers; then its output on to
    the next stage, or (the last stage) the logits back to rank 0.
    """
    import torch.distributed as dist

    batch, timeline = 0, []  # this rank's StageTiming records
    while True:
        header = link.recv_header()
        cmd = int(header[0])
        if cmd == CMD_EXECUTE:
            step_input = unpack_step_input(header, link.recv_payload(int(header[-1])))
            model_input = worker.prepare_model_input(step_input)
            if step_input.num_tokens:
                received = None if link.is_first else link.recv_intermediate(
                    step_input.num_tokens)
                start = time.time()
                out = worker.run_model(model_input, received)
                timeline.append(StageTiming(batch, link.rank, link.pp_rank, link.tp_rank,
                                            start, time.time()))
                if not link.is_last:
                    link.send_intermediate(out)
                elif link.pp_size > 1:
                    link.send_logits(out, step_input.logits_indices.numel())
            batch += 1
        elif cmd == CMD_INIT_KV_CACHE:
            worker.init_kv_cache(*(int(v) for v in header[1:5]))
        elif cmd == CMD_BYTES_PER_BLOCK:
            nbytes = torch.tensor([worker.bytes_per_block(int(header[1]))], dtype=torch.int64)
            dist.all_reduce(nbytes, op=dist.ReduceOp.MAX,
                            group=distributed.get_world_cpu_group())
        elif cmd == CMD_MEMORY:
            dist.gather_object(worker.memory_bytes(), None, dst=0,
                               group=distributed.get_world_cpu_group())
        elif cmd == CMD_TIMELINE:
            dist.gather_object(timeline, None, dst=0, group=distributed.get_world_cpu_group())
            if int(header[1]):
                timeline = []
        elif cmd == CMD_SHUTDOWN:
            link.wait_sends()
            return
        else:
            raise RuntimeError(f"parallel worker: unknown command {cmd}")


class PendingStep:
    """A micro-batch in flight on a pipeline; :meth:`result` waits for its logits.

    Results come back in the order the steps were sent: waiting for a later
    step collects the earlier ones first.
    """

    def __init__(self, executor: Any = None, num_rows: int = 0, value: Any = None,
                 done: bool = False) -> None:
        self.executor, self.num_rows = executor, num_rows
        self.value, self.done = value, done

    def result(self) -> torch.Tensor | None:
        """The step's ``(num_sampled, vocab)`` float32 logits (None for a step without tokens)."""
        while not self.done:
            self.executor._collect_oldest()
        return self.value


def _shutdown_if_alive(ref: weakref.ref) -> None:
    executor = ref()
    if executor is not None:
        executor.shutdown()


class MultiprocExecutor:
    """Rank 0 in this process, ranks ``1 .. tp_size * pp_size - 1`` in worker processes.

    Args:
        model: a registered name, an HF model directory or a ``.gguf`` file.
        dtype: weight and activation dtype.
        device: ``"cpu"`` (every rank on the CPU, gloo) or ``"cuda[:N]"``
            (rank ``r`` on ``cuda:N+r``, NCCL).
        tp_size: number of ranks.
        timeout_s: how long a collective waits for a peer before failing
            (default 60, or ``$MINIVLLM_TP_TIMEOUT_S``).
        components: the engine's :class:`~minivllm.backend.Components` (a
            spec, or None for the global one, is resolved once here); every
            worker process rebuilds the same record from its decided choices.
        quantization: None, ``"int8"``, ``"int4"`` or ``"gguf"``.
        pp_size: pipeline stages (each of ``tp_size`` ranks).
        pp_layer_partition: layers per stage (``"4,3,3"``), or None for the rule.
    """

    def __init__(self, model: str, dtype: torch.dtype, device: str | torch.device,
                 tp_size: int, timeout_s: float | None = None,
                 components: backend.Components | backend.BackendSpec | None = None,
                 quantization: str | None = None, pp_size: int = 1,
                 pp_layer_partition: Any = None) -> None:
        from minivllm.engine.worker import Worker

        if not isinstance(tp_size, int) or tp_size < 1:
            raise ValueError(f"tp_size must be an int >= 1, got {tp_size!r}")
        components = backend.as_components(components)
        if tp_size > 1 and simulates_all_ranks(components):
            raise ValueError(
                f"the selected linear layers ({components.linear.__name__}) simulate every "
                "rank in one process; use UniProcExecutor, or the fast linear backend for real "
                "worker processes"
            )
        # Before spawning anything: the sizes, and the partition, must split this model.
        check_model_parallel_sizes(model, tp_size, pp_size, pp_layer_partition)
        self.tp_size, self.pp_size = tp_size, pp_size
        world = tp_size * pp_size
        #: micro-batches the engine may keep in flight (vLLM's max_concurrent_batches)
        self.max_concurrent_batches = pp_size
        self.devices = rank_devices(device, world)
        self.timeout_s = float(timeout_s or os.environ.get("MINIVLLM_TP_TIMEOUT_S", 60))
        self.procs: list[Any] = []
        self._closed = False
        self._failure: str | None = None
        self._ready_ranks: set[int] = set()
        self._old_threads = torch.get_num_threads()
        self._pending: list[PendingStep] = []  # micro-batches sent, logits not yet back
        self._num_batches = 0
        self._timeline: list[StageTiming] = []  # rank 0's own records
        threads = max(1, _num_cpus() // world)
        dist_backend = "nccl" if self.devices[0].type == "cuda" else "gloo"
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        ctx = mp.get_context("spawn")
        self._ready = ctx.Queue()
        # atexit holds only a weak reference, so that dropping the executor runs __del__.
        self._atexit = functools.partial(_shutdown_if_alive, weakref.ref(self))
        atexit.register(self._atexit)
        try:
            for rank in range(1, world):
                p = ctx.Process(
                    target=_worker_main, name=f"minivllm-worker-{rank}", daemon=True,
                    args=(rank, tp_size, init_method, dist_backend, model, dtype,
                          self.devices[rank], components, self.timeout_s,
                          os.getpid(), self._ready, threads, quantization, pp_size,
                          pp_layer_partition),
                )
                with _main_module_hidden():
                    p.start()
                self.procs.append(p)
            if self.devices[0].type == "cpu":
                torch.set_num_threads(threads)
            else:
                torch.cuda.set_device(self.devices[0])  # NCCL uses the current device
            self._join_group(init_method, dist_backend)
            self.worker = Worker(model, dtype, self.devices[0], tp_size, components,
                                 quantization, pp_rank=0, pp_size=pp_size,
                                 pp_layer_partition=pp_layer_partition)
            self.link = StageLink(0, tp_size, pp_size, self.worker.hf_config.hidden_size,
                                  dtype, self.devices[0])
            self._wait_until_ready()
        except BaseException:
            self.shutdown()
            raise
        self.tokenizer, self.hf_config = self.worker.tokenizer, self.worker.hf_config

    # -- liveness -------------------------------------------------------------

    def _describe(self, rank: int) -> str:
        if self.pp_size == 1:
            return f"tensor-parallel worker {rank}"
        pp_rank, tp_rank = rank_coords(rank, self.tp_size)
        return f"pipeline-parallel worker {rank} (stage {pp_rank}, tp rank {tp_rank})"

    def _dead_workers(self) -> list[str]:
        return [f"{self._describe(rank)} died (exitcode {p.exitcode})"
                for rank, p in enumerate(self.procs, start=1) if not p.is_alive()]

    def check_health(self) -> None:
        """Raise ``RuntimeError`` if a worker died or an earlier step failed."""
        if self._failure is not None:
            raise RuntimeError(self._failure)
        if self._closed:
            raise RuntimeError("the executor was shut down")
        dead = self._dead_workers()
        if dead:
            self._failure = "; ".join(dead)
            raise RuntimeError(self._failure)

    def _join_group(self, init_method: str, dist_backend: str) -> None:
        """Rank 0's rendezvous, watching the workers: one that dies before joining
        would otherwise leave rank 0 waiting for the whole timeout."""
        error: list[BaseException] = []

        def join() -> None:
            try:
                distributed.init_distributed(0, self.tp_size * self.pp_size, init_method,
                                             dist_backend, self.timeout_s, tp_size=self.tp_size)
            except BaseException as e:  # handed to the main thread below
                error.append(e)

        thread = threading.Thread(target=join, daemon=True)
        thread.start()
        while thread.is_alive():
            thread.join(timeout=0.2)
            if thread.is_alive():
                self._poll_ready(block=False)
                self.check_health()
        if error:
            raise error[0]

    def _poll_ready(self, block: bool) -> None:
        """Take start-up messages off the queue; raise on a worker's error."""
        try:
            status, rank, err = self._ready.get(timeout=0.5) if block else self._ready.get_nowait()
        except queue.Empty:
            return
        if status == "error":
            self._failure = f"{self._describe(rank)} failed to start:\n{err}"
            raise RuntimeError(self._failure)
        self._ready_ranks.add(rank)

    def _wait_until_ready(self) -> None:
        while len(self._ready_ranks) < self.tp_size * self.pp_size - 1:
            self._poll_ready(block=True)
            self.check_health()

    def _run(self, fn: Any) -> Any:
        """Run one collective step on rank 0; a dead peer becomes a clear RuntimeError."""
        self.check_health()
        try:
            return fn()
        except Exception as e:
            # A peer that died mid-collective shows up as a gloo/NCCL error (connection
            # closed, or the timeout); give the OS a moment to report its exit code.
            deadline = time.monotonic() + 5.0
            while not self._dead_workers() and time.monotonic() < deadline:
                time.sleep(0.05)
            dead = self._dead_workers()
            self._failure = "; ".join(dead) if dead else f"parallel step failed: {e}"
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
        import torch.distributed as dist

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

    def execute_model(self, step_input: StepInput,
                      non_block: bool = False) -> torch.Tensor | None | PendingStep:
        """Send ``step_input``; every rank updates its block table and runs its layers.

        Returns the logits (rank 0's), or None for a step without tokens; with
        ``non_block`` a :class:`PendingStep` whose ``result()`` is that. With
        pipeline parallelism this returns once stage 0 has run and sent its
        output on; up to ``max_concurrent_batches`` steps may be pending.
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
            if self.pp_size > 1:
                self.link.send_intermediate(out)  # on to stage 1; logits come back later
            return out

        out = self._run(step)
        if self.pp_size == 1 or step_input.num_tokens == 0:
            pending = PendingStep(value=out, done=True)
        else:
            pending = PendingStep(self, num_rows=step_input.logits_indices.numel())
            self._pending.append(pending)
        return pending if non_block else pending.result()

    def _collect_oldest(self) -> None:
        """Receive the logits of the oldest micro-batch in flight (they arrive in order)."""
        pending = self._pending[0]
        vocab = self.hf_config.vocab_size
        pending.value = self._run(
            lambda: self.link.recv_logits(pending.num_rows, vocab, self.devices[0]))
        pending.done = True
        self._pending.pop(0)

    def memory_per_rank(self) -> list[dict[str, int]]:
        """``[{"weights": bytes, "kv_cache": bytes}, ...]``, one per rank (rank order)."""
        import torch.distributed as dist

        self._require_idle("memory_per_rank")

        def step() -> list[dict[str, int]]:
            self._send_header(CMD_MEMORY)
            out: list[Any] = [None] * (self.tp_size * self.pp_size)
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
        import torch.distributed as dist

        self._require_idle("stage_timeline")

        def step() -> list[StageTiming]:
            self._send_header(CMD_TIMELINE, int(clear))
            out: list[Any] = [None] * (self.tp_size * self.pp_size)
            dist.gather_object(self._timeline, out, dst=0,
                               group=distributed.get_world_cpu_group())
            return [t for records in out for t in records]

        records = self._run(step)
        if clear:
            self._timeline = []
        return sorted(records, key=lambda t: (t.batch, t.rank))

    def shutdown(self) -> None:
        """Stop the workers (politely, then by force) and leave the process group."""
        if self._closed:
            return
        atexit.unregister(self._atexit)
        if self._failure is None and self.procs and not self._dead_workers():
            try:
                while self._pending:  # the last stage's sends must be received first
                    self._collect_oldest()
                self._send_header(CMD_SHUTDOWN)
                self.link.wait_sends()
            except Exception:
                pass  # they are stopped below either way
        self._closed = True
        for p in self.procs:
            p.join(timeout=15)  # a loaded machine may take seconds to tear a rank down
            if p.is_alive():
                p.terminate()
                p.join(timeout=2)
            if p.is_alive():
                p.kill()
                p.join()
        distributed.destroy_distributed()
        torch.set_num_threads(self._old_threads)

    def __del__(self) -> None:
        try:
            self.shutdown()
        except Exception:
            pass

    def __enter__(self) -> MultiprocExecutor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
