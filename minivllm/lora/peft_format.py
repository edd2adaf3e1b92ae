"""Read a LoRA adapter saved by PEFT (``save_pretrained``) into a :class:`LoRAModel`.

What you learn here: PEFT's on-disk format, and what must be checked before an
adapter is allowed near a batch. A PEFT LoRA directory holds two files:

- ``adapter_config.json``: ``r`` (the rank), ``lora_alpha``, ``use_rslora``,
  ``target_modules`` (a list of module names such as ``["q_proj", "v_proj"]``, or
  one regular expression that must match the whole module path), per-module
  overrides ``rank_pattern`` / ``alpha_pattern``, ``layers_to_transform``, and
  options that change the maths (DoRA, biases, extra trainable modules ...).
- ``adapter_model.safetensors``: for each adapted module two tensors,
  ``base_model.model.<module path>.lora_A.weight`` ``(r, in)`` and
  ``...lora_B.weight`` ``(out, r)``, e.g.
  ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``.

Every check happens here, when the adapter is loaded, never in a step: a
missing path, an option minivllm does not implement (refused by its name, never
silently ignored), a module it cannot adapt (embeddings, the LM head), a tensor
whose shape does not fit the model, a rank above ``max_lora_rank``, and a file
that disagrees with its own config. Each is a ``ValueError`` that names it.
The per-module rules (which modules a ``target_modules`` entry or pattern selects,
which ``rank_pattern`` key applies) are PEFT's own, re-implemented in
:func:`targeted_modules` and :func:`pattern_key`.
"""

from __future__ import annotations

import json
import math
import pickle
import re
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch
from safetensors import SafetensorError

from minivllm.lora.models import (
    SUPPORTED_MODULES,
    LoRALayerWeights,
    LoRAModel,
    module_name,
    module_shapes,
)
from minivllm.lora.request import LoRARequest

CONFIG_FILE = "adapter_config.json"
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")

#: Options that change what the adapter computes and that minivllm does not implement:
#: name -> (the value that means "off", what it is). Any other value is refused by name.
UNSUPPORTED_OPTIONS: Mapping[str, tuple[Any, str]] = MappingProxyType({
    "use_dora": (False, "DoRA (weight-decomposed LoRA)"),
    "fan_in_fan_out": (False, "fan_in_fan_out (Conv1D-style transposed weights)"),
    "bias": ("none", "trained biases"),
    "lora_bias": (False, "a bias on lora_B"),
    "modules_to_save": (None, "fully fine-tuned extra modules"),
    "trainable_token_indices": (None, "trainable token embeddings"),
    "layer_replication": (None, "layer replication"),
    "target_parameters": (None, "LoRA on raw parameters"),
    "megatron_config": (None, "Megatron-sharded LoRA"),
    "alora_invocation_tokens": (None, "activated LoRA (aLoRA)"),
    "use_qalora": (False, "QA-LoRA"),
    "arrow_config": (None, "Arrow routing"),
    "use_bdlora": (None, "BD-LoRA"),
    "velora_config": (None, "VeLoRA"),
    "monteclora_config": (None, "MonteCLoRA"),
    "kasa_config": (None, "KaSA"),
})
#: Options that only matter while training or initialising (or are bookkeeping): ignored.
TRAINING_ONLY = frozenset({
    "task_type", "peft_type", "auto_mapping", "peft_version", "base_model_name_or_path",
    "revision", "inference_mode", "lora_dropout", "init_lora_weights", "loftq_config",
    "eva_config", "corda_config", "lora_ga_config", "runtime_config", "megatron_core",
    "qalora_group_size", "ensure_weight_tying",
})
#: Options this reader implements.
HANDLED = frozenset({"r", "lora_alpha", "use_rslora", "target_modules", "exclude_modules",
                     "layers_to_transform", "layers_pattern", "rank_pattern", "alpha_pattern"})

# base_model.model.<module path>.lora_A.weight (an adapter name may sit before .weight)
_KEY = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.[^.]+)?\.weight$")
_LAYER_MODULE = re.compile(r"^model\.layers\.(?P<layer>\d+)\.(?P<parent>self_attn|mlp)\."
                           r"(?P<module>[a-z_]+)$")
