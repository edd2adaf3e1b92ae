"""How the ranks of a :class:`~minivllm.executor.multiproc_executor.MultiprocExecutor` come to exist.

One executor class runs rank 0 and talks to the others; how those others
start, and how their failure is seen, is a strategy:

- :class:`SpawnedRanks` (``distributed_executor_backend="mp"``): this process
  is rank 0 and *spawns* ranks ``1 .. N-1`` on this machine
  (``multiprocessing`` ``spawn``) and watches them from a thread: the first
  rank that dies is named, with its pid and its exit signal or status, and
  every other rank is killed at once (as vLLM's executor does), so that no
  rank waits on a dead one and rank 0's next (or current) collective fails
  within seconds.
- :class:`LaunchedRanks` (``"external_launcher"``): a launcher that already
  exists (``torchrun``, Slurm's ``srun``, ``mpirun``) started every rank, on
  one machine or many, and told each who it is through the environment
  (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``;
  :func:`read_launcher_env`). Rank 0 runs the engine; every other rank runs
  :func:`run_launched_rank` inside ``LLM(...)`` and never returns from it: it
  serves rank 0 and exits when rank 0 shuts down. Rank 0 cannot watch
  processes it did not start, so a rank that dies shows up as a broken
  collective.

Either way the other ranks run :func:`minivllm.worker.worker.serve`, and every
call reaches them in the same message (:mod:`minivllm.executor.wire`). Unlike
vLLM's ``external_launcher`` (every rank a whole engine, agreeing because
scheduling is deterministic), rank 0's decisions travel to the others, so
``minivllm serve`` (requests arriving at any time) works across machines too.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import multiprocessing.connection as mp_connection
import os
import queue
import signal
import socket
import sys
import threading
import time
import traceback
import types
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, NoReturn

import torch

from minivllm import distributed
from minivllm.engine.config import WorkerConfig
from minivllm.executor.ranks import num_cpus, rank_devices
from minivllm.executor.stage_link import StageLink
from minivllm.pp_stages import rank_coords
from minivllm.worker.worker import Worker, serve


def describe_rank(rank: int, tp_size: int, pp_size: int) -> str:
    """``"tensor-parallel rank 1"`` or ``"pipeline-parallel rank 3 (stage 1, tp rank 1)"``."""
    if pp_size == 1:
        return f"tensor-parallel rank {rank}"
    pp_rank, tp_rank = rank_coords(rank, tp_size)
    return f"pipeline-parallel rank {rank} (stage {pp_rank}, tp rank {tp_rank})"


def describe_exit(exitcode: int | None) -> str:
    """``"killed by SIGKILL"`` for a negative exit code, ``"exited with status 1"`` else."""
    if exitcode is None or exitcode >= 0:
        return f"exited with status {exitcode}"
    names = {s.value: s.name for s in signal.Signals}
    return f"killed by {names.get(-exitcode, f'signal {-exitcode}')}"


def exit_if_orphaned(parent_pid: int) -> None:
    """Watchdog thread body: exit this worker as soon as its parent is gone."""
    while True:
        time.sleep(0.5)
        if os.getppid() != parent_pid:
            os._exit(1)


def _enter(device: torch.device, ranks_here: int) -> tuple[str, int]:
    """Set this process up as a rank on ``device``: its group backend and its torch threads.

    The ``ranks_here`` ranks on this machine share its cores.
    """
    threads = max(1, num_cpus() // ranks_here)
    if device.type == "cpu":
        torch.set_num_threads(threads)
        return "gloo", threads
    torch.cuda.set_device(device)  # NCCL uses the current device
    return "nccl", threads


@dataclass(frozen=True)
class RankZero:
    """What a strategy tells rank 0: where it runs and how the group meets."""

    device: torch.device
    init_method: str
    dist_backend: str


# ----------------------------------------------------------------------------- spawned


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


def _spawned_rank_main(rank: int, init_method: str, dist_backend: str, config: WorkerConfig,
                       device: torch.device, components: Any, parent_pid: int,
                       ready: Any) -> None:
    """Entry point of spawned rank ``rank``: join the group, load the model, serve calls."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the engine process's business
    threading.Thread(target=exit_if_orphaned, args=(parent_pid,), daemon=True).start()
    _enter(device, config.num_ranks)
    pp_rank, _ = rank_coords(rank, config.tensor_parallel_size)
    try:
        distributed.init_distributed(rank, config.num_ranks, init_method, dist_backend,
                                     config.timeout_s, tp_size=config.tensor_parallel_size)
        # `components` arrived pickled as the engine's decided choices and was
        # rebuilt from them: the engine's record, not this process's default.
        worker = Worker(config, components, pp_rank=pp_rank, device=device)
        worker.link = StageLink(rank, config.tensor_parallel_size, config.pipeline_parallel_size,
                                worker.hf_config.hidden_size, config.dtype, device)
    except BaseException:
        ready.put(("error", rank, traceback.format_exc()))
        raise
    ready.put(("ready", rank, None))
    serve(worker)
    distributed.destroy_distributed()


