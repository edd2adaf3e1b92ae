"""The model's ``generation_config.json``: its recommended sampling defaults and EOS ids.

A Hugging Face model folder may carry a ``generation_config.json`` written by the
model's authors: the temperature, top-p, ... they recommend, and often more than one
end-of-sequence id (a chat model that ends a turn with ``<|eot_id|>`` as well as
``<|end_of_text|>``). vLLM reads it by default, and so does minivllm, with vLLM's
engine argument and meaning (``--generation-config``):

- ``"auto"`` (the default): read ``generation_config.json`` beside the model (the
  model folder, or the folder of a ``.gguf`` file); no file, no defaults.
- ``"vllm"``: ignore it; the defaults are :class:`~minivllm.SamplingParams`'s own.
- a folder: read ``generation_config.json`` from there instead.

What is taken, as vLLM takes it (``ModelConfig.get_diff_sampling_param``): the keys
``temperature``, ``top_p``, ``top_k``, ``min_p``, ``repetition_penalty`` and
``max_new_tokens`` (as ``max_tokens``) that the file sets (vLLM keeps what
``GenerationConfig.to_diff_dict()`` keeps; since transformers 5 every default is
None, so that is every key the file writes, ``top_k: 50`` included). They apply where a request
sets nothing: ``LLM.generate(prompts)`` without sampling params, an HTTP request
without the field. Every ``eos_token_id`` of the file stops generation: the ones
that are not the tokenizer's EOS join each request's ``stop_token_ids`` (unless
``ignore_eos``), as vLLM's ``SamplingParams.update_from_generation_config`` does.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from minivllm.sampling_params import SamplingParams

#: The file's name in a model folder.
FILE_NAME = "generation_config.json"
#: The named modes; anything else must be a folder holding :data:`FILE_NAME`.
MODES = ("auto", "vllm")
#: generation_config.json key -> SamplingParams field (vLLM's list).
SAMPLING_KEYS = MappingProxyType({
    "temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
    "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"})


def check_generation_config(value: Any) -> None:
    """Raise ``ValueError`` naming ``generation_config`` unless it is a mode or a folder
    that holds ``generation_config.json``."""
    if isinstance(value, str) and value in MODES:
        return
    if not isinstance(value, (str, Path)) or not str(value):
        raise ValueError(f"generation_config must be 'auto', 'vllm' or a folder holding "
                         f"{FILE_NAME}, got {value!r}")
    folder = Path(value).expanduser()
    if not (folder / FILE_NAME).is_file():
        raise ValueError(f"generation_config must be 'auto', 'vllm' or a folder holding "
                         f"{FILE_NAME}, got {str(value)!r} (no {folder / FILE_NAME})")


@dataclass(frozen=True)
class GenerationDefaults:
    """What the engine took from a generation config (nothing with ``"vllm"``).

    Args:
        sampling: SamplingParams field -> the model's recommended value.
        eos_token_ids: every EOS id the file names (the tokenizer's may be among them).
        source: the file read, or None.
    """

    sampling: dict[str, Any] = field(default_factory=dict)
    eos_token_ids: tuple[int, ...] = ()
    source: Path | None = None

    def default_sampling_params(self) -> SamplingParams:
        """``SamplingParams()`` with the model's recommended values (vLLM's
        ``LLM.get_default_sampling_params``)."""
        return SamplingParams(**self.sampling)

    def with_eos(self, params: SamplingParams, model_eos: int | None) -> SamplingParams:
        """``params`` whose ``stop_token_ids`` also hold the file's other EOS ids, so that
        each of them ends generation; unchanged with ``ignore_eos`` or none to add."""
        extra = [t for t in self.eos_token_ids
                 if t != model_eos and t not in params.stop_token_ids]
        if params.ignore_eos or not extra:
            return params
        return dataclasses.replace(params, stop_token_ids=[*params.stop_token_ids, *extra])

    def describe(self) -> str:
        """One line for the log: what was taken, from where."""
        if self.source is None:
            return "no generation config read"
        return (f"from {self.source}: sampling defaults {self.sampling or '{}'}, "
                f"EOS ids {list(self.eos_token_ids)}")


def read_generation_config(path: Path) -> GenerationDefaults:
    """The defaults in one ``generation_config.json``; ``ValueError`` naming the file and
    the key for a file that is not JSON or holds a value SamplingParams refuses."""
    try:
        raw = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not a readable JSON generation config ({e})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: a generation config is a JSON object, "
                         f"got {type(raw).__name__}")
    sampling = {name: raw[key] for key, name in SAMPLING_KEYS.items()
                if raw.get(key) is not None}
    try:
        SamplingParams(**sampling)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
    eos = raw.get("eos_token_id")
    eos = [eos] if isinstance(eos, int) else (eos or [])
    if not isinstance(eos, list) or not all(isinstance(t, int) and not isinstance(t, bool)
                                            and t >= 0 for t in eos):
        raise ValueError(f"{path}: eos_token_id must be a non-negative int or a list of "
                         f"them, got {raw.get('eos_token_id')!r}")
    return GenerationDefaults(sampling, tuple(dict.fromkeys(eos)), path)


def load_generation_defaults(value: str | Path, model: str | Path) -> GenerationDefaults:
    """The defaults ``--generation-config value`` means for ``model`` (a registered name,
    a folder, or a ``.gguf`` file whose folder is read)."""
    check_generation_config(value)
    if value == "vllm":
        return GenerationDefaults()
    if value == "auto":
        from minivllm.model.loader import resolve_model_path

        model_path = resolve_model_path(model)
        folder = model_path if model_path.is_dir() else model_path.parent
    else:
        folder = Path(value).expanduser()
    path = folder / FILE_NAME
    return read_generation_config(path) if path.is_file() else GenerationDefaults()
