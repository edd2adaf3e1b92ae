"""``MultiprocExecutor``: one process per tensor-parallel rank, and its lifecycle.

Rank 0's :class:`~minivllm.engine.worker.Worker` lives in the engine process;
ranks ``1 .. tp-1`` are worker processes (``multiprocessing`` ``spawn``). Each
step rank 0 broadcasts the :class:`~minivllm.metadata.StepInput` (the batch
and the block-table changes, packed by :mod:`minivllm.engine.wire`), every
rank updates its own block table and runs the forward together; the logits
come back on rank 0 only.

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
from minivllm.engine.ranks import check_model_tp_size, rank_devices, simulates_all_ranks
from minivllm.engine.wire import (
    CMD_BYTES_PER_BLOCK,
    CMD_EXECUTE,
    CMD_INIT_KV_CACHE,
    CMD_SHUTDOWN,
    HEADER_LEN,
    make_header,
    pack_step_input,
    unpack_step_input,
)
from minivllm.metadata import StepInput


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
                 quantization: str | None = None) -> None:
    """Entry point of worker process ``rank``: join the group, load the model, serve commands."""
    from minivllm.engine.worker import Worker

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the engine process's business
    threading.Thread(target=_exit_if_orphaned, args=(parent_pid,), daemon=True).start()
    if device.type == "cpu":
        torch.set_num_threads(num_threads)  # share the cores with the other ranks
    else:
        torch.cuda.set_device(device)
    try:
        distributed.init_distributed(rank, tp_size, init_method, dist_backend, timeout_s)
        # `components` arrived pickled as the engine's decided choices and was
        # rebuilt from them: the engine's record, not this process's default.
        worker = Worker(model, dtype, device, tp_size, components, quantization)
    except BaseException:
        ready.put(("error", rank, traceback.format_exc()))
        raise
    ready.put(("ready", rank, None))
    _serve(worker)
    distributed.destroy_distributed()


def _serve(worker: Any) -> None:
    """Worker loop: wait for a header from rank 0, act on it, until CMD_SHUTDOWN."""
    import torch.distributed as dist

    header = torch.empty(HEADER_LEN, dtype=torch.int64)
    while True:
        dist.broadcast(header, src=0, group=distributed.get_control_group())
        cmd = int(header[0])
        if cmd == CMD_EXECUTE:
            payload = torch.empty(int(header[-1]), dtype=torch.int64)
            dist.broadcast(payload, src=0, group=distributed.get_cpu_group())
            worker.execute_model(unpack_step_input(header, payload))  # logits: rank 0
        elif cmd == CMD_INIT_KV_CACHE:
            worker.init_kv_cache(*(int(v) for v in header[1:5]))
        elif cmd == CMD_BYTES_PER_BLOCK:
            nbytes = torch.tensor([worker.bytes_per_block(int(header[1]))], dtype=torch.int64)
            dist.all_reduce(nbytes, op=dist.ReduceOp.MAX, group=distributed.get_cpu_group())
        elif cmd == CMD_SHUTDOWN:
            return
        else:
            raise RuntimeError(f"tensor-parallel worker: unknown command {cmd}")


def _shutdown_if_alive(ref: weakref.ref) -> None:
    executor = ref()
    if executor is not None:
        executor.shutdown()


class MultiprocExecutor:
    """Rank 0 in this process, ranks ``1 .. tp_size-1`` in worker processes.

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
    """

    def __init__(self, model: str, dtype: torch.dtype, device: str | torch.device,
                 tp_size: int, timeout_s: float | None = None,
                 components: backend.Components | backend.BackendSpec | None = None,
                 quantization: str | None = None) -> None:
        from minivllm.engine.worker import Worker

        if not isinstance(tp_size, int) or tp_size < 1:
            raise ValueError(f"tp_size must be an int >= 1, got {tp_size!r}")
        components = backend.as_components(components)
        if simulates_all_ranks(components):
            raise ValueError(
                f"the selected linear layers ({components.linear.__name__}) simulate every "
                "rank in one process; use UniProcExecutor, or the fast linear backend for real "
                "worker processes"
            )
        check_model_tp_size(model, tp_size)  # before spawning anything
        self.tp_size = tp_size
        self.devices = rank_devices(device, tp_size)
        self.timeout_s = float(timeout_s or os.environ.get("MINIVLLM_TP_TIMEOUT_S", 60))
        self.procs: list[Any] = []
        self._closed = False
        self._failure: str | None = None
        self._ready_ranks: set[int] = set()
        self._old_threads = torch.get_num_threads()
        threads = max(1, _num_cpus() // tp_size)
        dist_backend = "nccl" if self.devices[0].type == "cuda" else "gloo"
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        ctx = mp.get_context("spawn")
        self._ready = ctx.Queue()
        # atexit holds only a weak reference, so that dropping the executor runs __del__.
        self._atexit = functools.partial(_shutdown_if_alive, weakref.ref(self))
        atexit.register(self._atexit)
        try:
            for rank in range(1, tp_size):
                p = ctx.Process(
                    target=_worker_main, name=f"minivllm-tp-worker-{rank}", daemon=True,
                    args=(rank, tp_size, init_method, dist_backend, model, dtype,
                          self.devices[rank], components, self.timeout_s,
                          os.getpid(), self._ready, threads, quantization),
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
                                 quantization)
            self._wait_until_ready()
        except BaseException:
            self.shutdown()
            raise
        self.tokenizer, self.hf_config = self.worker.tokenizer, self.worker.hf_config

    # -- liveness -------------------------------------------------------------

    def _dead_workers(self) -> list[str]:
        return [f"tensor-parallel worker {rank} died (exitcode {p.exitcode})"
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
                distributed.init_distributed(0, self.tp_size, init_method, dist_backend,
                                             self.timeout_s)
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
            self._failure = f"tensor-parallel worker {rank} failed to start:\n{err}"
            raise RuntimeError(self._failure)
        self._ready_ranks.add(rank)

    def _wait_until_ready(self) -> None:
        while len(self._ready_ranks) < self.tp_size - 1:
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
            self._failure = "; ".join(dead) if dead else f"tensor-parallel step failed: {e}"
            raise RuntimeError(self._failure) from e

    def _send_header(self, *values: int) -> None:
        import torch.distributed as dist

        dist.broadcast(make_header(*values), src=0, group=distributed.get_control_group())

    # -- the executor API -----------------------------------------------------

    def bytes_per_block(self, block_size: int) -> int:
        """KV-cache bytes per block on one rank (the max over ranks; they are equal)."""
        import torch.distributed as dist

        def step() -> int:
            self._send_header(CMD_BYTES_PER_BLOCK, block_size)
            nbytes = torch.tensor([self.worker.bytes_per_block(block_size)], dtype=torch.int64)
            dist.all_reduce(nbytes, op=dist.ReduceOp.MAX, group=distributed.get_cpu_group())
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

    def execute_model(self, step_input: StepInput) -> torch.Tensor | None:
        """Broadcast ``step_input``; every rank updates its block table and runs the forward.

        Returns the logits (rank 0's), or None for a step without tokens.
        """
        import torch.distributed as dist

        self.check_health()
        try:
            # Rank 0 first: a change its table refuses is never sent to the others.
            model_input = self.worker.prepare_model_input(step_input)
        except ValueError as e:
            self._failure = f"tensor-parallel step refused, the ranks' block tables may differ: {e}"
            raise
        header, payload = pack_step_input(step_input)

        def step() -> torch.Tensor | None:
            dist.broadcast(header, src=0, group=distributed.get_control_group())
            dist.broadcast(payload, src=0, group=distributed.get_cpu_group())
            if step_input.num_tokens == 0:
                return None
            return self.worker.run_model(model_input)

        return self._run(step)

    def shutdown(self) -> None:
        """Stop the workers (politely, then by force) and leave the process group."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self._atexit)
        if self._failure is None and self.procs and not self._dead_workers():
            try:
                self._send_header(CMD_SHUTDOWN)
            except Exception:
                pass  # they are stopped below either way
        for p in self.procs:
            p.join(timeout=5)
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
