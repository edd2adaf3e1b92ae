"""Who runs the ranks: the one rule that picks the executor, and :func:`make_executor`.

Three ways to run an engine's ranks, named as vLLM names them
(``distributed_executor_backend``):

- ``"uni"``: one process (:class:`~minivllm.executor.uniproc_executor.UniProcExecutor`).
  Tensor parallelism above 1 only with linear layers that simulate every
  rank (the ref twin); pipeline stages are simulated one after another.
- ``"mp"``: this process is rank 0 and *spawns* the other ranks on this
  machine (:class:`~minivllm.executor.multiproc_executor.MultiprocExecutor` with
  :class:`~minivllm.executor.rank_starters.SpawnedRanks`).
- ``"external_launcher"``: a launcher that already exists (``torchrun``,
  Slurm's ``srun``, ``mpirun``) started every rank, on one machine or many
  (the same executor with :class:`~minivllm.executor.rank_starters.LaunchedRanks`;
  every rank but 0 serves rank 0 and never returns from ``LLM(...)``).

``None`` (the default) chooses: ``"external_launcher"`` when the process was
started by such a launcher with ``WORLD_SIZE`` equal to the engine's ranks,
``"uni"`` for one rank or simulated ranks, else ``"mp"``. The launcher is
detected rather than required as a flag because under ``torchrun`` the other
reading, every process building its own engine and spawning its own
workers, is never what was meant; an explicit ``"mp"`` or ``"uni"`` still
gets exactly that.
"""

from __future__ import annotations

from collections.abc import Mapping

from minivllm import backend
from minivllm.engine.config import WorkerConfig, check_executor_backend
from minivllm.executor.abstract import Executor
from minivllm.executor.multiproc_executor import MultiprocExecutor
from minivllm.executor.rank_starters import (
    LaunchedRanks,
    launched_world_size,
    read_launcher_env,
    run_launched_rank,
)
from minivllm.executor.ranks import check_model_parallel_sizes, simulates_all_ranks
from minivllm.executor.uniproc_executor import UniProcExecutor


def choose_executor_backend(requested: str | None, num_ranks: int, simulated: bool,
                            environ: Mapping[str, str] | None = None) -> str:
    """The executor backend for an engine of ``num_ranks`` ranks (tp x pp).

    Args:
        requested: ``distributed_executor_backend`` as configured (None: choose).
        num_ranks: the ranks the engine needs, ``tensor_parallel_size x
            pipeline_parallel_size``.
        simulated: whether the linear layers compute every rank in one
            process (:func:`~minivllm.executor.ranks.simulates_all_ranks`).
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


def make_executor(config: WorkerConfig,
                  components: backend.Components | backend.BackendSpec | None = None,
                  distributed_executor_backend: str | None = None,
                  environ: Mapping[str, str] | None = None) -> Executor:
    """The executor for ``config``'s ranks with ``components`` (a spec is resolved once).

    ``distributed_executor_backend`` None chooses (see the module docstring).
    Under a launcher, on every rank but 0 this never returns: the process
    serves rank 0 and then exits.
    """
    components = backend.as_components(components)
    kind = choose_executor_backend(distributed_executor_backend, config.num_ranks,
                                   simulates_all_ranks(components), environ)
    if kind == "uni":
        return UniProcExecutor(config, components)
    if kind == "mp":
        return MultiprocExecutor(config, components)
    env = read_launcher_env(environ)
    # Every rank refuses a bad size (or partition) the same way, before loading anything.
    check_model_parallel_sizes(config.model, config.tensor_parallel_size,
                               config.pipeline_parallel_size, config.pp_layer_partition)
    if env.rank != 0:
        run_launched_rank(env, config, components)
    return MultiprocExecutor(config, components, ranks=LaunchedRanks(env))
