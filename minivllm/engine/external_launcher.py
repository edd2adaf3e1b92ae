"""Ranks that a launcher started (``torchrun``, ``srun``, ``mpirun``), on one machine or many.

``distributed_executor_backend="external_launcher"`` (chosen by itself under
``torchrun``, see :mod:`minivllm.engine.launcher`). Every process runs the
same command, say ``torchrun --nnodes 2 --nproc-per-node 1 ... -m minivllm
serve --tensor-parallel-size 2``, and builds the same ``LLM``. Inside it,
:func:`start_external_launcher` reads the process's place from the
environment and splits the roles:

- **rank 0** gets an :class:`ExternalLauncherExecutor` and goes on to run
  the engine (``LLM.generate``, ``minivllm generate``, ``minivllm serve``);
- **every other rank** never returns from ``LLM(...)``: it joins the group,
  loads its shards (its tensor-parallel slice of its pipeline stage's
  layers), serves rank 0's commands (the same loop as a spawned
  worker, :func:`~minivllm.engine.multiproc_executor._serve`) and, when rank
  0 shuts the engine down, exits the process with status 0. So the code
  after ``LLM(...)`` in a script runs on rank 0 only, and no rank but 0
  schedules, samples or binds a port.

This differs from vLLM's ``external_launcher``, where every rank runs a
whole engine and the ranks agree because scheduling is deterministic: here
the step message (:mod:`minivllm.engine.wire`) carries rank 0's decisions
to the others, exactly as with spawned workers, so ``minivllm serve`` (one
server, requests arriving at any time) works across machines too.

The rendezvous is ``env://`` (``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``,
``WORLD_SIZE``). Rank ``r`` uses ``cuda:LOCAL_RANK`` (after the index the
``device`` names) with NCCL, or the CPU with gloo and ``cores /
LOCAL_WORLD_SIZE`` threads. The network interface is gloo's and NCCL's own
choice: ``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME`` pick it (see
docs/tensor_parallel.md).

Failures: rank 0 cannot watch processes it did not start, so a rank that
dies shows up as a broken collective (the peer's socket closes, or the
``timeout_s`` passes) and every later step raises ``RuntimeError``. A
worker whose rank 0 vanished gets the same broken collective while it
waits, prints why and exits with status 1; one whose parent (the
launcher's agent) vanished exits too. Under ``torchrun`` the agent also
stops the remaining ranks once one has failed.
"""

from __future__ import annotations

import atexit
import functools
import os
import signal
import sys
import threading
import traceback
import weakref
from collections.abc import Mapping
from typing import Any, NoReturn

import torch

from minivllm import backend, distributed
from minivllm.engine.launcher import LauncherEnv, read_launcher_env
from minivllm.engine.multiproc_executor import (
    MultiprocExecutor,
    PendingStep,
    _exit_if_orphaned,
    _num_cpus,
    _serve,
    _shutdown_if_alive,
)
from minivllm.engine.ranks import check_model_parallel_sizes, rank_devices
from minivllm.engine.stage_link import StageLink
from minivllm.engine.wire import CMD_SHUTDOWN
from minivllm.pp_stages import StageTiming, rank_coords


