"""The tensor-parallel process group and its collectives (vLLM's ``parallel_state``, minimal).

One process per rank calls :func:`init_distributed` once; from then on the
layers of :mod:`minivllm.fast.linear` ask :func:`get_tp_rank` which shard is
theirs and communicate through the ``tensor_model_parallel_*`` functions.
Before :func:`init_distributed` (and with ``tp_size=1``) the process is rank 0
of a group of 1 and every collective is the identity.

Three groups, all over the same ranks:

- the *device group* (the default group): ``nccl`` on CUDA, ``gloo`` on CPU;
  carries the model's collectives (two all-reduces per layer, one all-gather
  of the logits). Created with a short ``timeout`` so that a dead peer makes a
  collective raise instead of hanging forever.
- the *CPU group* (gloo, same short timeout): host-side metadata, such as the
  packed :class:`~minivllm.metadata.ModelInput` rank 0 broadcasts each step.
  On CPU it is the device group itself.
- the *control group* (gloo, a long timeout): worker processes wait here for
  the next command between steps, for as long as the engine stays idle.

The state is module-level, as in vLLM: one process belongs to one
tensor-parallel group.

Pipeline parallelism (``pp_size = world_size / tp_size`` stages) adds one
tensor-parallel group *per stage* (tp ranks inner, as in vLLM: process
``rank = pp_rank * tp_size + tp_rank``) and two world-wide gloo groups for
what crosses stages: the *world CPU group* (short timeout: the step message
forwarded stage to stage, the KV size every rank reports) and the *world
control group* (long timeout: a later stage's worker waits there for the
next header from the stage before it). The hidden states themselves go
point to point (``send``/``recv``) on the world device group: gloo on a CPU,
NCCL on CUDA. With one stage the tensor-parallel groups are the world, as
before.

Collective timing: a :class:`CollectiveStats` passed to :func:`init_distributed`
(``MultiprocExecutor(..., collective_stats=stats)``) gets the wall time of
every collective this process runs (synchronising the device first, on CUDA);
``python -m minivllm.bench tp`` reads rank 0's. Without one nothing is timed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

_TP_RANK = 0
_TP_SIZE = 1
_PP_RANK = 0
_PP_SIZE = 1
_TP_GROUP: dist.ProcessGroup | None = None  # None: the world (one stage)
_CPU_GROUP: dist.ProcessGroup | None = None
_CONTROL_GROUP: dist.ProcessGroup | None = None
_WORLD_CPU_GROUP: dist.ProcessGroup | None = None
_WORLD_CONTROL_GROUP: dist.ProcessGroup | None = None
_STATS: CollectiveStats | None = None  # given by init_distributed: what to time into

#: How long an idle worker waits for the next command (see the module docstring).
CONTROL_TIMEOUT_S = 7 * 24 * 3600.0


def init_distributed(rank: int, world_size: int, init_method: str, backend: str = "gloo",
                     timeout_s: float = 60.0, tp_size: int | None = None,
                     collective_stats: CollectiveStats | None = None) -> None:
    """Join the group as ``rank`` of ``world_size`` (``tp_size`` ranks per pipeline stage).

    Args:
        rank: this process's rank, in ``[0, world_size)``.
        world_size: number of ranks (= ``tp_size * pp_size``).
        init_method: the rendezvous, e.g. ``"tcp://127.0.0.1:29500"``.
        backend: ``"gloo"`` (CPU) or ``"nccl"`` (CUDA).
        timeout_s: how long a collective may wait for a peer before raising.
        tp_size: ranks per tensor-parallel group (default ``world_size``: one stage).
        collective_stats: where this process's collectives add their wall time
            while it is in the group (None: they are not timed).
    """
    global _TP_RANK, _TP_SIZE, _PP_RANK, _PP_SIZE, _TP_GROUP, _CPU_GROUP, _CONTROL_GROUP
    global _WORLD_CPU_GROUP, _WORLD_CONTROL_GROUP, _STATS
    tp_size = world_size if tp_size is None else tp_size
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    if tp_size < 1 or world_size % tp_size:
        raise ValueError(f"tp_size must divide world_size={world_size}, got {tp_size}")
    if dist.is_initialized():
        raise RuntimeError("init_distributed: this process already joined a group")
    timeout = timedelta(seconds=timeout_s)
    long_timeout = timedelta(seconds=CONTROL_TIMEOUT_S)
    dist.init_process_group(backend, init_method=init_method, rank=rank,
                            world_size=world_size, timeout=timeout)
    ranks = list(range(world_size))
    world_cpu = (dist.group.WORLD if backend == "gloo"
                 else dist.new_group(ranks, timeout=timeout, backend="gloo"))
    world_control = dist.new_group(ranks, timeout=long_timeout, backend="gloo")
    pp_size = world_size // tp_size
    if pp_size == 1:  # one stage: its tensor-parallel group is the world
        tp_group, cpu_group, control_group = None, world_cpu, world_control
    else:
        # Every process creates every stage's groups, in the same order (torch's rule).
        for stage in range(pp_size):
            members = [stage * tp_size + t for t in range(tp_size)]
            device_g = dist.new_group(members, timeout=timeout, backend=backend)
            cpu_g = (device_g if backend == "gloo"
                     else dist.new_group(members, timeout=timeout, backend="gloo"))
            control_g = dist.new_group(members, timeout=long_timeout, backend="gloo")
            if rank in members:
                tp_group, cpu_group, control_group = device_g, cpu_g, control_g
    _TP_GROUP, _CPU_GROUP, _CONTROL_GROUP = tp_group, cpu_group, control_group
    _WORLD_CPU_GROUP, _WORLD_CONTROL_GROUP = world_cpu, world_control
    _PP_RANK, _TP_RANK = divmod(rank, tp_size)
    _PP_SIZE, _TP_SIZE = pp_size, tp_size
    _STATS = collective_stats


def destroy_distributed() -> None:
    """Leave the group (safe to call twice, or after a peer died)."""
    global _TP_RANK, _TP_SIZE, _PP_RANK, _PP_SIZE, _TP_GROUP, _CPU_GROUP, _CONTROL_GROUP
    global _WORLD_CPU_GROUP, _WORLD_CONTROL_GROUP, _STATS
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # a broken group (dead peer) may fail to tear down cleanly
            pass
    _TP_RANK, _TP_SIZE, _PP_RANK, _PP_SIZE = 0, 1, 0, 1
    _TP_GROUP = _CPU_GROUP = _CONTROL_GROUP = _WORLD_CPU_GROUP = _WORLD_CONTROL_GROUP = None
    _STATS = None


def is_initialized() -> bool:
    """True between :func:`init_distributed` and :func:`destroy_distributed`."""
    return dist.is_initialized()


def get_tp_rank() -> int:
    """This process's rank in the tensor-parallel group (0 before init)."""
    return _TP_RANK


