"""A bad file fails at load, at once, with a ValueError or OSError naming the file and the problem.

Every case is a real file on disk: a tiny random-weight model's checkpoint cut
short or overwritten, a GGUF written by the ``gguf`` package and truncated, a
tokenizer with a file missing, a PEFT adapter edited to disagree with itself
or with the model. A loader that lets the library's own error through
(``SafetensorError``, a numpy reshape error, transformers' "Couldn't instantiate
the backend tokenizer") fails these tests: its type is wrong, or it does not
say which file.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import lora_utils
import pytest
import torch
from conftest import byte_tokenizer, make_tiny_config
from test_lora_loader import copy_adapter
from test_lora_loader import load as load_lora

from minivllm.model.loader import ModelNotFoundError, load_model

lora_adapters = lora_utils.lora_adapters  # the session fixture (tests/lora_utils.py)

Q_B = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _cut(file: Path, fraction: float) -> None:
    """Keep the first ``fraction`` of ``file``'s bytes (at least one)."""
    data = file.read_bytes()
    file.write_bytes(data[:max(1, int(len(data) * fraction))])


def _raises(exc_type, path: Path, *problem: str, call) -> str:
    """``call()`` raises ``exc_type`` whose message names ``path`` and every ``problem``."""
    with pytest.raises(exc_type) as info:
        call()
    message = str(info.value)
    assert str(path) in message, message
    for word in problem:
        assert word in message, message
    return message


# ------------------------------------------------------------------------------ safetensors
@pytest.mark.parametrize("fraction", [0.5, 0.999, 0.0001])
def test_truncated_safetensors_names_the_file(tiny_model_dir, tmp_path, fraction):
    model = _copy(tiny_model_dir("llama"), tmp_path / "m")
    _cut(model / "model.safetensors", fraction)
    _raises(ValueError, model / "model.safetensors", "truncated or corrupt",
            call=lambda: load_model(str(model)))


def test_corrupt_safetensors_header_names_the_file(tiny_model_dir, tmp_path):
    model = _copy(tiny_model_dir("llama"), tmp_path / "m")
    data = bytearray((model / "model.safetensors").read_bytes())
    data[8:40] = b"\xff" * 32  # the JSON header's first bytes
    (model / "model.safetensors").write_bytes(bytes(data))
    _raises(ValueError, model / "model.safetensors", "not a readable safetensors file",
            call=lambda: load_model(str(model)))


def test_sharded_checkpoint_with_a_bad_index_or_a_missing_shard(tiny_model_dir, tmp_path):
    model = _copy(tiny_model_dir("llama"), tmp_path / "m")
    (model / "model.safetensors").rename(model / "model-00001-of-00001.safetensors")
    index = model / "model.safetensors.index.json"
    index.write_text("{not json")
    _raises(ValueError, index, "weight_map", call=lambda: load_model(str(model)))
    index.write_text(json.dumps({"weight_map": {"lm_head.weight": "model-00002.safetensors"}}))
    _raises(FileNotFoundError, model / "model-00002.safetensors", "not found",
            call=lambda: load_model(str(model)))


# ------------------------------------------------------------------------------ GGUF
@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    from test_loader import _write_gguf
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(make_tiny_config("llama"), dtype=torch.float32)
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    _write_gguf(path, hf, byte_tokenizer())
    return path


@pytest.mark.parametrize("fraction", [0.999, 0.5, 0.01, 0.0001])
def test_truncated_gguf_names_the_file(tiny_gguf, tmp_path, fraction):
    bad = tmp_path / "cut.gguf"
    shutil.copy(tiny_gguf, bad)
    _cut(bad, fraction)
    _raises(ValueError, bad, "not a readable GGUF file", call=lambda: load_model(str(bad)))