#: Module paths outside the decoder layers that PEFT could adapt and minivllm refuses.
EMBEDDING_MODULES = ("model.embed_tokens", "lm_head")


def pattern_key(pattern_keys: Any, key: str) -> str | None:
    """PEFT's ``get_pattern_key``: the first of ``pattern_keys`` that matches the end of
    module path ``key`` at a ``.`` boundary (a regular expression), or None."""
    for pattern in pattern_keys:
        if re.match(rf"(.*\.)?({pattern})$", key):
            return pattern
    return None


def _layer_selected(config: dict, key: str) -> bool:
    """PEFT's ``layers_to_transform`` / ``layers_pattern`` rule for a list of targets."""
    layers = config.get("layers_to_transform")
    if layers is None or layers == []:
        return True
    pattern = config.get("layers_pattern")
    if not pattern:
        match = re.match(r".*?\.[^.]*\.(?P<idx>\d+)\.", key)
    else:
        match = None
        for p in [pattern] if isinstance(pattern, str) else pattern:
            match = re.match(rf"(?:^|.*?\.){p}\.(?P<idx>\d+)\.", key)
            if match is not None:
                break
    if match is None:
        return False
    index = int(match.group("idx"))
    return index == layers if isinstance(layers, int) else index in layers


def _excluded(config: dict, key: str) -> bool:
    exclude = config.get("exclude_modules")
    if not exclude:
        return False
    if isinstance(exclude, str):
        return re.fullmatch(exclude, key) is not None
    return key in exclude or any(key.endswith(f".{e}") for e in exclude)


def _target_matches(config: dict, key: str) -> bool:
    """PEFT's ``check_target_module_exists`` for one module path ``key``."""
    if _excluded(config, key):
        return False
    targets = config.get("target_modules")
    if isinstance(targets, str):
        if targets == "all-linear":  # PEFT's shorthand: every linear layer but the LM head
            return key not in EMBEDDING_MODULES
        return re.fullmatch(targets, key) is not None
    found = key in targets or any(key.endswith(f".{t}") for t in targets)
    return found and _layer_selected(config, key)


def targeted_modules(config: dict, num_layers: int) -> set[tuple[int, str]]:
    """``(layer, module)`` pairs that ``config`` adapts in a model of ``num_layers`` layers.

    Raises ``ValueError`` for a target minivllm cannot adapt: the embedding or the
    LM head (by name), or a ``target_modules`` entry that is no projection of a
    Llama-family layer.
    """
    targets = config.get("target_modules")
    if targets is None:
        raise ValueError("adapter_config.json: target_modules is missing")
    if not isinstance(targets, str):
        if not isinstance(targets, list | tuple | set) or not all(isinstance(t, str) for t in targets):
            raise ValueError(f"adapter_config.json: target_modules must be a list of module "
                             f"names or a regular expression, got {targets!r}")
        for t in targets:
            last = t.rsplit(".", 1)[-1]
            if last in ("embed_tokens", "lm_head"):
                raise ValueError(f"adapter_config.json: target_modules names {t!r}: LoRA on the "
                                 f"embedding or the LM head is not supported (only "
                                 f"{list(SUPPORTED_MODULES)})")
            if last not in SUPPORTED_MODULES:
                raise ValueError(f"adapter_config.json: unknown target module {t!r}; minivllm "
                                 f"adapts only {list(SUPPORTED_MODULES)}")
    for key in EMBEDDING_MODULES:
        if isinstance(targets, str) and targets != "all-linear" and _target_matches(config, key):
            raise ValueError(f"adapter_config.json: target_modules {targets!r} matches {key!r}: "
                             f"LoRA on the embedding or the LM head is not supported")
    return {(layer, m) for layer in range(num_layers) for m in SUPPORTED_MODULES
            if _target_matches(config, module_name(layer, m))}


