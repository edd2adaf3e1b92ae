"""How a Hugging Face checkpoint's tensors find their way into our (fused) parameters.

A checkpoint names every projection separately (``q_proj``, ``k_proj``,
``v_proj``, ``gate_proj``, ``up_proj``); the model fuses q/k/v into one
``qkv_proj`` and gate/up into one ``gate_up_proj`` (one matmul each). So each
tensor is renamed to its fused parameter (:data:`STACKED_PARAMS_MAPPING`) and
handed, with its shard id, to that parameter's ``weight_loader``: the linear
layer (either ``linear`` twin) copies the piece to its place, and under tensor
parallelism only this rank's rows or columns. A parameter no tensor filled,
an unexpected name or a wrong shape is a ``ValueError`` naming it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

#: checkpoint name piece -> (our fused parameter's name piece, shard id)
STACKED_PARAMS_MAPPING = (
    (".qkv_proj.", ".q_proj.", "q"),
    (".qkv_proj.", ".k_proj.", "k"),
    (".qkv_proj.", ".v_proj.", "v"),
    (".gate_up_proj.", ".gate_proj.", 0),
    (".gate_up_proj.", ".up_proj.", 1),
)


def load_hf_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]],
                    skip: Callable[[str], bool]) -> set[str]:
    """Copy HF-named checkpoint tensors into ``model``'s parameters; return the names loaded.

    ``weights`` yields ``(name, tensor)`` pairs such as
    ``("model.layers.0.self_attn.q_proj.weight", W_q)``; the tensors may be of
    any dtype and are cast to each parameter's. ``skip(name)`` leaves out a
    tensor the model does not hold. Raises ``ValueError`` on an unexpected
    name, a shape mismatch, or a parameter no checkpoint tensor filled.
    """
    params = dict(model.named_parameters())  # a tied lm_head appears once, as the embedding
    loaded: set[str] = set()
    for name, tensor in weights:
        if skip(name):
            continue
        target, shard_id = fused_name(name)
        param = params.get(target)
        if param is None:
            raise ValueError(f"unexpected weight {name!r} in checkpoint (no parameter {target!r})")
        loader = getattr(param, "weight_loader", None)
        try:
            if shard_id is None:
                (loader or copy_weight)(param, tensor.to(param.dtype))
            else:
                loader(param, tensor.to(param.dtype), shard_id)
        except (RuntimeError, ValueError) as e:
            raise ValueError(f"cannot load {name!r} into {target!r}: {e}") from e
        loaded.add(f"{target}:{shard_id}" if shard_id is not None else target)
    missing = missing_weights(model, loaded)
    if missing:
        raise ValueError(f"checkpoint is missing weights for: {sorted(missing)}")
    return {n.split(":")[0] for n in loaded}


def fused_name(name: str) -> tuple[str, str | int | None]:
    """``(our parameter name, shard id)`` for a checkpoint name (shard None: whole)."""
    for fused, piece, shard_id in STACKED_PARAMS_MAPPING:
        if piece in name:
            return name.replace(piece, fused), shard_id
    return name, None


def missing_weights(model: nn.Module, loaded: set[str]) -> list[str]:
    """Parameters (or fused shards) that no checkpoint tensor filled."""
    missing = []
    for name, _ in model.named_parameters():
        if ".qkv_proj." in name:
            shards = [f"{name}:{s}" for s in ("q", "k", "v")]
        elif ".gate_up_proj." in name:
            shards = [f"{name}:{s}" for s in (0, 1)]
        else:
            shards = [name]
        if name in loaded:  # an already-fused checkpoint tensor
            continue
        missing += [s for s in shards if s not in loaded]
    return missing


def copy_weight(param: nn.Parameter, tensor: torch.Tensor) -> None:
    """Copy a whole tensor into a parameter of the same shape."""
    if param.shape != tensor.shape:
        raise ValueError(f"weight shape {tuple(tensor.shape)} != parameter {tuple(param.shape)}")
    param.data.copy_(tensor)