def build_cpu_ops_first(device: torch.device, components: Any) -> bool:
    """Build (or load) the C++ CPU ops here, before any rank is spawned, if a fast twin
    may call them: a first build takes a minute or two, and ranks that each waited on
    the build lock meanwhile would miss their rendezvous. Returns True if it built or
    loaded them (the children then load the cached library)."""
    if device.type != "cpu" or "fast" not in components.impls.values():
        return False
    from minivllm.fast import cpu_ops

    return cpu_ops.available()  # a build that fails says why in each rank, as without spawning


class SpawnedRanks:
    """``"mp"``: this process spawns ranks ``1 .. N-1`` and watches them (see the module docstring)."""

    def __init__(self) -> None:
        self.procs: list[Any] = []
        self.init_method = ""  # where the group meets (tcp://127.0.0.1:port)
        self._config: WorkerConfig | None = None
        self._ready, self._ready_ranks = None, set()
        self._first_death: str | None = None  # set once, by the watch thread
        self._expect_exit = threading.Event()  # set: exits from now on are the shutdown's
        self._settled = threading.Event()  # set: the watch thread is done (it stopped the rest)

    def start(self, config: WorkerConfig, components: Any) -> RankZero:
        """Spawn every rank but 0 (they join the group and load their shards meanwhile)."""
        self._config = config
        devices = rank_devices(config.device, config.num_ranks)
        dist_backend = "nccl" if devices[0].type == "cuda" else "gloo"
        init_method = self.init_method = f"tcp://127.0.0.1:{_free_port()}"
        build_cpu_ops_first(devices[0], components)
        ctx = mp.get_context("spawn")
        self._ready = ctx.Queue()
        for rank in range(1, config.num_ranks):
            p = ctx.Process(
                target=_spawned_rank_main, name=f"minivllm-worker-{rank}", daemon=True,
                args=(rank, init_method, dist_backend, config, devices[rank], components,
                      os.getpid(), self._ready))
            with _main_module_hidden():
                p.start()
            self.procs.append(p)
        threading.Thread(target=self._watch, name="minivllm-rank-watch", daemon=True).start()
        _enter(devices[0], config.num_ranks)
        return RankZero(devices[0], init_method, dist_backend)

    def _describe(self, rank: int, proc: Any) -> str:
        config = self._config
        name = describe_rank(rank, config.tensor_parallel_size, config.pipeline_parallel_size)
        proc.join(timeout=5)  # dead: its exit code (a racing thread may see None a moment)
        deadline = time.monotonic() + 2.0
        while proc.exitcode is None and time.monotonic() < deadline:  # it is dead here
            time.sleep(0.01)
        return f"{name} (pid {proc.pid}) died: {describe_exit(proc.exitcode)}"

    def _watch(self) -> None:
        """Watch thread body: at the first rank that exits unasked, name it and kill the
        rest, which would otherwise wait on it for their group's timeout (rank 0's
        collectives with them fail as soon as their connections close)."""
        sentinels = {p.sentinel: (rank, p) for rank, p in enumerate(self.procs, start=1)}
        try:
            ready: list[Any] = []
            while not ready and not self._expect_exit.is_set():
                ready = mp_connection.wait(list(sentinels), timeout=0.2)
            if self._expect_exit.is_set():
                return
            rank, proc = sentinels[ready[0]]
            self._first_death = self._describe(rank, proc)  # named before the others die
            for other in self.procs:
                other.kill()  # a no-op for one that has exited
            for other in self.procs:
                other.join(timeout=5)  # reaped: no rank is left once the error is raised
        finally:
            self._settled.set()

    def expect_exit(self) -> None:
        """From now on the ranks exit because rank 0 asked them to: stop watching."""
        self._expect_exit.set()

    def join_group(self, join: Any, check_health: Any) -> None:
        """Run rank 0's rendezvous while watching the children: one that dies before
        joining would otherwise leave rank 0 waiting for the whole timeout."""
        error: list[BaseException] = []

        def target() -> None:
            try:
                join()
            except BaseException as e:  # handed to the main thread below
                error.append(e)

        thread = threading.Thread(target=target, daemon=True)
        thread.start()
        while thread.is_alive():
            thread.join(timeout=0.2)
            if thread.is_alive():
                self._poll_ready(block=False)
                check_health()
        if error:
            raise error[0]

    def _poll_ready(self, block: bool) -> None:
        """Take start-up messages off the queue; raise on a rank's error."""
        try:
            status, rank, err = self._ready.get(timeout=0.5) if block else self._ready.get_nowait()
        except queue.Empty:
            return
        if status == "error":
            config = self._config
            raise RuntimeError(f"{describe_rank(rank, config.tensor_parallel_size, config.pipeline_parallel_size)} "
                               f"failed to start:\n{err}")
        self._ready_ranks.add(rank)

    def wait_ready(self, check_health: Any) -> None:
        """Until every spawned rank has loaded its shards (or one failed)."""
        while len(self._ready_ranks) < len(self.procs):
            self._poll_ready(block=True)
            check_health()

    def dead_ranks(self) -> list[str]:
        """The rank that died first (the others were killed because of it), or every
        rank that has exited, each with its pid and exit signal or status."""
        if all(p.is_alive() for p in self.procs):
            return []
        if not self._expect_exit.is_set():  # the watch thread names it and stops the rest
            self._settled.wait(timeout=5)
        if self._first_death is not None:
            return [self._first_death]
        return [self._describe(r, p) for r, p in enumerate(self.procs, 1) if not p.is_alive()]

    def explain(self, error: Exception) -> str:
        """A collective failed: name the rank that died (giving the OS 5 s to report it)."""
        deadline = time.monotonic() + 5.0
        while not self.dead_ranks() and time.monotonic() < deadline:
            time.sleep(0.05)
        dead = self.dead_ranks()
        return "; ".join(dead) if dead else f"parallel step failed: {error}"

    def stop(self) -> None:
        """Wait for the ranks to exit (after the shutdown call); force the stragglers."""
        self.expect_exit()
        for p in self.procs:
            p.join(timeout=15)  # a loaded machine may take seconds to tear a rank down
            if p.is_alive():
                p.terminate()
                p.join(timeout=2)
            if p.is_alive():
                p.kill()
                p.join()