def check_options(config: dict) -> None:
    """Refuse, by name, every option that changes the maths and is not implemented here."""
    peft_type = config.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise ValueError(f"adapter_config.json: peft_type={peft_type!r}; only LoRA adapters "
                         f"(peft_type='LORA') are supported")
    for name, value in config.items():
        if name in UNSUPPORTED_OPTIONS:
            off, what = UNSUPPORTED_OPTIONS[name]
            if value != off and not (off is None and value in ([], {}, "")):
                raise ValueError(f"adapter_config.json: {name}={value!r} ({what}) is not "
                                 f"supported; only {name}={off!r}")
        elif name not in TRAINING_ONLY and name not in HANDLED and value not in (None, False, [],
                                                                                {}, ""):
            raise ValueError(f"adapter_config.json: unknown option {name}={value!r}; minivllm "
                             f"does not know whether it changes the adapter's output")
    for name in ("rank_pattern", "alpha_pattern"):
        value = config.get(name) or {}
        if not isinstance(value, dict):
            raise ValueError(f"adapter_config.json: {name} must be a dict, got {value!r}")


def read_config(path: Path) -> dict:
    """``adapter_config.json`` of adapter directory ``path`` as a dict."""
    file = path / CONFIG_FILE
    if not file.is_file():
        raise ValueError(f"lora_path {str(path)!r} has no {CONFIG_FILE} (not a PEFT adapter "
                         f"directory)")
    try:
        return json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{file}: not valid JSON ({e})") from None


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    """The adapter's tensors: ``adapter_model.safetensors`` (or a PEFT ``.bin``)."""
    for name in WEIGHT_FILES:
        file = path / name
        if not file.is_file():
            continue
        # The libraries' own errors for a cut-off or corrupt file do not say which file.
        try:
            if name.endswith(".safetensors"):
                from safetensors.torch import load_file

                return load_file(str(file))
            return torch.load(file, map_location="cpu", weights_only=True)
        except (SafetensorError, RuntimeError, EOFError, OSError, pickle.UnpicklingError) as e:
            raise ValueError(f"{file}: not a readable {name.rsplit('.', 1)[1]} file "
                             f"(truncated or corrupt?): {e}") from None
    raise ValueError(f"lora_path {str(path)!r} holds no adapter weights (looked for "
                     f"{' or '.join(WEIGHT_FILES)})")


def _parse_keys(tensors: dict[str, torch.Tensor], num_layers: int) -> dict[tuple[int, str], dict]:
    """``(layer, module) -> {"A": tensor, "B": tensor}``, refusing anything else by its key."""
    found: dict[tuple[int, str], dict] = {}
    for key, tensor in tensors.items():
        m = _KEY.match(key)
        if m is None:
            what = ("DoRA magnitudes" if "lora_magnitude_vector" in key else
                    "embedding LoRA" if "lora_embedding" in key else
                    "a bias" if key.endswith(".bias") else "an unknown tensor")
            raise ValueError(f"adapter weights: {key!r} is {what}, which is not supported")
        path = m.group("module")
        lm = _LAYER_MODULE.match(path)
        if path in EMBEDDING_MODULES or path.endswith(("embed_tokens", "lm_head")):
            raise ValueError(f"adapter weights: {key!r} adapts {path!r}: LoRA on the embedding "
                             f"or the LM head is not supported")
        if lm is None or lm.group("module") not in SUPPORTED_MODULES \
                or SUPPORTED_MODULES[lm.group("module")] != lm.group("parent"):
            raise ValueError(f"adapter weights: {key!r} adapts unknown target module {path!r}; "
                             f"minivllm adapts only {list(SUPPORTED_MODULES)} of a decoder layer")
        layer = int(lm.group("layer"))
        if layer >= num_layers:
            raise ValueError(f"adapter weights: {key!r} is for layer {layer}, but the model has "
                             f"{num_layers} layers")
        found.setdefault((layer, lm.group("module")), {})[m.group("ab")] = tensor
    return found


