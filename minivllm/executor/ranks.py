"""The rules every executor shares: which process computes which rank, on which device.

:func:`simulates_all_ranks` is the one rule that says whether the linear
layers play every rank in one process (read from the ``linear`` module the
engine's components actually hold); :func:`check_model_parallel_sizes`
refuses a size the model cannot split before anything is loaded;
:func:`rank_devices` places the ranks and :func:`num_cpus` shares the cores.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from minivllm import backend
from minivllm.pp_stages import check_pp_size, stage_layer_ranges
from minivllm.tp_shards import check_tp_size


def simulates_all_ranks(
    components: backend.Components | backend.BackendSpec | None = None,
) -> bool:
    """Whether the ``linear`` module ``components`` select computes every rank in one process.

    ``components``: an engine's :class:`~minivllm.backend.Components`, or a
    spec to resolve (None: the global one). Read from the module itself
    (``SIMULATES_ALL_RANKS``), not from the spec's name: a package without its
    own ``linear`` gets the ref's. A ``linear`` module that does not say
    raises ``ValueError``.
    """
    linear = backend.as_components(components).linear
    flag = getattr(linear, "SIMULATES_ALL_RANKS", None)
    if not isinstance(flag, bool):
        raise ValueError(
            f"linear module {linear.__name__} must set SIMULATES_ALL_RANKS = True (every rank "
            f"in one process, like minivllm.ref.linear) or False (one process per rank, like "
            f"minivllm.fast.linear), got {flag!r}"
        )
    return flag


def peek_hf_config(model: str) -> Any | None:
    """The model's HF config without loading weights (None for a ``.gguf`` file)."""
    from minivllm.model.loader import resolve_model_path

    path = resolve_model_path(model)
    if path.suffix == ".gguf":
        return None  # the config is inside the file; the layers check tp_size
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path, local_files_only=True)


def check_model_parallel_sizes(model: str, tp_size: int, pp_size: int = 1,
                               pp_layer_partition: Any = None) -> None:
    """THE size check: refuse a ``tp_size`` / ``pp_size`` (or a layer partition) that
    does not split ``model``, with the sizes that work, before loading anything.

    The layers are split by ``pp_layer_partition`` or else by the rule
    (:func:`minivllm.pp_stages.get_pp_indices`).
    """
    check_tp_size(tp_size)
    check_pp_size(pp_size)
    if tp_size == 1 and pp_size == 1 and pp_layer_partition is None:
        return  # every model runs on one rank
    hf_config = peek_hf_config(model)
    if hf_config is None:  # a .gguf file: its layers check tp_size while loading
        return
    if tp_size > 1:
        check_tp_size(tp_size, hf_config)
    stage_layer_ranges(hf_config.num_hidden_layers, pp_size, pp_layer_partition)


def rank_devices(device: str | torch.device, num_ranks: int) -> list[torch.device]:
    """One device per rank (``num_ranks`` = all ranks, tp x pp): all ``cpu``, or
    ``cuda:first .. cuda:first + num_ranks - 1``."""
    device = torch.device(device)
    if device.type == "cpu":
        return [device] * num_ranks
    if device.type != "cuda":
        raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {str(device)!r}")
    first, found = device.index or 0, torch.cuda.device_count()
    if first + num_ranks > found:
        raise ValueError(
            f"{num_ranks} ranks (tensor_parallel_size x pipeline_parallel_size) need GPUs "
            f"cuda:{first}..cuda:{first + num_ranks - 1}, but {found} are visible"
        )
    return [torch.device("cuda", first + r) for r in range(num_ranks)]


def num_cpus() -> int:
    """CPUs this process may run on (its affinity mask, where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1
