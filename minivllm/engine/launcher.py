"""Who starts the ranks: the one rule that picks ``distributed_executor_backend``.

Three ways to run an engine's ranks, named as vLLM names them:

- ``"uni"``: one process. Tensor parallelism above 1 only with linear
  layers that simulate every rank (the ref twin).
- ``"mp"``: this process is rank 0 and *spawns* the other ranks on this
  machine (:class:`~minivllm.engine.multiproc_executor.MultiprocExecutor`).
- ``"external_launcher"``: a launcher that already exists (``torchrun``,
  Slurm's ``srun``, ``mpirun``) started every rank, on one machine or many,
  and told each one who it is through the environment (``RANK``,
  ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``). Rank 0
  runs the engine; every other rank runs a worker
  (:mod:`minivllm.engine.external_launcher`).

``None`` (the default) chooses: ``"external_launcher"`` when the process was
started by such a launcher with ``WORLD_SIZE`` equal to the engine's ranks,
``"uni"`` for one rank or simulated ranks, else ``"mp"``. The launcher is
detected rather than required as a flag because under ``torchrun`` the
other reading, every process building its own engine and spawning its own
workers, is never what was meant; an explicit ``"mp"`` or ``"uni"`` still
gets exactly that. :func:`choose_executor_backend` is the rule, and
:func:`~minivllm.engine.executor.make_executor` calls it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

#: The values ``distributed_executor_backend`` takes (None: choose, see the module docstring).
EXECUTOR_BACKENDS = ("uni", "mp", "external_launcher")


def check_executor_backend(value: object) -> None:
    """Refuse a ``distributed_executor_backend`` that is not None or one of :data:`EXECUTOR_BACKENDS`."""
    if value is not None and value not in EXECUTOR_BACKENDS:
        raise ValueError(f"distributed_executor_backend must be None (choose) or one of "
                         f"{list(EXECUTOR_BACKENDS)}, got {value!r}")


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


def choose_executor_backend(requested: str | None, num_ranks: int, simulated: bool,
                            environ: Mapping[str, str] | None = None) -> str:
    """The executor backend for an engine of ``num_ranks`` ranks (tp x pp).

    Args:
        requested: ``distributed_executor_backend`` as configured (None: choose).
        num_ranks: the ranks the engine needs, ``tensor_parallel_size x
            pipeline_parallel_size``.
        simulated: whether the linear layers compute every rank in one
            process (:func:`~minivllm.engine.ranks.simulates_all_ranks`).
        environ: the environment to read (default ``os.environ``).

    A launched ``WORLD_SIZE`` that differs from ``num_ranks`` is refused
    (``ValueError``) unless ``"mp"`` or ``"uni"`` was asked for by name.
    """
    check_executor_backend(requested)
    world = launched_world_size(environ)
    if requested is None:
        if world > 1:
            requested = "external_launcher"
        else:
            requested = "uni" if num_ranks == 1 or simulated else "mp"
    if requested != "external_launcher":
        return requested
    if world != num_ranks:
        raise ValueError(
            f"distributed_executor_backend='external_launcher' needs WORLD_SIZE (the launcher's "
            f"processes, here {world}) = tensor_parallel_size x pipeline_parallel_size = "
            f"{num_ranks}; start it as e.g. `torchrun --nproc-per-node {num_ranks} ...`, or "
            f"pass distributed_executor_backend='mp' to spawn the ranks from one process")
    if num_ranks > 1 and simulated:
        raise ValueError(
            "distributed_executor_backend='external_launcher' needs linear layers that hold "
            "one rank's shards (the fast backend's); the selected ones simulate every rank "
            "in one process")
    return "uni" if num_ranks == 1 else "external_launcher"