def load_adapter(lora_request: LoRARequest, hf_config: Any, max_lora_rank: int,
                 dtype: torch.dtype = torch.float32) -> LoRAModel:
    """Load and check the PEFT adapter at ``lora_request.lora_path`` for a model (its HF config).

    Returns a :class:`LoRAModel` on the CPU with its A and B in ``dtype``. Raises
    ``ValueError`` naming the adapter's path and the problem (see the module
    docstring); nothing about the adapter is checked later.
    """
    path = Path(lora_request.lora_path)
    try:
        return _read_adapter(path, lora_request, hf_config, max_lora_rank, dtype)
    except ValueError as e:
        # Named here, once, whichever check below refused it: a server loads many adapters.
        if str(path) in str(e):
            raise
        raise ValueError(f"LoRA adapter {str(path)!r}: {e}") from None


def _read_adapter(path: Path, lora_request: LoRARequest, hf_config: Any, max_lora_rank: int,
                  dtype: torch.dtype) -> LoRAModel:
    """:func:`load_adapter`'s reading and checking, each refusal a bare ``ValueError``."""
    if not path.is_dir():
        raise ValueError(f"lora_path {str(path)!r} does not exist or is not a directory "
                         f"(lora_name={lora_request.lora_name!r})")
    config = read_config(path)
    check_options(config)
    r, alpha = config.get("r", 8), config.get("lora_alpha", 8)
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise ValueError(f"adapter_config.json: r must be an int >= 1, got {r!r}")
    use_rslora = bool(config.get("use_rslora", False))
    rank_pattern, alpha_pattern = config.get("rank_pattern") or {}, config.get("alpha_pattern") or {}
    num_layers = hf_config.num_hidden_layers
    expected = targeted_modules(config, num_layers)
    found = _parse_keys(read_tensors(path), num_layers)
    if set(found) != expected:
        extra, missing = sorted(set(found) - expected), sorted(expected - set(found))
        raise ValueError(f"{path}: the weights do not match adapter_config.json's targets "
                         f"(modules with weights but not targeted: {extra[:4]}; targeted but "
                         f"without weights: {missing[:4]})")
    shapes = module_shapes(hf_config)
    loras = {}
    for (layer, module), ab in sorted(found.items()):
        name = module_name(layer, module)
        if set(ab) != {"A", "B"}:
            raise ValueError(f"adapter weights: {name} has lora_{''.join(ab)} but not both "
                             f"lora_A and lora_B")
        a, b = ab["A"], ab["B"]
        rank = a.shape[0]
        in_features, out_features = shapes[module]
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != in_features \
                or b.shape != (out_features, rank):
            raise ValueError(f"adapter weights: {name} has lora_A {tuple(a.shape)} and lora_B "
                             f"{tuple(b.shape)}, but this model's {module} needs lora_A "
                             f"(r, {in_features}) and lora_B ({out_features}, r): an adapter "
                             f"for another model?")
        key = pattern_key(rank_pattern, name)
        want_rank = rank_pattern[key] if key is not None else r
        if rank != want_rank:
            raise ValueError(f"adapter weights: {name} has rank {rank}, but adapter_config.json "
                             f"says r={want_rank}")
        if rank > max_lora_rank:
            raise ValueError(f"adapter {lora_request.lora_name!r} has rank {rank} (in {name}), "
                             f"above max_lora_rank={max_lora_rank}; raise max_lora_rank")
        key = pattern_key(alpha_pattern, name)
        module_alpha = float(alpha_pattern[key] if key is not None else alpha)
        scaling = module_alpha / (math.sqrt(rank) if use_rslora else rank)
        loras[(layer, module)] = LoRALayerWeights(
            layer=layer, module=module, rank=rank, lora_alpha=module_alpha, scaling=scaling,
            lora_a=a.to(dtype).contiguous(), lora_b=b.to(dtype).contiguous())
    if not loras:
        raise ValueError(f"{path}: the adapter adapts no module")
    return LoRAModel(lora_int_id=lora_request.lora_int_id, lora_name=lora_request.lora_name,
                     lora_path=lora_request.lora_path,
                     rank=max(w.rank for w in loras.values()), loras=loras)