def _enter_rank(env: LauncherEnv, device: str | torch.device) -> tuple[torch.device, str, int]:
    """This rank's device, its process-group backend, and the torch threads it may use."""
    dev = rank_devices(device, env.local_world_size)[env.local_rank]
    threads = max(1, _num_cpus() // env.local_world_size)  # the ranks on this machine share it
    if dev.type == "cpu":
        torch.set_num_threads(threads)
        return dev, "gloo", threads
    torch.cuda.set_device(dev)  # NCCL uses the current device
    return dev, "nccl", threads


def start_external_launcher(model: str, dtype: torch.dtype, device: str | torch.device,
                            tp_size: int, components: backend.Components,
                            quantization: str | None = None, timeout_s: float | None = None,
                            environ: Mapping[str, str] | None = None, pp_size: int = 1,
                            pp_layer_partition: Any = None) -> ExternalLauncherExecutor:
    """Rank 0: the executor. Any other rank: run the worker, then exit (never returns).

    The ranks are laid out as with spawned workers, tensor-parallel inner:
    process ``rank = pp_rank * tp_size + tp_rank``, so a job of
    ``--nproc-per-node tp`` on ``pp`` nodes keeps each stage's all-reduces
    inside one node and sends only the activations between nodes.
    """
    env = read_launcher_env(environ)
    # Every rank refuses a bad size (or partition) the same way, before loading anything.
    check_model_parallel_sizes(model, tp_size, pp_size, pp_layer_partition)
    timeout = float(timeout_s or os.environ.get("MINIVLLM_TP_TIMEOUT_S", 60))
    sizes = (tp_size, pp_size, pp_layer_partition)
    if env.rank != 0:
        run_worker_rank(env, model, dtype, device, sizes, components, timeout, quantization)
    return ExternalLauncherExecutor(env, model, dtype, device, tp_size, timeout, components,
                                    quantization, pp_size, pp_layer_partition)


def run_worker_rank(env: LauncherEnv, model: str, dtype: torch.dtype,
                    device: str | torch.device, sizes: tuple[int, int, Any],
                    components: backend.Components, timeout_s: float,
                    quantization: str | None = None) -> NoReturn:
    """Rank ``env.rank`` (not 0): join, load this rank's shards, serve rank 0, then exit.

    ``sizes`` is ``(tp_size, pp_size, pp_layer_partition)``.

    Raises ``SystemExit``: status 0 after rank 0's shutdown command, 1 if
    starting failed or rank 0 went away.
    """
    from minivllm.engine.worker import Worker

    if threading.current_thread() is threading.main_thread():
        # Ctrl-C reaches every rank of a terminal's launcher; rank 0 handles it and then
        # sends the shutdown command.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_exit_if_orphaned, args=(os.getppid(),), daemon=True).start()
    tp_size, pp_size, partition = sizes
    dev, dist_backend, _ = _enter_rank(env, device)
    try:
        distributed.init_distributed(env.rank, env.world_size, "env://", dist_backend, timeout_s,
                                     tp_size=tp_size)
        pp_rank, _ = rank_coords(env.rank, tp_size)
        worker = Worker(model, dtype, dev, tp_size, components, quantization, pp_rank=pp_rank,
                        pp_size=pp_size, pp_layer_partition=partition)
        link = StageLink(env.rank, tp_size, pp_size, worker.hf_config.hidden_size, dtype, dev)
    except Exception:
        print(f"minivllm: rank {env.rank} failed to start:\n{traceback.format_exc()}",
              file=sys.stderr, flush=True)
        distributed.destroy_distributed()
        raise SystemExit(1) from None
    try:
        _serve(worker, link)
    except Exception as e:  # a broken collective: rank 0 (or another rank) went away
        print(f"minivllm: rank {env.rank} lost the group (rank 0 or another rank died "
              f"or left without shutting the engine down): {e}", file=sys.stderr, flush=True)
        distributed.destroy_distributed()
        raise SystemExit(1) from None
    distributed.destroy_distributed()
    raise SystemExit(0)


class ExternalLauncherExecutor(MultiprocExecutor):
    """Rank 0 of ranks that a launcher started: a :class:`MultiprocExecutor` that spawns nothing.

    The step protocol (the header and payload broadcasts, the KV-cache
    commands) is the parent's, unchanged; what differs is only where the
    other ranks come from and how their failure is seen (see the module
    docstring). Build it with :func:`start_external_launcher`.
    """

    def __init__(self, env: LauncherEnv, model: str, dtype: torch.dtype,
                 device: str | torch.device, tp_size: int, timeout_s: float,
                 components: backend.Components | backend.BackendSpec | None = None,
                 quantization: str | None = None, pp_size: int = 1,
                 pp_layer_partition: Any = None) -> None:
        # Not MultiprocExecutor.__init__: there is nothing to spawn or to wait for.
        from minivllm.engine.worker import Worker

        if env.rank != 0:
            raise ValueError(f"ExternalLauncherExecutor runs on rank 0, got rank {env.rank}")
        components = backend.as_components(components)
        self.env = env
        self.tp_size, self.pp_size = tp_size, pp_size
        self.max_concurrent_batches = pp_size  # as MultiprocExecutor: one per stage
        self.timeout_s = timeout_s
        self.procs: list[Any] = []  # none of ours: the launcher owns the processes
        self._closed = False
        self._failure: str | None = None
        self._old_threads = torch.get_num_threads()
        self._pending: list[PendingStep] = []
        self._num_batches = 0
        self._timeline: list[StageTiming] = []
        self._atexit = functools.partial(_shutdown_if_alive, weakref.ref(self))
        atexit.register(self._atexit)
        try:
            dev, dist_backend, _ = _enter_rank(env, device)
            self.devices = [dev]
            distributed.init_distributed(0, env.world_size, "env://", dist_backend, timeout_s,
                                         tp_size=tp_size)
            self.worker = Worker(model, dtype, dev, tp_size, components, quantization,
                                 pp_rank=0, pp_size=pp_size,
                                 pp_layer_partition=pp_layer_partition)
            self.link = StageLink(0, tp_size, pp_size, self.worker.hf_config.hidden_size,
                                  dtype, dev)
        except BaseException:
            self.shutdown()
            raise
        self.tokenizer, self.hf_config = self.worker.tokenizer, self.worker.hf_config

    def _run(self, fn: Any) -> Any:
        """One collective step; a broken group becomes a ``RuntimeError`` (and stays one)."""
        self.check_health()
        try:
            return fn()
        except Exception as e:
            self._failure = (
                f"a rank of the launched group ({self.env.world_size} ranks) died or left: {e} "
                "(rank 0 did not start the others and cannot see their exit codes: see their "
                "logs)")
            raise RuntimeError(self._failure) from e

    def shutdown(self) -> None:
        """Tell the other ranks to exit (unless the group is broken) and leave it."""
        if self._closed:
            return
        atexit.unregister(self._atexit)
        if self._failure is None and distributed.is_initialized() and hasattr(self, "link"):
            try:
                while self._pending:  # the last stage's logits must be received first
                    self._collect_oldest()
                self._send_header(CMD_SHUTDOWN)
                self.link.wait_sends()
            except Exception:
                pass  # a peer that is gone already needs no telling
        self._closed = True  # only now: collecting the last logits runs checked steps
        distributed.destroy_distributed()
        torch.set_num_threads(self._old_threads)