# ----------------------------------------------------------------------------- launched


@dataclass(frozen=True)
class LauncherEnv:
    """What a launcher tells one process: its place among all ranks and where to meet.

    ``rank`` / ``world_size`` count every rank on every machine;
    ``local_rank`` / ``local_world_size`` the ranks on this machine (they
    pick the GPU and share the CPU cores). The rendezvous is ``env://``:
    ``torch.distributed`` reads ``MASTER_ADDR`` and ``MASTER_PORT`` itself.
    """

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int


def _env_int(environ: Mapping[str, str], name: str, default: int | None = None) -> int:
    raw = environ.get(name)
    if raw is None:
        if default is None:
            raise ValueError(f"the external launcher did not set {name} (it sets RANK, "
                             f"WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT)")
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name} must be an int, got {raw!r}") from None


def launched_world_size(environ: Mapping[str, str] | None = None) -> int:
    """``WORLD_SIZE`` as a launcher set it, or 1 where none did."""
    return _env_int(os.environ if environ is None else environ, "WORLD_SIZE", 1)


def read_launcher_env(environ: Mapping[str, str] | None = None) -> LauncherEnv:
    """This process's :class:`LauncherEnv`, checked (``ValueError`` naming the variable)."""
    environ = os.environ if environ is None else environ
    world = _env_int(environ, "WORLD_SIZE")
    rank = _env_int(environ, "RANK")
    local_world = _env_int(environ, "LOCAL_WORLD_SIZE", world)
    local_rank = _env_int(environ, "LOCAL_RANK", rank % max(local_world, 1))
    addr = environ.get("MASTER_ADDR") or ""
    port = _env_int(environ, "MASTER_PORT")
    if world < 1:
        raise ValueError(f"WORLD_SIZE must be >= 1, got {world}")
    if not 0 <= rank < world:
        raise ValueError(f"RANK must be in [0, {world}) (WORLD_SIZE={world}), got {rank}")
    if not 1 <= local_world <= world:
        raise ValueError(f"LOCAL_WORLD_SIZE must be in [1, {world}], got {local_world}")
    if not 0 <= local_rank < local_world:
        raise ValueError(f"LOCAL_RANK must be in [0, {local_world}), got {local_rank}")
    if not addr:
        raise ValueError("the external launcher did not set MASTER_ADDR (rank 0's address)")
    if not 1 <= port <= 65535:
        raise ValueError(f"MASTER_PORT must be in [1, 65535], got {port}")
    return LauncherEnv(rank, world, local_rank, local_world, addr, port)