def test_corrupt_gguf_names_the_file(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\xff" * 200)  # the magic, then an impossible version
    _raises(ValueError, bad, "not a readable GGUF file", call=lambda: load_model(str(bad)))


def test_the_untouched_gguf_still_loads(tiny_gguf):
    """The check refuses only bad files (the oracle for the tests above)."""
    module, config, tokenizer = load_model(str(tiny_gguf))
    assert config.num_hidden_layers == 2 and tokenizer is not None


# ------------------------------------------------------------------------------ tokenizer
def test_missing_tokenizer_file_names_the_directory(tiny_model_dir, tmp_path):
    model = _copy(tiny_model_dir("llama"), tmp_path / "m")
    (model / "tokenizer.json").unlink()  # tokenizer_config.json alone: no vocabulary
    _raises(ValueError, model, "cannot load the tokenizer", "tokenizer.json",
            call=lambda: load_model(str(model)))


def test_corrupt_tokenizer_file_names_the_directory(tiny_model_dir, tmp_path):
    model = _copy(tiny_model_dir("llama"), tmp_path / "m")
    (model / "tokenizer.json").write_text("{garbage")
    _raises(ValueError, model, "cannot load the tokenizer",
            call=lambda: load_model(str(model)))


# ------------------------------------------------------------------------------ the folder
def test_missing_model_folder(tmp_path):
    missing = tmp_path / "no-such-model"
    _raises(ModelNotFoundError, missing, "no such directory", call=lambda: load_model(str(missing)))
    assert issubclass(ModelNotFoundError, OSError)


def test_a_file_is_not_a_model_folder(tiny_model_dir):
    config = tiny_model_dir("llama") / "config.json"
    _raises(OSError, config, "is a file, not a model directory",
            call=lambda: load_model(str(config)))


def test_corrupt_config_json_names_it(tiny_model_dir, tmp_path):
    model = _copy(tiny_model_dir("llama"), tmp_path / "m")
    (model / "config.json").write_text("{not json")
    _raises(OSError, model / "config.json", "not a valid JSON",
            call=lambda: load_model(str(model)))


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads a folder whatever its mode")
def test_unreadable_model_folder(tiny_model_dir, tmp_path):
    model = _copy(tiny_model_dir("llama"), tmp_path / "m")
    model.chmod(0o000)
    try:
        _raises(PermissionError, model, "no permission", call=lambda: load_model(str(model)))
    finally:
        model.chmod(0o755)


# ------------------------------------------------------------------------------ LoRA adapters
@pytest.mark.parametrize("edit, tensors, problem", [
    (lambda c: c.update(r=8), None, "rank 4, but adapter_config.json says r=8"),
    (None, lambda w: w.pop(Q_B), "not both lora_A and lora_B"),
    (None, lambda w: w.__setitem__(Q_B, torch.zeros(64, 5)), "lora_B (64, 5)"),
    (lambda c: c.update(target_modules=["q_proj", "fc1"]), None, "unknown target module 'fc1'"),
    (lambda c: c.update(target_modules=["q_proj"]), None, "not targeted"),
], ids=["rank", "missing-tensor", "shape", "unknown-target", "untargeted-weights"])
def test_adapter_that_disagrees_names_its_path(lora_adapters, tmp_path, edit, tensors, problem):
    _, adapters = lora_adapters("llama")
    bad = copy_adapter(adapters["qv_r4"], tmp_path / "bad", edit=edit, tensors=tensors)
    _raises(ValueError, bad, problem, call=lambda: load_lora(bad))


def test_adapter_for_a_smaller_model_names_its_path(lora_adapters):
    _, adapters = lora_adapters("llama")
    _raises(ValueError, adapters["qv_r4"], "layer 1, but the model has 1 layers",
            call=lambda: load_lora(adapters["qv_r4"], num_hidden_layers=1))


@pytest.mark.parametrize("fraction", [0.5, 0.0001])
def test_truncated_adapter_weights_name_the_file(lora_adapters, tmp_path, fraction):
    _, adapters = lora_adapters("llama")
    bad = copy_adapter(adapters["qv_r4"], tmp_path / "bad")
    _cut(bad / "adapter_model.safetensors", fraction)
    _raises(ValueError, bad / "adapter_model.safetensors", "truncated or corrupt",
            call=lambda: load_lora(bad))