def get_tp_size() -> int:
    """The tensor-parallel world size (1 before init)."""
    return _TP_SIZE


def get_pp_rank() -> int:
    """This process's pipeline stage (0 before init)."""
    return _PP_RANK


def get_pp_size() -> int:
    """The number of pipeline stages (1 before init)."""
    return _PP_SIZE


def get_tp_group() -> dist.ProcessGroup | None:
    """This stage's tensor-parallel device group (None: the world, with one stage)."""
    return _TP_GROUP


def get_cpu_group() -> dist.ProcessGroup | None:
    """This stage's gloo group for host-side tensors (short timeout)."""
    return _CPU_GROUP


def get_control_group() -> dist.ProcessGroup | None:
    """This stage's gloo group its idle workers wait on (long timeout)."""
    return _CONTROL_GROUP


def get_world_cpu_group() -> dist.ProcessGroup | None:
    """The gloo group over every rank of every stage (short timeout)."""
    return _WORLD_CPU_GROUP


def get_world_control_group() -> dist.ProcessGroup | None:
    """The gloo group over every rank, with the long timeout (the idle wait between stages)."""
    return _WORLD_CONTROL_GROUP


# --------------------------------------------------------------------------
# Timing
# --------------------------------------------------------------------------


@dataclass
class CollectiveStats:
    """Wall time spent in collectives: give one to :func:`init_distributed` to record it."""

    calls: int = 0
    seconds: float = 0.0
    bytes: int = 0

    def reset(self) -> None:
        """Zero the counters."""
        self.calls, self.seconds, self.bytes = 0, 0.0, 0


def _timed(fn, x: torch.Tensor):  # noqa: ANN001, ANN202  (a tiny wrapper)
    stats = _STATS
    if stats is None:
        return fn()
    if x.is_cuda:
        torch.cuda.synchronize(x.device)  # do not bill the collective for earlier kernels
    start = time.perf_counter()
    out = fn()
    if x.is_cuda:
        torch.cuda.synchronize(x.device)
    stats.calls += 1
    stats.seconds += time.perf_counter() - start
    stats.bytes += x.numel() * x.element_size()
    return out


# --------------------------------------------------------------------------
# Collectives (the identity with one rank)
# --------------------------------------------------------------------------


def _require_group() -> None:
    if not dist.is_initialized():
        raise RuntimeError(
            f"tensor parallelism with tp_size={_TP_SIZE} needs init_distributed() in every rank "
            "(minivllm.executor.multiproc_executor.MultiprocExecutor does it)"
        )


def tensor_model_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum ``x`` over all ranks; every rank gets the sum (in place; returns ``x``)."""
    if _TP_SIZE == 1:
        return x
    _require_group()
    return _timed(lambda: (dist.all_reduce(x, group=_TP_GROUP), x)[1], x)


def tensor_model_parallel_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim``, in rank order, on every rank."""
    if _TP_SIZE == 1:
        return x
    _require_group()
    x = x.contiguous()

    def gather() -> torch.Tensor:
        parts = [torch.empty_like(x) for _ in range(_TP_SIZE)]
        dist.all_gather(parts, x, group=_TP_GROUP)
        return torch.cat(parts, dim=dim)

    return _timed(gather, x)