def _launched_device(env: LauncherEnv, device: torch.device) -> torch.device:
    """Rank ``env.rank``'s device: ``cuda:LOCAL_RANK`` after the index ``device`` names."""
    return rank_devices(device, env.local_world_size)[env.local_rank]


def run_launched_rank(env: LauncherEnv, config: WorkerConfig, components: Any) -> NoReturn:
    """Rank ``env.rank`` (not 0): join, load this rank's shards, serve rank 0, then exit.

    Raises ``SystemExit``: status 0 after rank 0's shutdown command, 1 if
    starting failed or rank 0 went away.
    """
    if threading.current_thread() is threading.main_thread():
        # Ctrl-C reaches every rank of a terminal's launcher; rank 0 handles it and then
        # sends the shutdown command.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=exit_if_orphaned, args=(os.getppid(),), daemon=True).start()
    device = _launched_device(env, config.device)
    dist_backend, _ = _enter(device, env.local_world_size)
    try:
        distributed.init_distributed(env.rank, env.world_size, "env://", dist_backend,
                                     config.timeout_s, tp_size=config.tensor_parallel_size)
        pp_rank, _ = rank_coords(env.rank, config.tensor_parallel_size)
        worker = Worker(config, components, pp_rank=pp_rank, device=device)
        worker.link = StageLink(env.rank, config.tensor_parallel_size,
                                config.pipeline_parallel_size, worker.hf_config.hidden_size,
                                config.dtype, device)
    except Exception:
        print(f"minivllm: rank {env.rank} failed to start:\n{traceback.format_exc()}",
              file=sys.stderr, flush=True)
        distributed.destroy_distributed()
        raise SystemExit(1) from None
    try:
        serve(worker)
    except Exception as e:  # a broken collective: rank 0 (or another rank) went away
        print(f"minivllm: rank {env.rank} lost the group (rank 0 or another rank died "
              f"or left without shutting the engine down): {e}", file=sys.stderr, flush=True)
        distributed.destroy_distributed()
        raise SystemExit(1) from None
    distributed.destroy_distributed()
    raise SystemExit(0)


class LaunchedRanks:
    """``"external_launcher"``: rank 0 of ranks a launcher started (see the module docstring).

    Args:
        env: rank 0's :class:`LauncherEnv` (:func:`read_launcher_env`).
    """

    def __init__(self, env: LauncherEnv) -> None:
        if env.rank != 0:
            raise ValueError(f"LaunchedRanks is rank 0's strategy, got rank {env.rank} "
                             "(the others run run_launched_rank)")
        self.env = env
        self.procs: list[Any] = []  # none of ours: the launcher owns the processes

    def start(self, config: WorkerConfig, components: Any) -> RankZero:
        """Nothing to start: place rank 0 on its device; the group meets at ``env://``."""
        device = _launched_device(self.env, config.device)
        dist_backend, _ = _enter(device, self.env.local_world_size)
        return RankZero(device, "env://", dist_backend)

    def join_group(self, join: Any, check_health: Any) -> None:
        """Rank 0's rendezvous (there is no child to watch)."""
        join()

    def wait_ready(self, check_health: Any) -> None:
        """The first collective waits for the other ranks; nothing to do here."""

    def expect_exit(self) -> None:
        """Nothing watched: the launcher owns the processes."""

    def dead_ranks(self) -> list[str]:
        """Never known: rank 0 did not start the others."""
        return []

    def explain(self, error: Exception) -> str:
        """A collective failed: some rank of the launched group is gone."""
        return (f"a rank of the launched group ({self.env.world_size} ranks) died or left: "
                f"{error} (rank 0 did not start the others and cannot see their exit codes: "
                "see their logs)")

    def stop(self) -> None:
        """Nothing to join: each launched rank exits by itself after the shutdown command."""
